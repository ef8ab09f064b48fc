"""`drasil migrate check` against the real API server, with read permissions only.

`--from device-plugin` (the default): a namespace is seeded with a dozen workloads as a
cluster on NVIDIA's device plugin has them (no kubelet runs them: what is judged is
their spec), two GPU Nodes that advertise `nvidia.com/gpu` in pools `a` and `b`, and
the device plugin's time-slicing ConfigMap. The command runs as a user would (`python
-m drasil.driver.cli migrate check -f values.yaml`) with the token of a ServiceAccount
whose ClusterRole only gets and lists (the one docs/migrating.md gives), and must print
the verdict in VERDICTS for each workload of the namespace, and pool `a` (whose one GPU
Pod moves unchanged) before pool `b`.

`--from nvidia-dra`: a namespace is seeded with objects as a cluster on NVIDIA's DRA
driver has them (claims and templates of NVIDIA's quickstart, a memory share, a VFIO
claim, an IMEX channel template with its ComputeDomainChannelConfig, a class of the
user's standing for `nvidia.com/mig-1g.12gb`, and the Pods that use them), and the
command, with the same token, must print each one's verdict, the claims
kube-controller-manager makes for the Pods left out.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from e2e.harness import paths
from e2e.harness.chart import token_kubeconfig
from e2e.harness.kube import RESOURCE, Kube

VALUES = {
    "deviceClasses": {
        "extendedResourceName": "nvidia.com/gpu",
        "migProfiles": ["1g.10gb", "1g.10gb+me"],
        "migExtendedResourcePrefix": "nvidia.com/mig-",
    },
    "nodeLabels": {"names": "gfd"},
}
TIME_SLICING = {
    "version": "v1",
    "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}},
}
# The read-only ClusterRole of docs/migrating.md.
READER_RULES = [
    {"apiGroups": [""], "resources": ["pods", "nodes", "configmaps"], "verbs": ["get", "list"]},
    {"apiGroups": ["apps"], "resources": ["deployments", "statefulsets"], "verbs": ["get", "list"]},
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list"]},
    {
        "apiGroups": ["resource.k8s.io"],
        "resources": [
            "deviceclasses",
            "resourceclaims",
            "resourceclaimtemplates",
            "resourceslices",
        ],
        "verbs": ["get", "list"],
    },
    {
        "apiGroups": ["resource.nvidia.com"],
        "resources": ["computedomains"],
        "verbs": ["get", "list"],
    },
]
UNCHANGED, CHANGE, BLOCKED = "runs unchanged", "needs a change", "cannot move yet"


def _container(limits: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "name": "main",
        "image": "registry.invalid/never-pulled:1",
        "resources": {"limits": limits or {}},
        **extra,
    }


def _pod_spec(*containers: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"containers": list(containers), "restartPolicy": "Never", **extra}


# name -> (kind, Pod spec, the verdict expected)
WORKLOADS: dict[str, tuple[str, dict[str, Any], str]] = {
    "train-8gpu": ("Job", _pod_spec(_container({"nvidia.com/gpu": "8"})), UNCHANGED),
    "infer-timesliced": (
        "Deployment",
        _pod_spec(_container({"nvidia.com/gpu.shared": "1"})),
        CHANGE,
    ),
    "mig-small": ("Deployment", _pod_spec(_container({"nvidia.com/mig-1g.10gb": "1"})), UNCHANGED),
    "mig-me": ("Job", _pod_spec(_container({"nvidia.com/mig-1g.10gb.me": "1"})), UNCHANGED),
    "mig-big": ("Deployment", _pod_spec(_container({"nvidia.com/mig-3g.40gb": "1"})), CHANGE),
    "notebook": (
        "StatefulSet",
        _pod_spec(
            _container({"nvidia.com/gpu": "1"}),
            nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        ),
        UNCHANGED,
    ),
    "old-selector": (
        "Deployment",
        _pod_spec(
            _container({"nvidia.com/gpu": "1"}), nodeSelector={"nvidia.com/gpu.machine": "dgx"}
        ),
        CHANGE,
    ),
    "gpu-monitor": (
        "Pod",
        _pod_spec(_container(env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}])),
        BLOCKED,
    ),
    "vgpu-desktop": ("Deployment", _pod_spec(_container({"nvidia.com/vgpu": "1"})), BLOCKED),
    "requests-and-limits": (
        "Pod",
        _pod_spec(
            {
                "name": "main",
                "image": "registry.invalid/never-pulled:1",
                "resources": {
                    "requests": {"nvidia.com/gpu": "1"},
                    "limits": {"nvidia.com/gpu": "1"},
                },
            }
        ),
        UNCHANGED,
    ),
    "bare-on-a": ("Pod-a", _pod_spec(_container({"nvidia.com/gpu": "2"})), UNCHANGED),
    "bare-on-b": ("Pod-b", _pod_spec(_container({"nvidia.com/gpu.shared": "1"})), CHANGE),
    "web": ("Deployment", _pod_spec(_container({"cpu": "1"})), ""),  # no GPU: not listed
}


def _manifest(kind: str, name: str, spec: dict[str, Any], nodes: dict[str, str]) -> dict[str, Any]:
    if kind.startswith("Pod"):
        node = {"nodeName": nodes[kind[-1]]} if "-" in kind else {}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                "spec": {**spec, **node}}  # fmt: skip
    labels = {"app": name}
    template = {"metadata": {"labels": labels}, "spec": spec}
    if kind == "Job":
        body: dict[str, Any] = {"template": template}
        version = "batch/v1"
    else:
        restart = {**spec, "restartPolicy": "Always"}
        body = {"selector": {"matchLabels": labels}, "template": {**template, "spec": restart}}
        body |= {"replicas": 0} | ({"serviceName": name} if kind == "StatefulSet" else {})
        version = "apps/v1"
    return {"apiVersion": version, "kind": kind, "metadata": {"name": name}, "spec": body}


@pytest.fixture
def reader(kube: Kube, kubeconfig: Path, namespace: str, tmp_path: Path) -> Iterator[Path]:
    """A kubeconfig of a ServiceAccount that may only get and list."""
    name = f"migrate-reader-{secrets.token_hex(3)}"
    kube.create(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}, namespace
    )
    rbac = "rbac.authorization.k8s.io/v1"
    kube.create({"apiVersion": rbac, "kind": "ClusterRole", "metadata": {"name": name},
                 "rules": READER_RULES})  # fmt: skip
    subject = {"kind": "ServiceAccount", "name": name, "namespace": namespace}
    kube.create(
        {
            "apiVersion": rbac,
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": name,
            },
            "subjects": [subject],
        }
    )
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600)
    )
    issued = kube.core.create_namespaced_service_account_token(
        name, namespace, request, _request_timeout=30
    )
    assert issued.status is not None
    assert issued.status.token
    try:
        yield token_kubeconfig(kubeconfig, issued.status.token, tmp_path / "reader", name)
    finally:
        kube.delete(rbac, "ClusterRoleBinding", name)
        kube.delete(rbac, "ClusterRole", name)


def test_every_workload_gets_its_verdict_and_the_clean_pool_comes_first(
    kube: Kube,
    namespace: str,
    reader: Path,
    make_node: Callable[..., dict[str, Any]],
    tmp_path: Path,
) -> None:
    suffix = secrets.token_hex(3)
    pool_label = f"e2e.drasil.dev/pool-{suffix}"
    nodes = {p: f"e2e-migrate-{p}-{suffix}" for p in ("a", "b")}
    for pool, node in nodes.items():
        make_node(node, labels={pool_label: pool}, extended={"nvidia.com/gpu": "8"})
    config = {"config.yaml": yaml.safe_dump(TIME_SLICING)}
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "dp-config"},
                 "data": config}, namespace)  # fmt: skip
    for name, (kind, spec, _) in WORKLOADS.items():
        kube.create(_manifest(kind, name, spec, nodes), namespace)
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(VALUES))

    result = subprocess.run(
        [sys.executable, "-m", "drasil.driver.cli", "migrate", "check",
         f"--kubeconfig={reader}", f"--values={values}", f"--pool-label={pool_label}"],
        capture_output=True, text=True, timeout=120, check=False, cwd=paths.CHECKOUT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "may not list" not in result.stderr, result.stderr  # read rights are enough
    rows = [line.split("\t") for line in result.stdout.splitlines() if "\t" in line]
    verdicts = {
        row[0].split("/", 1)[1]: row[1]
        for row in rows
        if row[0].split(" ")[-1].startswith(f"{namespace}/")
    }
    expected = {name: verdict for name, (_, _, verdict) in WORKLOADS.items() if verdict}
    assert verdicts == expected, result.stdout
    why = {row[0].split("/", 1)[1]: row[2] for row in rows if f" {namespace}/" in row[0]}
    assert "was 1/4 of a GPU" in why["train-8gpu"]  # the ConfigMap's time-slicing
    assert "add 3g.40gb to deviceClasses.migProfiles" in why["mig-big"]
    pools = [row[0] for row in rows if row[0] in ("a", "b")]
    assert pools == ["a", "b"], result.stdout


# -- --from nvidia-dra ---------------------------------------------------------------------

NVIDIA_CONFIG = "resource.nvidia.com/v1beta1"
ATTRS = "device.attributes['gpu.nvidia.com']"


def _exactly(name: str, device_class: str = "gpu.nvidia.com", **more: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": device_class, **more}}


def _opaque(requests: list[str], driver: str = "gpu.nvidia.com", **params: Any) -> dict[str, Any]:
    return {"requests": requests, "opaque": {"driver": driver, "parameters": params}}


def _gpu_config(sharing: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": NVIDIA_CONFIG, "kind": "GpuConfig", "sharing": sharing}


MPS = _gpu_config({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}})
LONG = _gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})
EVEN = " || ".join(f"{ATTRS}.index == {i}" for i in (0, 2, 4, 6))
# name -> (ResourceClaimTemplate spec.spec.devices, the verdict, a part of why)
DRA_TEMPLATES: dict[str, tuple[dict[str, Any], str, str]] = {
    "multiple-gpus": (  # gpu-test5
        {
            "requests": [_exactly("ts-gpu"), _exactly("mps-gpu")],
            "config": [_opaque(["ts-gpu"], **LONG), _opaque(["mps-gpu"], **MPS)],
        },
        UNCHANGED,
        "",
    ),
    "a100": (  # gpu-test6
        {
            "requests": [
                _exactly(
                    "gpu",
                    selectors=[
                        {
                            "cel": {
                                "expression": f"{ATTRS}.productName.lowerAscii()"
                                f".matches('^.*a100.*$') && ({EVEN})"
                            }
                        }
                    ],
                )
            ],
            "config": [_opaque(["gpu"], **LONG)],
        },
        UNCHANGED,
        "",
    ),
    "gpu-4gi": (  # consumable-shares/memory-sharing.yaml
        {"requests": [_exactly("gpu", capacity={"requests": {"memory": "4Gi"}})]},
        CHANGE,
        "set the chart value gpuSharing: consumable",
    ),
    "two-mps-gpus": (
        {"requests": [_exactly("gpu", count=2)], "config": [_opaque(["gpu"], **MPS)]},
        CHANGE,
        "one MPS device per claim",
    ),
    "nvl-partition": (
        {
            "requests": [
                _exactly("gpu", selectors=[{"cel": {"expression": f"{ATTRS}.gpuModuleId == 1"}}])
            ]
        },
        CHANGE,
        "attribute gpu.nvidia.com/gpuModuleId, which drasil does not publish",
    ),
    "single-gpu-vfio": (  # gpu-test-vfiopci
        {"requests": [_exactly("gpu", "vfio.gpu.nvidia.com")]},
        CHANGE,
        "passthrough.enabled",
    ),
    "imex-channel-0": (  # what NVIDIA's controller makes for a ComputeDomain
        {
            "requests": [_exactly("channel", "compute-domain-default-channel.nvidia.com")],
            "config": [
                _opaque(
                    ["channel"],
                    "compute-domain.nvidia.com",
                    apiVersion=NVIDIA_CONFIG,
                    kind="ComputeDomainChannelConfig",
                    domainID="2b5a3e3a-1f39-4e0e-8d7c-3c8f5c1a1e42",
                )
            ],
        },
        BLOCKED,
        "ComputeDomains",
    ),
    "nic": ({"requests": [_exactly("nic", "sriov.example.com")]}, "", ""),  # not NVIDIA's
}
# Pods: name -> (Pod spec, the verdict)
DRA_PODS: dict[str, tuple[dict[str, Any], str]] = {
    "pod0": (
        _pod_spec(
            _container(),
            resourceClaims=[{"name": "gpus", "resourceClaimTemplateName": "multiple-gpus"}],
        ),
        UNCHANGED,
    ),
    "vfio-pod": (
        _pod_spec(
            _container(),
            resourceClaims=[{"name": "gpu", "resourceClaimTemplateName": "single-gpu-vfio"}],
        ),
        CHANGE,
    ),
    "imex-pod": (
        _pod_spec(
            _container(),
            resourceClaims=[
                {"name": "gpus", "resourceClaimName": "single-gpu"},
                {"name": "imex", "resourceClaimTemplateName": "imex-channel-0"},
            ],
        ),
        BLOCKED,
    ),
    "mig-1g-12gb": (_pod_spec(_container({"nvidia.com/mig-1g.12gb": "1"})), UNCHANGED),
    "gpu-full": (_pod_spec(_container({"nvidia.com/gpu": "1"})), UNCHANGED),
    "nic-pod": (
        _pod_spec(_container(), resourceClaims=[{"name": "n", "resourceClaimTemplateName": "nic"}]),
        "",
    ),
}


def test_from_nvidia_dra_every_object_and_workload_gets_its_verdict(
    kube: Kube, namespace: str, reader: Path, tmp_path: Path
) -> None:
    device_class = f"mig-1g-12gb-{secrets.token_hex(3)}.gpu.nvidia.com"
    selector = (
        f"device.driver == 'gpu.nvidia.com' && {ATTRS}.type == 'mig' && "
        f"{ATTRS}.profile == '1g.12gb'"
    )
    kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "DeviceClass",
            "metadata": {"name": device_class},
            "spec": {
                "selectors": [{"cel": {"expression": selector}}],
                "extendedResourceName": "nvidia.com/mig-1g.12gb",
            },
        }
    )
    try:
        for name, (devices, _, _) in DRA_TEMPLATES.items():
            kube.create(
                {
                    "apiVersion": RESOURCE,
                    "kind": "ResourceClaimTemplate",
                    "metadata": {"name": name},
                    "spec": {"spec": {"devices": devices}},
                },
                namespace,
            )
        claim = {"requests": [_exactly("gpu")]}  # gpu-test3's
        kube.create({"apiVersion": RESOURCE, "kind": "ResourceClaim",
                     "metadata": {"name": "single-gpu"}, "spec": {"devices": claim}},
                    namespace)  # fmt: skip
        for name, (spec, _) in DRA_PODS.items():
            kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                         "spec": spec}, namespace)  # fmt: skip
        deployment = _manifest(
            "Deployment",
            "memory-sharing",
            _pod_spec(
                _container(),
                resourceClaims=[{"name": "gpu", "resourceClaimTemplateName": "gpu-4gi"}],
            ),
            {},
        )
        kube.create(deployment, namespace)
        values = tmp_path / "values.yaml"
        values.write_text("compatibility: nvidia-dra\n")

        result = subprocess.run(
            [sys.executable, "-m", "drasil.driver.cli", "migrate", "check", "--from",
             "nvidia-dra", f"--kubeconfig={reader}", f"--values={values}"],
            capture_output=True, text=True, timeout=120, check=False, cwd=paths.CHECKOUT,
        )  # fmt: skip
    finally:
        kube.delete(RESOURCE, "DeviceClass", device_class)
    assert result.returncode == 0, result.stderr
    assert "may not list" not in result.stderr, result.stderr
    rows = [line.split("\t") for line in result.stdout.splitlines() if "\t" in line]
    found = {row[0]: (row[1], row[2]) for row in rows if f" {namespace}/" in row[0]}
    expected = {
        f"ResourceClaimTemplate {namespace}/{name}": (verdict, why)
        for name, (_, verdict, why) in DRA_TEMPLATES.items()
        if verdict
    }
    expected |= {f"Pod {namespace}/{name}": (v, "") for name, (_, v) in DRA_PODS.items() if v}
    expected[f"ResourceClaim {namespace}/single-gpu"] = (UNCHANGED, "")
    expected[f"Deployment {namespace}/memory-sharing"] = (CHANGE, "gpuSharing: consumable")
    assert {ref: v for ref, (v, _) in found.items()} == {
        ref: v for ref, (v, _) in expected.items()
    }, result.stdout  # the claims made for the Pods are not listed: judged as templates
    for ref, (_, why) in expected.items():
        assert why in found[ref][1], (ref, found[ref])
    assert "passthrough.enabled" in found[f"Pod {namespace}/vfio-pod"][1]
    assert "ComputeDomains" in found[f"Pod {namespace}/imex-pod"][1]
    classes = {row[0]: row[1] for row in rows if row[0].startswith("DeviceClass ")}
    assert classes.get(f"DeviceClass {device_class}") == UNCHANGED, result.stdout
    assert "judged for: compatibility nvidia-dra, gpuSharing exclusive, passthrough off" in (
        result.stdout
    )

"""Standard attributes and device metadata against the real control plane.

A plugin process on a fake node publishes ``h100-80gb:8`` (GPUs 0-3 on NUMA node 0,
4-7 on NUMA node 1). kube-scheduler allocates a claim with two requests constrained
to one ``resource.kubernetes.io/numaNode`` (KEP-6072); the test, acting as kubelet,
prepares it and reads what the container would get through the claim's CDI spec: each
request's KEP-5304 metadata file, bind-mounted at its well-known path.
"""

from __future__ import annotations

import json
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.harness.kube import RESOURCE, Kube, NotYet, wait_for
from e2e.harness.pluginproc import DRIVER, GPU_CLASS, ClaimId, KubeletClient, PluginProcess

NUMA = "resource.kubernetes.io/numaNode"
METADATA_DIR = "/var/run/kubernetes.io/dra-device-attributes"


@pytest.fixture(scope="module")
def gpu_class(kube: Kube) -> Iterator[str]:
    kube.delete(RESOURCE, "DeviceClass", DRIVER)
    kube.create(GPU_CLASS)
    yield DRIVER
    kube.delete(RESOURCE, "DeviceClass", DRIVER)


@pytest.fixture
def node(make_node: Callable[..., dict[str, Any]]) -> str:
    name = f"e2e-numa-{secrets.token_hex(3)}"
    make_node(name)
    return name


@pytest.fixture
def plugin(plugin_kubeconfig: Path, node: str) -> Iterator[PluginProcess]:
    # A short root: unix socket paths must stay under ~105 bytes.
    root = Path(tempfile.mkdtemp(prefix="drasil-e2e-"))
    proc = PluginProcess(root=root, kubeconfig=plugin_kubeconfig, node_name=node)
    proc.start()
    yield proc
    proc.stop()
    shutil.rmtree(root, ignore_errors=True)


def published(kube: Kube, node: str) -> dict[str, dict[str, Any]]:
    """The node's devices by name, once all eight are published."""

    def devices() -> Any:
        items = kube.resource(RESOURCE, "ResourceSlice").get(field_selector=f"spec.nodeName={node}")
        found = {
            d["name"]: d
            for s in items.items
            for d in dict(s.to_dict())["spec"].get("devices") or []
        }
        return found if len(found) == 8 else NotYet(sorted(found))

    result: dict[str, dict[str, Any]] = wait_for(devices, timeout=60, what="8 devices published")
    return result


def same_numa_claim(kube: Kube, namespace: str, node: str) -> dict[str, Any]:
    """A claim for three GPUs in two requests on one NUMA node, reserved by a Pod on
    ``node``; returned once the scheduler allocated it."""
    name = f"numa-{secrets.token_hex(3)}"
    requests = [
        {"name": "a", "exactly": {"deviceClassName": DRIVER, "count": 2}},
        {"name": "b", "exactly": {"deviceClassName": DRIVER}},
    ]
    kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": requests, "constraints": [{"matchAttribute": NUMA}]}},
        },
        namespace,
    )
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "containers": [
                    {
                        "name": "c",
                        "image": "registry.invalid/none:1",
                        "resources": {"claims": [{"name": "gpus"}]},
                    }
                ],
                "resourceClaims": [{"name": "gpus", "resourceClaimName": name}],
            },
        },
        namespace,
    )

    def allocated() -> Any:
        claim = dict(
            kube.resource(RESOURCE, "ResourceClaim").get(name=name, namespace=namespace).to_dict()
        )
        status = claim.get("status") or {}
        return claim if status.get("allocation") and status.get("reservedFor") else NotYet(status)

    result: dict[str, Any] = wait_for(allocated, timeout=60, what=f"claim {name} allocated")
    return result


def test_numa_node_is_published_and_matched_and_described(
    kube: Kube, namespace: str, node: str, gpu_class: str, plugin: PluginProcess
) -> None:
    devices = published(kube, node)
    numa = {name: d["attributes"][NUMA]["int"] for name, d in devices.items()}
    assert numa == {f"gpu-{i}": 0 if i < 4 else 1 for i in range(8)}

    claim = same_numa_claim(kube, namespace, node)
    results = claim["status"]["allocation"]["devices"]["results"]
    assert sorted(r["request"] for r in results) == ["a", "a", "b"]
    assert len({numa[r["device"]] for r in results}) == 1  # the scheduler kept them together

    meta = claim["metadata"]
    ref = ClaimId(namespace=namespace, name=meta["name"], uid=meta["uid"])
    kubelet = KubeletClient(plugin)
    try:
        entry = kubelet.prepare([ref]).claims[ref.uid]
        assert entry.error == ""
        ids = [i for d in entry.devices for i in d.cdi_device_ids]
        # Each request's metadata mount is handed out once, beside its devices.
        kind = f"k8s.{DRIVER}/claim"
        assert sorted(i for i in ids if "_" in i) == [f"{kind}={ref.uid}_a", f"{kind}={ref.uid}_b"]
        check_metadata(plugin, ref, results, devices)
        assert kubelet.unprepare([ref]).claims[ref.uid].error == ""
    finally:
        kubelet.close()
    spec = plugin.cdi_root / f"k8s.{DRIVER}-claim_{ref.uid}.json"
    assert not spec.exists()
    assert not (plugin.state_dir / "dra-device-metadata" / ref.uid).exists()


def check_metadata(
    plugin: PluginProcess,
    ref: ClaimId,
    results: list[dict[str, Any]],
    devices: dict[str, dict[str, Any]],
) -> None:
    """What the runtime would mount: the spec's mounts, and the files they name."""
    spec = json.loads((plugin.cdi_root / f"k8s.{DRIVER}-claim_{ref.uid}.json").read_text())
    mounts = {
        d["name"]: d["containerEdits"]["mounts"][0] for d in spec["devices"] if "_" in d["name"]
    }
    for request in ("a", "b"):
        mount = mounts[f"{ref.uid}_{request}"]
        assert mount["containerPath"] == (
            f"{METADATA_DIR}/resourceclaims/{ref.name}/{request}/{DRIVER}-metadata.json"
        )
        assert mount["options"] == ["ro", "bind"]
        lines = Path(mount["hostPath"]).read_text().splitlines()
        docs = [json.loads(line) for line in lines]
        assert [d["apiVersion"] for d in docs] == [
            "metadata.resource.k8s.io/v1beta1",
            "metadata.resource.k8s.io/v1alpha1",
        ]
        doc = docs[0]
        assert doc["metadata"]["uid"] == ref.uid
        (req,) = doc["requests"]
        assert req["name"] == request
        mine = sorted(r["device"] for r in results if r["request"] == request)
        assert sorted(d["name"] for d in req["devices"]) == mine
        for device in req["devices"]:
            published_attributes = devices[device["name"]]["attributes"]
            # Every attribute as the slice publishes it, memory beside them.
            for key, value in published_attributes.items():
                assert device["attributes"][key] == {
                    k: v for k, v in value.items() if v is not None
                }
            assert device["attributes"]["memory"]["int"] > 0

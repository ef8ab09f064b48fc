"""The example driver's demo scenarios, rewritten for drasil, on the chart in each mode.

kubernetes-sigs/dra-example-driver demonstrates DRA with the workloads of its
`demo/examples/`; each README says what the workload must show ("each pod received a
different GPU", "both containers show the same GPU ID", ...). Here each is written
again for drasil's devices and run the way a user runs them: the chart installed on the
real node (driver `gpu.examples.drasil.dev`, simulated H100s, the chart's RBAC), Pods
that print what they were given, read back from their logs and from the claims. One
test per mode of the plugin (`gpuSharing` exclusive or consumable, `migMode` static or
dynamic) starts every scenario of that mode at once, each in a namespace of its own,
checks each, and fails naming every scenario that did not show what it must.

The scenarios of the example driver that this module does not hold run elsewhere on
the chart: binding conditions and host CPUs with a GPU (`native-resource-request`) in
`e2e/test_install.py`, PodGroups in `e2e/test_podgroup.py`, health in
`e2e/test_pod_health.py`; `net-consumable-capacity` is about NICs, and
`podresources-api` needs a client of kubelet's PodResources API the harness does not
have (docs/e2e.md).
"""

from __future__ import annotations

import functools
import json
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from e2e.harness import versions
from e2e.harness.chart import CHART, LocalNode, helm, local_node_values
from e2e.harness.cluster.host import free_ports
from e2e.harness.cluster.node import Node
from e2e.harness.kube import RESOURCE, Kube, NotYet, device_classes, gone, wait_for
from e2e.harness.pods import (
    container_env,
    device_variable,
    events,
    visible_uuids,
    wait_running,
)
from tools.image import LocalImage, build_image, import_image

DRIVER = "gpu.examples.drasil.dev"
GPUS = 32
PROFILE = f"h100-80gb:{GPUS}"
H100 = "NVIDIA H100 80GB HBM3"
ATTRIBUTE = f'device.attributes["{DRIVER}"]'
# Scenarios that take any GPU use the class of minors below GENERAL; the taint and
# mode scenarios name their own GPUs above it, so no scenario takes another's.
GENERAL = 24
SHARE_MINOR = GENERAL + 4  # the mode scenarios' GPU; taints take GENERAL to GENERAL + 3
GPU_CLASS = f"gpu.{DRIVER}"
MIG_CLASS = f"mig.{DRIVER}"
EXTENDED_CLASS = f"extended.{DRIVER}"
WHOLE_CLASS = f"whole.{DRIVER}"
EXTENDED_RESOURCE = "examples.drasil.dev/gpu"
TAINT_KEY = "examples.drasil.dev/maintenance"
COMMAND = "env | sort; trap 'exit 0' TERM; sleep 3600 & wait"
TIMEOUT = 180

MODES: dict[str, dict[str, str]] = {
    "exclusive": {"gpuSharing": "exclusive", "migMode": "static"},
    "consumable": {"gpuSharing": "consumable", "migMode": "static"},
    "dynamic-mig": {"gpuSharing": "exclusive", "migMode": "dynamic"},
    "dynamic-mig-consumable": {"gpuSharing": "consumable", "migMode": "dynamic"},
}


# -- the chart ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def image(node: Node) -> LocalImage:
    built = build_image()
    import_image(built, ctr=node.bin("ctr"), address=node.containerd_socket)
    return built


@pytest.fixture(scope="module")
def classes(kube: Kube) -> Iterator[None]:
    """The scenarios' DeviceClasses: whole GPUs (below GENERAL), MIG devices, whole GPUs
    behind an extended resource name, and every whole GPU."""
    gpu = f'device.driver == "{DRIVER}" && {ATTRIBUTE}.type == "gpu"'
    specs = {
        GPU_CLASS: {"selectors": [_cel(f"{gpu} && {ATTRIBUTE}.minor < {GENERAL}")]},
        MIG_CLASS: {
            "selectors": [_cel(f'device.driver == "{DRIVER}" && {ATTRIBUTE}.type == "mig"')]
        },
        EXTENDED_CLASS: {
            "selectors": [_cel(f"{gpu} && {ATTRIBUTE}.minor < {GENERAL}")],
            "extendedResourceName": EXTENDED_RESOURCE,
        },
        # Every whole GPU: the taint and sharing scenarios name theirs by minor.
        WHOLE_CLASS: {"selectors": [_cel(gpu)]},
    }
    with device_classes(kube, specs):
        yield


def _install(kube: Kube, kubeconfig: Path, node: Node, image: LocalImage, mode: str) -> str:
    """The chart in ``mode``, its plugin publishing; the release name."""
    here = LocalNode(node.name, node.registrar_dir, node.plugins_dir, node.cdi_dir)
    values = local_node_values(
        here,
        kubeconfig=kubeconfig,
        repository=image.repository,
        tag=image.tag,
        ports=free_ports(4),
    )
    values.update(driverName=DRIVER, simulatedProfile=PROFILE, logFormat="text", **MODES[mode])
    values["controller"] = {"enabled": False}
    values["deviceClasses"] = {"create": False}
    values["validatingAdmissionPolicy"] = {"enabled": False}
    # MPS on a GPU allocated whole (the opaque-config scenario); consumable modes have it.
    values["mps"] = {"enabled": mode == "exclusive"}
    release = f"ex{secrets.token_hex(2)}"
    with tempfile.TemporaryDirectory() as folder:
        values_file = Path(folder) / "values.yaml"
        values_file.write_text(yaml.safe_dump(values))
        common = ["--namespace=default", f"--timeout={TIMEOUT}s", "--wait"]
        _helm(kubeconfig, "install", release, str(CHART), "-f", str(values_file), *common)
    wait_for(
        lambda: len(_published(kube)) >= GPUS or NotYet(len(_published(kube))),
        timeout=TIMEOUT,
        what=f"the chart's plugin publishing {GPUS} GPUs",
    )
    return release


def _helm(kubeconfig: Path, *args: str) -> str:
    return helm(f"--kubeconfig={kubeconfig}", *args, timeout=TIMEOUT + 60).stdout


def _uninstall(kubeconfig: Path, node: Node, release: str) -> None:
    _helm(kubeconfig, "uninstall", release, "--namespace=default", "--wait")
    # The simulated GPUs' state (MIG mode, instances) is the driver's alone: the next
    # mode starts from GPUs as they come.
    shutil.rmtree(node.plugins_dir / DRIVER, ignore_errors=True)


def _published(kube: Kube) -> dict[str, dict[str, Any]]:
    """Whole GPUs the chart's plugin publishes: name -> attributes (plain values)."""
    slices = kube.resource(RESOURCE, "ResourceSlice").get(field_selector=f"spec.driver={DRIVER}")
    found = {}
    for item in slices.items:
        for device in item.to_dict()["spec"].get("devices") or []:
            attributes = {
                k: next(iter(v.values())) for k, v in (device.get("attributes") or {}).items()
            }
            if attributes.get("type") == "gpu":
                found[device["name"]] = attributes
    return found


def _cel(expression: str) -> dict[str, Any]:
    return {"cel": {"expression": expression}}


# -- scenario building blocks ---------------------------------------------------------


@dataclass
class Run:
    """One scenario started in its namespace."""

    kube: Kube
    node: str
    mode: str
    namespace: str
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    @property
    def shared(self) -> bool:
        """Whether whole GPUs are published for sharing (consumable, static MIG)."""
        return self.mode == "consumable"

    def create(self, obj: dict[str, Any]) -> None:
        self.kube.create(obj, self.namespace)

    def template(self, name: str, requests: list[dict[str, Any]], **devices: Any) -> None:
        spec = {"devices": {"requests": requests, **devices}}
        self.create(
            {
                "apiVersion": RESOURCE,
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": name},
                "spec": {"spec": spec},
            }
        )

    def claim(self, name: str, requests: list[dict[str, Any]], **devices: Any) -> None:
        spec = {"devices": {"requests": requests, **devices}}
        self.create(
            {
                "apiVersion": RESOURCE,
                "kind": "ResourceClaim",
                "metadata": {"name": name},
                "spec": spec,
            }
        )

    def pod(
        self,
        name: str,
        claims: dict[str, dict[str, str]],
        containers: dict[str, list[dict[str, str]]],
        *,
        init: dict[str, list[dict[str, str]]] | None = None,
        limits: dict[str, str] | None = None,
        command: str = COMMAND,
    ) -> None:
        """A Pod of the test image: ``claims`` by Pod claim name, ``containers`` (and
        ``init`` containers, which print and exit) by name with the claims they use."""

        def container(cname: str, uses: list[dict[str, str]], run: str) -> dict[str, Any]:
            resources: dict[str, Any] = {"claims": uses} if uses else {}
            if limits:
                resources["limits"] = limits
            return {
                "name": cname,
                "image": versions.TEST_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", run],
                "resources": resources,
            }

        spec: dict[str, Any] = {
            "nodeSelector": {"kubernetes.io/hostname": self.node},
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "automountServiceAccountToken": False,
            "containers": [container(n, u, command) for n, u in containers.items()],
        }
        if claims:
            spec["resourceClaims"] = [{"name": n, **source} for n, source in claims.items()]
        if init:
            spec["initContainers"] = [container(n, u, "env | sort") for n, u in init.items()]
        self.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec})

    def env(self, pod: str, container: str) -> dict[str, str]:
        """The env a container printed (its log), once it has."""
        return container_env(self.kube, self.namespace, pod, container=container, timeout=TIMEOUT)

    def uuids(self, pod: str, container: str) -> list[str]:
        return visible_uuids(self.env(pod, container))

    def results(self, pod: str, claim: str = "gpu") -> list[dict[str, Any]]:
        """The allocation results of the Pod's claim ``claim``."""
        obj = self.kube.get("v1", "Pod", pod, self.namespace)
        statuses = obj.get("status", {}).get("resourceClaimStatuses") or []
        names = [s["resourceClaimName"] for s in statuses if s.get("name") == claim]
        name = names[0] if names else claim  # a ResourceClaim named in the Pod
        found = self.kube.get(RESOURCE, "ResourceClaim", name, self.namespace)
        allocation = (found.get("status") or {}).get("allocation") or {}
        return list((allocation.get("devices") or {}).get("results") or [])


def _exactly(device_class: str = GPU_CLASS, *selectors: str, **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"deviceClassName": device_class, **extra}
    if selectors:
        spec["selectors"] = [_cel(s) for s in selectors]
    return spec


def _request(name: str, *selectors: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "exactly": _exactly(GPU_CLASS, *selectors, **extra)}


def _minor(minor: int) -> str:
    return f"{ATTRIBUTE}.minor == {minor}"


def _gpu_config(requests: list[str], strategy: str, interval: str | None = None) -> dict[str, Any]:
    sharing: dict[str, Any] = {"strategy": strategy}
    if interval is not None:
        sharing["timeSlicing"] = {"interval": interval}
    parameters = {
        "apiVersion": "resource.drasil.dev/v1beta1",
        "kind": "GpuConfig",
        "sharing": sharing,
    }
    return {"requests": requests, "opaque": {"driver": DRIVER, "parameters": parameters}}


TEMPLATE = {"resourceClaimTemplateName": "single-gpu"}
USE_GPU = [{"name": "gpu"}]


# -- the scenarios: start(run) makes the objects, check(run) asserts what they show ----


def basic_template_start(run: Run) -> None:
    run.template("single-gpu", [_request("gpu")])
    for name in ("pod0", "pod1"):
        run.pod(name, {"gpu": TEMPLATE}, {"ctr0": USE_GPU})


def basic_template_check(run: Run) -> None:
    """basic-resourceclaimtemplate: each Pod gets one GPU, a different one."""
    seen = [run.uuids(name, "ctr0") for name in ("pod0", "pod1")]
    assert all(len(u) == 1 for u in seen), seen
    assert seen[0] != seen[1], seen


def multiple_requests_start(run: Run) -> None:
    run.template("multiple-gpus", [_request("gpu-1"), _request("gpu-2")])
    run.pod(
        "pod0",
        {"gpus": {"resourceClaimTemplateName": "multiple-gpus"}},
        {"ctr0": [{"name": "gpus"}]},
    )


def multiple_requests_check(run: Run) -> None:
    """basic-multiple-requests: one container sees two distinct GPUs."""
    seen = run.uuids("pod0", "ctr0")
    assert len(seen) == 2, seen
    assert len(set(seen)) == 2, seen


def across_containers_start(run: Run) -> None:
    run.template("single-gpu", [_request("gpu")])
    run.pod(
        "pod0", {"shared-gpu": TEMPLATE}, {n: [{"name": "shared-gpu"}] for n in ("ctr0", "ctr1")}
    )


def across_containers_check(run: Run) -> None:
    """basic-shared-claim-across-containers: both containers show the same GPU."""
    a, b = run.uuids("pod0", "ctr0"), run.uuids("pod0", "ctr1")
    assert len(a) == 1, a
    assert a == b, (a, b)


def across_pods_start(run: Run) -> None:
    run.claim("single-gpu", [_request("gpu")])
    for name in ("pod0", "pod1"):
        run.pod(name, {"gpu": {"resourceClaimName": "single-gpu"}}, {"ctr0": USE_GPU})


def across_pods_check(run: Run) -> None:
    """basic-shared-claim-across-pods: both Pods show the same GPU."""
    a, b = run.uuids("pod0", "ctr0"), run.uuids("pod1", "ctr0")
    assert len(a) == 1, a
    assert a == b, (a, b)


def init_container_start(run: Run) -> None:
    run.template("single-gpu", [_request("gpu")])
    uses = [{"name": "shared-gpu"}]
    run.pod("pod0", {"shared-gpu": TEMPLATE}, {"ctr0": uses}, init={"init0": uses})


def init_container_check(run: Run) -> None:
    """initcontainer-shared-gpu: the init container and the container show one GPU."""
    main = run.uuids("pod0", "ctr0")
    assert len(main) == 1, main
    assert run.uuids("pod0", "init0") == main


def cel_selector_start(run: Run) -> None:
    memory = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("4Gi")) >= 0'
    run.template(
        "single-gpu-cel", [_request("gpu", f'{ATTRIBUTE}.productName == "{H100}"', memory)]
    )
    run.pod("pod0", {"gpu": {"resourceClaimTemplateName": "single-gpu-cel"}}, {"ctr0": USE_GPU})


def cel_selector_check(run: Run) -> None:
    """cel-selector: the GPU a CEL selector picked by product and memory."""
    seen = run.uuids("pod0", "ctr0")
    (result,) = run.results("pod0")
    attributes = _published(run.kube)[result["device"]]
    assert attributes["productName"] == H100
    assert seen == [attributes["uuid"]], seen


def opaque_config_start(run: Run) -> None:
    # The example's second strategy is its own SpacePartitioning; drasil's is MPS (one
    # daemon for the whole GPU's claim, or a share's where GPUs are consumable); the
    # dynamic MIG modes keep Exclusive, so that each strategy is seen.
    other = _other_strategy(run)
    configs = [_gpu_config(["ts-gpu"], "TimeSlicing", "Long"), _gpu_config(["other-gpu"], other)]
    run.template("multiple-gpus", [_request("ts-gpu"), _request("other-gpu")], config=configs)
    containers = {
        f"{kind}-ctr{i}": [{"name": "shared-gpus", "request": f"{kind}-gpu"}]
        for kind in ("ts", "other")
        for i in (0, 1)
    }
    run.pod("pod0", {"shared-gpus": {"resourceClaimTemplateName": "multiple-gpus"}}, containers)


def opaque_config_check(run: Run) -> None:
    """basic-resourceclaim-opaque-config: the two time-sliced containers share one GPU
    and see TimeSlicing with interval Long; the other two share the other GPU with the
    other strategy (MPS: both are given the daemon's pipe)."""
    other = _other_strategy(run)
    ts = [run.env("pod0", f"ts-ctr{i}") for i in (0, 1)]
    others = [run.env("pod0", f"other-ctr{i}") for i in (0, 1)]
    assert visible_uuids(ts[0]) == visible_uuids(ts[1])
    assert visible_uuids(others[0]) == visible_uuids(others[1])
    assert len(visible_uuids(ts[0])) == 1
    assert visible_uuids(ts[0]) != visible_uuids(others[0])
    assert _settings(ts[0]) == {"SHARING_STRATEGY": "TimeSlicing", "TIMESLICE_INTERVAL": "Long"}
    assert _settings(others[0]) == {"SHARING_STRATEGY": other}
    if other == "MPS":
        assert all("CUDA_MPS_PIPE_DIRECTORY" in env for env in others), others


def _other_strategy(run: Run) -> str:
    return "MPS" if run.mode in ("exclusive", "consumable") else "Exclusive"


def _settings(env: dict[str, str]) -> dict[str, str]:
    """A container's one device's ``DRASIL_DEVICE_<NAME>_<SETTING>`` variables."""
    (device,) = [n for n in env if n.startswith("DRASIL_DEVICE_") and env[n].startswith("GPU-")]
    return {n.removeprefix(f"{device}_"): v for n, v in env.items() if n.startswith(f"{device}_")}


METADATA = (
    "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpu/"
    f"{DRIVER}-metadata.json"
)


def device_metadata_start(run: Run) -> None:
    run.template("single-gpu", [_request("gpu")])
    command = f"cat {METADATA}; echo; {COMMAND}"
    run.pod("pod0", {"gpu": TEMPLATE}, {"ctr0": USE_GPU}, command=command)


def device_metadata_check(run: Run) -> None:
    """basic-rct-device-metadata: the device's metadata is mounted in the container."""
    seen = run.uuids("pod0", "ctr0")
    log = run.kube.core.read_namespaced_pod_log(
        "pod0", run.namespace, container="ctr0", _request_timeout=30
    )
    documents = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert documents, log
    text = json.dumps(documents)
    (result,) = run.results("pod0")
    assert result["device"] in text
    assert seen[0] in text


FREE = range(SHARE_MINOR + 1, GPUS)  # no scenario's claim takes these


def admin_access_start(run: Run) -> None:
    request = _request("admin-gpu", allocationMode="All", adminAccess=True)
    if run.mode != "exclusive":
        # kube-scheduler 1.37 counts an admin-access allocation against a device's
        # capacity (consumable GPUs) and its shared counters (dynamic MIG) like any
        # other: it is refused a GPU another claim holds, so it asks for free ones.
        first = FREE[0]
        request = {
            "name": "admin-gpu",
            "exactly": _exactly(
                WHOLE_CLASS, f"{ATTRIBUTE}.minor >= {first}", allocationMode="All", adminAccess=True
            ),
        }
    run.template("multiple-gpus-admin", [request])
    run.pod(
        "pod0",
        {"gpus": {"resourceClaimTemplateName": "multiple-gpus-admin"}},
        {"ctr0": [{"name": "gpus"}]},
    )


def admin_access_check(run: Run) -> None:
    """admin-access: a Pod of an admin namespace sees every GPU of the class, in use or
    not (in the other modes: every free one), and says it has admin access."""
    env = run.env("pod0", "ctr0")
    minors = range(GENERAL) if run.mode == "exclusive" else FREE
    published = _published(run.kube).values()
    wanted = sorted(a["uuid"] for a in published if int(a["minor"]) in minors)
    assert visible_uuids(env) == wanted
    assert any(n.endswith("_ADMIN_ACCESS") and v == "true" for n, v in env.items())


def _alternative(name: str, *selectors: str) -> dict[str, Any]:
    return {"name": name, "deviceClassName": GPU_CLASS, "selectors": [_cel(e) for e in selectors]}


BLEEDING_EDGE = _alternative("bleeding-edge-gpu", f'{ATTRIBUTE}.productName == "NVIDIA B200"')
HUGE = _alternative(
    "huge-gpu", f'device.capacity["{DRIVER}"].memory.compareTo(quantity("1Ti")) >= 0'
)
LATEST = _alternative("latest-gpu", f'{ATTRIBUTE}.productName == "{H100}"')
OLDER = _alternative("older-gpu")


def prioritized_start(run: Run) -> None:
    run.template(
        "prioritized-gpu", [{"name": "gpu", "firstAvailable": [BLEEDING_EDGE, HUGE, OLDER]}]
    )
    run.template("preferred-gpu", [{"name": "gpu", "firstAvailable": [LATEST, OLDER]}])
    run.pod("pod0", {"gpu": {"resourceClaimTemplateName": "prioritized-gpu"}}, {"ctr0": USE_GPU})
    run.pod("pod1", {"gpu": {"resourceClaimTemplateName": "preferred-gpu"}}, {"ctr0": USE_GPU})


def prioritized_check(run: Run) -> None:
    """prioritized-alternatives: the first alternative that can be satisfied is
    allocated: older-gpu for pod0 (no B200, no GPU of 1Ti), latest-gpu for pod1."""
    a, b = run.uuids("pod0", "ctr0"), run.uuids("pod1", "ctr0")
    assert len(a) == len(b) == 1
    assert a != b
    assert [r["request"] for r in run.results("pod0")] == ["gpu/older-gpu"]
    assert [r["request"] for r in run.results("pod1")] == ["gpu/latest-gpu"]


def subrequest_scoping_start(run: Run) -> None:
    extra = {"name": "extra", "exactly": _exactly()}
    templates = {
        "parent-scoped-gpu": ([HUGE, OLDER], [_gpu_config(["gpu"], "TimeSlicing", "Long")]),
        "subrequest-scoped-gpu": (
            [LATEST, OLDER],
            [
                _gpu_config(["gpu/latest-gpu"], "TimeSlicing", "Short"),
                _gpu_config(["gpu/older-gpu"], "TimeSlicing", "Medium"),
            ],
        ),
        "precedence-scoped-gpu": (
            [LATEST, OLDER],
            [
                _gpu_config(["gpu/latest-gpu"], "TimeSlicing", "Short"),
                _gpu_config(["gpu"], "TimeSlicing", "Long"),
            ],
        ),
    }
    for i, (name, (alternatives, configs)) in enumerate(templates.items()):
        run.template(name, [{"name": "gpu", "firstAvailable": alternatives}, extra], config=configs)
        uses = [{"name": "gpus"}]
        run.pod(f"pod{i}", {"gpus": {"resourceClaimTemplateName": name}}, {"ctr0": uses})


def subrequest_scoping_check(run: Run) -> None:
    """subrequest-config-scoping: a config scoped to the parent request applies to
    whichever alternative was taken, one scoped to an alternative only to it, and of
    two that apply the later wins; the extra request gets no config (drasil's
    default: Exclusive, or MPS for a share)."""
    default = "MPS" if run.shared else "Exclusive"
    expected = {
        "pod0": ("gpu/older-gpu", "Long"),
        "pod1": ("gpu/latest-gpu", "Short"),
        "pod2": ("gpu/latest-gpu", "Long"),
    }
    seen: list[str] = []
    for pod, (request, interval) in expected.items():
        env = run.env(pod, "ctr0")
        seen.extend(visible_uuids(env))
        by_request = {r["request"]: r["device"] for r in run.results(pod, "gpus")}
        assert set(by_request) == {request, "extra"}, by_request
        gpu, extra = (device_variable(by_request[k]) for k in (request, "extra"))
        assert env[f"{gpu}_SHARING_STRATEGY"] == "TimeSlicing"
        assert env[f"{gpu}_TIMESLICE_INTERVAL"] == interval
        assert env[f"{extra}_SHARING_STRATEGY"] == default
        assert f"{extra}_TIMESLICE_INTERVAL" not in env
    assert len(set(seen)) == 6, seen


def extended_resource_start(run: Run) -> None:
    run.pod(
        "pod0",
        {},
        {"ctr0": []},
        limits={f"deviceclass.resource.kubernetes.io/{EXTENDED_CLASS}": "1"},
    )
    run.pod("pod1", {}, {"ctr0": []}, limits={EXTENDED_RESOURCE: "1"})


def extended_resource_check(run: Run) -> None:
    """extended-resource-request: a Pod that asks in its limits, by the class's implicit
    name or by its extendedResourceName, gets one GPU, through a claim the scheduler
    made and recorded in the Pod's status."""
    a, b = run.uuids("pod0", "ctr0"), run.uuids("pod1", "ctr0")
    assert len(a) == len(b) == 1
    assert a != b
    for name in ("pod0", "pod1"):
        status = run.kube.get("v1", "Pod", name, run.namespace)["status"]
        assert status.get("extendedResourceClaimStatus", {}).get("resourceClaimName"), status


# Taints: each on GPUs of its own above GENERAL, by device name.
def _taint_rule(run: Run, devices: list[int], effect: str) -> None:
    name = f"ex-{secrets.token_hex(3)}"
    for minor in devices:
        rule = {
            "apiVersion": RESOURCE,
            "kind": "DeviceTaintRule",
            "metadata": {"name": f"{name}-{minor}"},
            "spec": {
                "deviceSelector": {"driver": DRIVER, "device": f"gpu-{minor}"},
                "taint": {"key": TAINT_KEY, "value": "true", "effect": effect},
            },
        }
        run.kube.create(rule)
        run.cleanup.append(
            functools.partial(run.kube.delete, RESOURCE, "DeviceTaintRule", f"{name}-{minor}")
        )
    for minor in devices:
        wait_for(
            functools.partial(_rule_seen, run.kube, f"{name}-{minor}"),
            timeout=TIMEOUT,
            what=f"DeviceTaintRule {name}-{minor} seen by the device taint controller",
        )


def _rule_seen(kube: Kube, name: str) -> bool | NotYet:
    """True once kube-controller-manager's device taint controller has written the
    rule's EvictionInProgress condition for its generation: the rule has reached a
    watcher that applies rules to slices the way kube-scheduler's does. Creating a Pod
    before that raced the scheduler's watch in CI (the Pod got the tainted device)."""
    rule = kube.get(RESOURCE, "DeviceTaintRule", name)
    generation = rule["metadata"].get("generation")
    for condition in (rule.get("status") or {}).get("conditions") or []:
        if (
            condition.get("type") == "EvictionInProgress"
            and condition.get("observedGeneration") == generation
        ):
            return True
    return NotYet(rule.get("status"))


def _on(minor: int, *tolerations: dict[str, Any]) -> list[dict[str, Any]]:
    extra = {"tolerations": list(tolerations)} if tolerations else {}
    return [{"name": "gpu", "exactly": _exactly(WHOLE_CLASS, _minor(minor), **extra)}]


TOLERATE = {"key": TAINT_KEY, "operator": "Equal", "value": "true", "effect": "NoExecute"}


def taint_noschedule_start(run: Run) -> None:
    run.template("keeps", _on(GENERAL))
    run.template("new", _on(GENERAL + 1))
    run.pod("pod-keeps-running", {"gpu": {"resourceClaimTemplateName": "keeps"}}, {"ctr0": USE_GPU})


def taint_noschedule_check(run: Run) -> None:
    """device-taint-pod-noschedule: a NoSchedule taint leaves the running Pod alone and
    keeps a new Pod from its device."""
    wait_running(run.kube, run.namespace, "pod-keeps-running")
    _taint_rule(run, [GENERAL, GENERAL + 1], "NoSchedule")
    # kube-scheduler applies a rule when its own watch delivers it, which can trail the
    # controller's that _taint_rule waits for: a Pod bound to the tainted device is that
    # lag, so it is deleted and a new one tried, three times at most.
    for _ in range(3):
        if _refused(run, "pod-no-schedule"):
            break
    else:
        raise AssertionError("three Pods in a row got the NoSchedule-tainted device")
    pod = run.kube.get("v1", "Pod", "pod-keeps-running", run.namespace)
    assert pod["status"]["phase"] == "Running"
    assert not run.kube.get("v1", "Pod", "pod-no-schedule", run.namespace)["spec"].get("nodeName")


def _refused(run: Run, name: str) -> bool:
    """Whether a new Pod for the tainted device is refused by the scheduler; one that is
    bound instead is deleted with its claim, for the next try."""
    run.pod(name, {"gpu": {"resourceClaimTemplateName": "new"}}, {"ctr0": USE_GPU})

    def outcome() -> str | NotYet:
        seen = events(run.kube, run.namespace, name)
        if any("FailedScheduling" in e for e in seen):
            return "refused"
        if run.kube.get("v1", "Pod", name, run.namespace)["spec"].get("nodeName"):
            return "bound"
        return NotYet(seen)

    seen = wait_for(outcome, timeout=TIMEOUT, what="the tainted device refused to the new Pod")
    if seen == "refused":
        return True
    run.kube.delete("v1", "Pod", name, run.namespace)
    claims = run.kube.resource(RESOURCE, "ResourceClaim")
    wait_for(
        lambda: (
            gone(run.kube, "v1", "Pod", name, run.namespace)
            and len(claims.get(namespace=run.namespace, _request_timeout=30).items) == 1
        ),
        timeout=TIMEOUT,
        what=f"{name} and its claim gone",
    )
    return False


def taint_noexecute_start(run: Run) -> None:
    run.template("evicted", _on(GENERAL + 2))
    run.template("tolerating", _on(GENERAL + 3, TOLERATE))
    run.pod(
        "pod-to-be-evicted", {"gpu": {"resourceClaimTemplateName": "evicted"}}, {"ctr0": USE_GPU}
    )
    run.pod(
        "pod-with-toleration",
        {"gpu": {"resourceClaimTemplateName": "tolerating"}},
        {"ctr0": USE_GPU},
    )


def taint_noexecute_check(run: Run) -> None:
    """device-taint-pod-noexecute and -toleration: a NoExecute taint evicts the Pod
    using the device, and spares the one whose claim tolerates it."""
    wait_running(run.kube, run.namespace, "pod-to-be-evicted")
    wait_running(run.kube, run.namespace, "pod-with-toleration")
    _taint_rule(run, [GENERAL + 2, GENERAL + 3], "NoExecute")
    wait_for(
        lambda: (
            gone(run.kube, "v1", "Pod", "pod-to-be-evicted", run.namespace)
            or _failed(run, "pod-to-be-evicted")
            or NotYet(events(run.kube, run.namespace, "pod-to-be-evicted"))
        ),
        timeout=TIMEOUT,
        what="the Pod on the NoExecute-tainted device evicted",
    )
    pod = run.kube.get("v1", "Pod", "pod-with-toleration", run.namespace)
    assert pod["status"]["phase"] == "Running"
    assert not pod["metadata"].get("deletionTimestamp")


def _failed(run: Run, name: str) -> bool:
    pod = run.kube.get("v1", "Pod", name, run.namespace)
    return bool(pod["metadata"].get("deletionTimestamp")) or pod["status"].get("phase") == "Failed"


def multiple_allocations_start(run: Run) -> None:
    for name in ("pod0", "pod1"):
        capacity = {"requests": {"memory": "16Gi", "computePercent": "20"}}
        run.claim(
            f"shared-gpu-{name}",
            [
                {
                    "name": "gpu",
                    "exactly": _exactly(WHOLE_CLASS, _minor(SHARE_MINOR), capacity=capacity),
                }
            ],
        )
        run.pod(name, {"gpu": {"resourceClaimName": f"shared-gpu-{name}"}}, {"ctr0": USE_GPU})


def multiple_allocations_check(run: Run) -> None:
    """gpu-allow-multiple-allocations: two Pods' claims of 16Gi and 20 % each share one
    GPU, each kept to its share by MPS."""
    a, b = run.env("pod0", "ctr0"), run.env("pod1", "ctr0")
    assert visible_uuids(a) == visible_uuids(b)
    assert len(visible_uuids(a)) == 1
    for env in (a, b):
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=16384M"
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"


def partitionable_start(run: Run) -> None:
    request = {
        "name": "gpu-partition",
        "exactly": _exactly(MIG_CLASS, f"{ATTRIBUTE}.minor == {SHARE_MINOR}", count=2),
    }
    run.template("gpu-partitions", [request])
    run.pod("pod0", {"gpu": {"resourceClaimTemplateName": "gpu-partitions"}}, {"ctr0": USE_GPU})


def partitionable_check(run: Run) -> None:
    """partitionable-devices: two partitions (MIG devices) of one GPU, cut for the
    claim, each with its own UUID."""
    seen = run.uuids("pod0", "ctr0")
    assert len(seen) == 2, seen
    assert all(u.startswith("MIG-") for u in seen)
    assert len(set(seen)) == 2
    devices = [r["device"] for r in run.results("pod0")]
    assert all(d.startswith(f"gpu-{SHARE_MINOR}-mig-") for d in devices), devices


def partition_shares_start(run: Run) -> None:
    selector = (
        f'{ATTRIBUTE}.minor == {SHARE_MINOR} && {ATTRIBUTE}.profile == "1g.10gb" && '
        f"{ATTRIBUTE}.placementStart == 0"
    )
    for name in ("pod0", "pod1"):
        capacity = {"requests": {"memory": "4Gi", "computePercent": "10"}}
        run.claim(
            f"shared-partition-{name}",
            [{"name": "gpu", "exactly": _exactly(MIG_CLASS, selector, capacity=capacity)}],
        )
        run.pod(name, {"gpu": {"resourceClaimName": f"shared-partition-{name}"}}, {"ctr0": USE_GPU})


def partition_shares_check(run: Run) -> None:
    """gpu-allow-multiple-allocations-partitionable: two Pods share one MIG device by
    memory and compute."""
    a, b = run.env("pod0", "ctr0"), run.env("pod1", "ctr0")
    seen = visible_uuids(a)
    assert seen == visible_uuids(b)
    assert len(seen) == 1
    assert seen[0].startswith("MIG-")
    for env in (a, b):
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"


@dataclass(frozen=True)
class Scenario:
    name: str  # the example driver's folder under demo/examples
    start: Callable[[Run], None]
    check: Callable[[Run], None]
    modes: tuple[str, ...] = tuple(MODES)
    admin: bool = False


SCENARIOS = (
    Scenario("basic-resourceclaimtemplate", basic_template_start, basic_template_check),
    Scenario("basic-multiple-requests", multiple_requests_start, multiple_requests_check),
    Scenario(
        "basic-shared-claim-across-containers", across_containers_start, across_containers_check
    ),
    Scenario("basic-shared-claim-across-pods", across_pods_start, across_pods_check),
    Scenario("initcontainer-shared-gpu", init_container_start, init_container_check),
    Scenario("cel-selector", cel_selector_start, cel_selector_check),
    Scenario("basic-resourceclaim-opaque-config", opaque_config_start, opaque_config_check),
    Scenario("basic-rct-device-metadata", device_metadata_start, device_metadata_check),
    Scenario("admin-access", admin_access_start, admin_access_check, admin=True),
    Scenario("prioritized-alternatives", prioritized_start, prioritized_check),
    Scenario("subrequest-config-scoping", subrequest_scoping_start, subrequest_scoping_check),
    Scenario("extended-resource-request", extended_resource_start, extended_resource_check),
    Scenario("device-taint-pod-noschedule", taint_noschedule_start, taint_noschedule_check),
    Scenario("device-taint-pod-noexecute", taint_noexecute_start, taint_noexecute_check),
    Scenario(
        "gpu-allow-multiple-allocations",
        multiple_allocations_start,
        multiple_allocations_check,
        modes=("consumable",),
    ),
    Scenario(
        "partitionable-devices", partitionable_start, partitionable_check, modes=("dynamic-mig",)
    ),
    Scenario(
        "gpu-allow-multiple-allocations-partitionable",
        partition_shares_start,
        partition_shares_check,
        modes=("dynamic-mig-consumable",),
    ),
)


# -- the test -------------------------------------------------------------------------


def _namespace(kube: Kube, scenario: Scenario) -> str:
    name = f"ex-{scenario.name[:40].rstrip('-')}-{secrets.token_hex(2)}"
    labels = {"resource.kubernetes.io/admin-access": "true"} if scenario.admin else None
    kube.core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels=labels)),
        _request_timeout=30,
    )
    wait_for(
        lambda: kube.core.read_namespaced_service_account("default", name, _request_timeout=30),
        timeout=30,
        what=f"ServiceAccount default in {name}",
    )
    return name


def _no_pods(kube: Kube, namespace: str) -> bool | NotYet:
    left = [
        p.metadata.name
        for p in kube.core.list_namespaced_pod(namespace, _request_timeout=30).items
        if p.metadata
    ]
    return not left or NotYet(left)


def _clean(kube: Kube, runs: list[Run]) -> None:
    for run in runs:
        for undo in run.cleanup:
            undo()
        kube.core.delete_collection_namespaced_pod(run.namespace, _request_timeout=30)
    for run in runs:
        wait_for(
            functools.partial(_no_pods, kube, run.namespace),
            timeout=TIMEOUT,
            what=f"the Pods of {run.namespace} gone (their claims unprepared)",
        )
        kube.delete("v1", "Namespace", run.namespace)


@pytest.mark.parametrize("mode", list(MODES))
def test_the_example_drivers_scenarios(
    kube: Kube,
    kubeconfig: Path,
    node: Node,
    image: LocalImage,
    classes: None,
    mode: str,
) -> None:
    """Every scenario of ``mode`` started at once, each checked; the failures named."""
    release = _install(kube, kubeconfig, node, image, mode)
    runs: list[tuple[Scenario, Run]] = []
    try:
        for scenario in SCENARIOS:
            if mode in scenario.modes:
                run = Run(kube, node.name, mode, _namespace(kube, scenario))
                runs.append((scenario, run))
                scenario.start(run)
        failed = []
        for scenario, run in runs:
            try:
                scenario.check(run)
            except Exception as err:  # every scenario is checked; all failures are named
                failed.append(f"{scenario.name} ({run.namespace}): {type(err).__name__}: {err}")
        assert not failed, (
            f"{len(failed)} of {len(runs)} scenarios failed in mode {mode}:\n" + "\n".join(failed)
        )
    finally:
        _clean(kube, [run for _, run in runs])
        _uninstall(kubeconfig, node, release)

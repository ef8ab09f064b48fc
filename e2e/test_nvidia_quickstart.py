"""NVIDIA's DRA driver quickstart, as its users write it, on drasil's chart with the preset.

kubernetes-sigs/dra-driver-nvidia-gpu's `demo/specs/quickstart/v1/` is how its users
write claims: the DeviceClasses `gpu.nvidia.com` and `mig.nvidia.com`, CEL on
`device.attributes['gpu.nvidia.com']`, opaque configs of `resource.nvidia.com/v1beta1`.
Here each scenario is written again in the same shape (the same class names, selectors,
config kinds and fields; only the image and the command differ: the containers print
what they were given, and the MPS ones hold an MPS client) and run on the chart
installed with `compatibility: nvidia-dra` on the real node (simulated A100s, two of
them in MIG mode with the quickstart's layout, the chart's RBAC, MPS daemons in Pods of
their own). One test starts every scenario, each in a namespace of its own, and fails
naming every scenario that did not show what NVIDIA's README says it shows.

The containers read their devices from `DRASIL_DEVICE_<NAME>`: a simulated GPU has no
driver files, so no `nvidia-smi` (that `nvidia-smi -L` lists exactly the claim's
devices is shown on the node's plugin with the mock NVML, e2e/test_container_smi.py).
"""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from e2e.harness import versions
from e2e.harness.chart import CHART, LocalNode, helm, local_node_values
from e2e.harness.cluster.host import free_ports
from e2e.harness.cluster.node import Node
from e2e.harness.kube import RESOURCE, Kube, NotYet, WaitTimeout, gone, wait_for
from e2e.harness.pods import visible_uuids
from tools.image import LocalImage, build_image, import_image

DRIVER = "gpu.nvidia.com"
CONFIG_API = "resource.nvidia.com/v1beta1"
# Twelve whole A100s (indices 0-11) and two in MIG mode with the quickstart's
# mig-parted layout (3g.20gb, 2g.10gb, 2 x 1g.5gb each).
PROFILE = "a100-40gb:12,a100-40gb-mig:2"
WHOLE = 12
TIMEOUT = 180
PRINT = "env | sort; trap 'exit 0' TERM; sleep 3600 & wait"
HOLD = "env | sort; mps-client --hold"
ATTRS = f"device.attributes['{DRIVER}']"


# -- the chart ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def image(node: Node) -> LocalImage:
    built = build_image()
    import_image(built, ctr=node.bin("ctr"), address=node.containerd_socket)
    return built


@pytest.fixture(scope="module")
def preset(kube: Kube, kubeconfig: Path, node: Node, image: LocalImage) -> Iterator[str]:
    """The chart with `compatibility: nvidia-dra`, its classes and plugin; the release."""
    here = LocalNode(node.name, node.registrar_dir, node.plugins_dir, node.cdi_dir)
    values = local_node_values(
        here, kubeconfig=kubeconfig, repository=image.repository, tag=image.tag, ports=free_ports(4)
    )
    values.update(compatibility="nvidia-dra", simulatedProfile=PROFILE, logFormat="text")
    values["controller"] = {"enabled": False}
    values["validatingAdmissionPolicy"] = {"enabled": False}
    release = f"nv{secrets.token_hex(2)}"
    with tempfile.TemporaryDirectory() as folder:
        values_file = Path(folder) / "values.yaml"
        values_file.write_text(yaml.safe_dump(values))
        _helm(kubeconfig, "install", release, str(CHART), "-f", str(values_file), "--wait")
    try:
        wait_for(
            lambda: _published(kube) >= WHOLE or NotYet(_published(kube)),
            timeout=TIMEOUT,
            what=f"the preset's plugin publishing {WHOLE} GPUs as {DRIVER}",
        )
        yield release
    finally:
        _helm(kubeconfig, "uninstall", release, "--wait")


def _helm(kubeconfig: Path, *args: str) -> str:
    common = [f"--kubeconfig={kubeconfig}", "--namespace=default", f"--timeout={TIMEOUT}s"]
    return helm(*common, *args, timeout=TIMEOUT + 60).stdout


def _published(kube: Kube) -> int:
    slices = kube.resource(RESOURCE, "ResourceSlice").get(field_selector=f"spec.driver={DRIVER}")
    return sum(
        1
        for item in slices.items
        for device in item.to_dict()["spec"].get("devices") or []
        if (device.get("attributes") or {}).get("type", {}).get("string") == "gpu"
    )


# -- scenarios as NVIDIA writes them ----------------------------------------------------


def gpu_config(sharing: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": CONFIG_API, "kind": "GpuConfig", "sharing": sharing}


def config(requests: list[str], parameters: dict[str, Any]) -> dict[str, Any]:
    return {"requests": requests, "opaque": {"driver": DRIVER, "parameters": parameters}}


TIME_SLICING_LONG = gpu_config(
    {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
)
MPS_50_10GI = gpu_config(
    {
        "strategy": "MPS",
        "mpsConfig": {
            "defaultActiveThreadPercentage": 50,
            "defaultPinnedDeviceMemoryLimit": "10Gi",
        },
    }
)


def exactly(device_class: str, *cel: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"deviceClassName": device_class}
    if cel:
        spec["selectors"] = [{"cel": {"expression": e}} for e in cel]
    return spec


@dataclass
class Scenario:
    """One quickstart spec started in its own namespace, and how to check it."""

    kube: Kube
    node: str
    namespace: str

    def create(self, obj: dict[str, Any]) -> None:
        self.kube.create(obj, self.namespace)

    def template(self, name: str, requests: list[dict[str, Any]], **devices: Any) -> None:
        spec = {"spec": {"devices": {"requests": requests, **devices}}}
        meta = {"apiVersion": RESOURCE, "kind": "ResourceClaimTemplate", "metadata": {"name": name}}
        self.create({**meta, "spec": spec})

    def claim(self, name: str, requests: list[dict[str, Any]], **devices: Any) -> None:
        meta = {"apiVersion": RESOURCE, "kind": "ResourceClaim", "metadata": {"name": name}}
        self.create({**meta, "spec": {"devices": {"requests": requests, **devices}}})

    def pod(
        self,
        name: str,
        claim: dict[str, str],
        containers: dict[str, str | None],
        *,
        mps: tuple[str, ...] = (),
    ) -> None:
        """A Pod with one Pod claim ``gpu`` from ``claim`` (resourceClaimName or
        resourceClaimTemplateName); ``containers`` by name with the request each names
        (None: the whole claim). Those in ``mps`` hold an MPS client (the probe image)."""

        def container(cname: str, request: str | None) -> dict[str, Any]:
            use = {"name": "gpu", **({"request": request} if request else {})}
            held = cname in mps
            return {
                "name": cname,
                "image": versions.PROBE_IMAGE if held else versions.TEST_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", HOLD if held else PRINT],
                "resources": {"claims": [use]},
            }

        spec = {
            "nodeSelector": {"kubernetes.io/hostname": self.node},
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "containers": [container(n, r) for n, r in containers.items()],
            "resourceClaims": [{"name": "gpu", **claim}],
        }
        self.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec})

    def log(self, pod: str, container: str, *, until: str = "PATH=") -> str:
        def printed() -> Any:
            try:
                text = self.kube.core.read_namespaced_pod_log(
                    pod, self.namespace, container=container, _request_timeout=30
                )
            except ApiException as err:  # not started yet
                return NotYet(err.reason)
            text = text or ""  # an empty log comes back as None
            return text if until in text else NotYet(text[-300:])

        found: str = wait_for(
            printed, timeout=TIMEOUT, what=f"{until!r} from {self.namespace}/{pod}/{container}"
        )
        return found

    def env(self, pod: str, container: str) -> dict[str, str]:
        return dict(
            line.split("=", 1) for line in self.log(pod, container).splitlines() if "=" in line
        )

    def uuids(self, pod: str, container: str) -> list[str]:
        return visible_uuids(self.env(pod, container))

    def results(self, pod: str) -> list[dict[str, Any]]:
        obj = self.kube.get("v1", "Pod", pod, self.namespace)
        statuses = (obj.get("status") or {}).get("resourceClaimStatuses") or []
        names = [s["resourceClaimName"] for s in statuses if s.get("name") == "gpu"]
        claim = names[0] if names else obj["spec"]["resourceClaims"][0]["resourceClaimName"]
        found = self.kube.get(RESOURCE, "ResourceClaim", claim, self.namespace)
        allocation = (found.get("status") or {}).get("allocation") or {}
        results: list[dict[str, Any]] = (allocation.get("devices") or {}).get("results") or []
        return results


def _start_test1(s: Scenario) -> None:
    s.template("single-gpu", [{"name": "gpu", "exactly": exactly("gpu.nvidia.com")}])
    for name in ("pod1", "pod2"):
        s.pod(name, {"resourceClaimTemplateName": "single-gpu"}, {"ctr": None})


def _check_test1(s: Scenario) -> None:
    seen = [s.uuids(name, "ctr") for name in ("pod1", "pod2")]
    assert all(len(u) == 1 for u in seen), seen
    assert seen[0] != seen[1], f"both Pods got {seen[0]}"


def _start_test2(s: Scenario) -> None:
    s.template("single-gpu", [{"name": "gpu", "exactly": exactly("gpu.nvidia.com")}])
    s.pod("pod", {"resourceClaimTemplateName": "single-gpu"}, {"ctr0": None, "ctr1": None})


def _check_test2(s: Scenario) -> None:
    first, second = s.uuids("pod", "ctr0"), s.uuids("pod", "ctr1")
    assert len(first) == 1, first
    assert first == second, (first, second)


def _start_test3(s: Scenario) -> None:
    s.claim("single-gpu", [{"name": "gpu", "exactly": exactly("gpu.nvidia.com")}])
    for name in ("pod1", "pod2"):
        s.pod(name, {"resourceClaimName": "single-gpu"}, {"ctr": None})


def _check_test3(s: Scenario) -> None:
    first, second = s.uuids("pod1", "ctr"), s.uuids("pod2", "ctr")
    assert len(first) == 1, first
    assert first == second, (first, second)


PROFILES = {"mig-1g-5gb-0": "1g.5gb", "mig-1g-5gb-1": "1g.5gb", "mig-2g-10gb": "2g.10gb"}
PROFILES["mig-3g-20gb"] = "3g.20gb"


def _start_test4(s: Scenario) -> None:
    requests = [
        {"name": r, "exactly": exactly("mig.nvidia.com", f"{ATTRS}.profile == '{p}'")}
        for r, p in PROFILES.items()
    ]
    constraints = [{"requests": [], "matchAttribute": f"{DRIVER}/parentUUID"}]
    s.template("mig-devices", requests, constraints=constraints)
    containers: dict[str, str | None] = {f"ctr{i}": r for i, r in enumerate(PROFILES)}
    s.pod("pod", {"resourceClaimTemplateName": "mig-devices"}, containers)


def _check_test4(s: Scenario) -> None:
    results = {r["request"]: r["device"] for r in s.results("pod")}
    assert set(results) == set(PROFILES), results
    for request, profile in PROFILES.items():
        assert profile.replace(".", "") in results[request], (request, results[request])
    assert len({device.split("-mig-")[0] for device in results.values()}) == 1, results
    seen = [s.uuids("pod", f"ctr{i}") for i in range(len(PROFILES))]
    assert all(len(u) == 1 and u[0].startswith("MIG-") for u in seen), seen
    assert len({u[0] for u in seen}) == len(PROFILES), seen


def _start_test5(s: Scenario) -> None:
    requests = [
        {"name": "ts-gpu", "exactly": exactly("gpu.nvidia.com")},
        {"name": "mps-gpu", "exactly": exactly("gpu.nvidia.com")},
    ]
    configs = [config(["ts-gpu"], TIME_SLICING_LONG), config(["mps-gpu"], MPS_50_10GI)]
    s.template("multiple-gpus", requests, config=configs)
    containers: dict[str, str | None] = {
        "ts-ctr0": "ts-gpu",
        "ts-ctr1": "ts-gpu",
        "mps-ctr0": "mps-gpu",
        "mps-ctr1": "mps-gpu",
    }
    mps = ("mps-ctr0", "mps-ctr1")
    s.pod("pod0", {"resourceClaimTemplateName": "multiple-gpus"}, containers, mps=mps)


def _sharing(env: dict[str, str]) -> list[tuple[str, str | None]]:
    """(strategy, interval) of each device the container was given."""
    names = [n for n in env if n.endswith("_SHARING_STRATEGY")]
    return sorted(
        (env[n], env.get(n.replace("_SHARING_STRATEGY", "_TIMESLICE_INTERVAL"))) for n in names
    )


def _connected(s: Scenario, pod: str, container: str, expected: str) -> None:
    said = s.log(pod, container, until="MPS:")
    assert f"MPS: connected {expected}" in said, said[-500:]


def _check_test5(s: Scenario) -> None:
    ts = [s.env("pod0", c) for c in ("ts-ctr0", "ts-ctr1")]
    assert len(visible_uuids(ts[0])) == 1, ts
    assert visible_uuids(ts[0]) == visible_uuids(ts[1]), ts
    assert _sharing(ts[0]) == [("TimeSlicing", "Long")], _sharing(ts[0])
    mps = [s.env("pod0", c) for c in ("mps-ctr0", "mps-ctr1")]
    assert len(visible_uuids(mps[0])) == 1, mps
    assert visible_uuids(mps[0]) == visible_uuids(mps[1]), mps
    assert visible_uuids(mps[0]) != visible_uuids(ts[0])
    assert _sharing(mps[0]) == [("MPS", None)], _sharing(mps[0])
    for container in ("mps-ctr0", "mps-ctr1"):
        _connected(s, "pod0", container, "memory=10240M threads=50.0")


EVEN = "(" + " || ".join(f"{ATTRS}.index == {i}" for i in (0, 2, 4, 6)) + ")"


def _start_test6(s: Scenario) -> None:
    selector = f"{ATTRS}.productName.lowerAscii().matches('^.*a100.*$') && {EVEN}"
    request = {"name": "gpu", "exactly": exactly("gpu.nvidia.com", selector)}
    s.template("a100", [request], config=[config(["gpu"], TIME_SLICING_LONG)])
    for i in range(4):
        s.pod(f"pod-{i}", {"resourceClaimTemplateName": "a100"}, {"ctr": None})


def _check_test6(s: Scenario) -> None:
    devices = sorted(s.results(f"pod-{i}")[0]["device"] for i in range(4))
    assert devices == ["gpu-0", "gpu-2", "gpu-4", "gpu-6"], devices
    for i in range(4):
        assert _sharing(s.env(f"pod-{i}", "ctr")) == [("TimeSlicing", "Long")]


def _start_mps(s: Scenario) -> None:
    s.template(
        "shared-gpu",
        [{"name": "mps-gpu", "exactly": exactly("gpu.nvidia.com")}],
        config=[config(["mps-gpu"], MPS_50_10GI)],
    )
    containers: dict[str, str | None] = {"mps-ctr0": "mps-gpu", "mps-ctr1": "mps-gpu"}
    s.pod(
        "test-pod", {"resourceClaimTemplateName": "shared-gpu"}, containers, mps=tuple(containers)
    )


def _check_mps(s: Scenario) -> None:
    for container in ("mps-ctr0", "mps-ctr1"):
        _connected(s, "test-pod", container, "memory=10240M threads=50.0")
    first, second = s.uuids("test-pod", "mps-ctr0"), s.uuids("test-pod", "mps-ctr1")
    assert len(first) == 1, first
    assert first == second, (first, second)


def _start_mig_mps(s: Scenario) -> None:
    """NVIDIA's mig+mps demo: a MIG device shared by two containers with MPS."""
    parameters = {
        "apiVersion": CONFIG_API,
        "kind": "MigDeviceConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}},
    }
    request = exactly("mig.nvidia.com", f"{ATTRS}.profile == '1g.5gb'")
    s.template(
        "mig-mps", [{"name": "mig", "exactly": request}], config=[config(["mig"], parameters)]
    )
    containers: dict[str, str | None] = {"mps-ctr0": "mig", "mps-ctr1": "mig"}
    s.pod("pod", {"resourceClaimTemplateName": "mig-mps"}, containers, mps=tuple(containers))


def _check_mig_mps(s: Scenario) -> None:
    for container in ("mps-ctr0", "mps-ctr1"):
        _connected(s, "pod", container, "memory=")
        said = s.log("pod", container, until="MPS:")
        assert "threads=50.0" in said, said[-300:]
    first = s.uuids("pod", "mps-ctr0")
    assert len(first) == 1, first
    assert first[0].startswith("MIG-"), first


SCENARIOS: dict[str, tuple[Callable[[Scenario], None], Callable[[Scenario], None]]] = {
    # gpu-test6 first: it names GPUs by index, which the others would take otherwise.
    "gpu-test6": (_start_test6, _check_test6),
    "gpu-test1": (_start_test1, _check_test1),
    "gpu-test2": (_start_test2, _check_test2),
    "gpu-test3": (_start_test3, _check_test3),
    "gpu-test4": (_start_test4, _check_test4),
    "gpu-test5": (_start_test5, _check_test5),
    "gpu-test-mps": (_start_mps, _check_mps),
    "mig-mps": (_start_mig_mps, _check_mig_mps),
}


def _namespace(kube: Kube, name: str) -> str:
    namespace = f"{name}-{secrets.token_hex(2)}"
    # MPS daemon Pods and their clients: the release namespace (default) is privileged.
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    return namespace


def test_nvidias_quickstart_runs_on_the_preset_as_its_readme_says(
    kube: Kube, node: Node, preset: str
) -> None:
    started: dict[str, Scenario] = {}
    for name, (start, _) in SCENARIOS.items():
        scenario = Scenario(kube, node.name, _namespace(kube, name))
        start(scenario)
        started[name] = scenario
        if name == "gpu-test6":  # its GPUs are taken before anyone else's
            for i in range(4):
                scenario.log(f"pod-{i}", "ctr")
    failed: dict[str, str] = {}
    try:
        for name, (_, check) in SCENARIOS.items():
            try:
                check(started[name])
            except (AssertionError, WaitTimeout) as err:
                failed[name] = str(err)[:600]
    finally:
        for scenario in started.values():
            kube.core.delete_namespace(scenario.namespace, _request_timeout=30)
        # Their claims unprepared (the MPS daemons stopped) before the plugin goes.
        for scenario in started.values():
            namespace = scenario.namespace
            wait_for(
                lambda n=namespace: gone(kube, "v1", "Namespace", n),  # type: ignore[misc]
                timeout=TIMEOUT,
                what=f"namespace {namespace} deleted",
            )
    assert not failed, "\n".join(f"{name}: {why}" for name, why in failed.items())
    assert preset

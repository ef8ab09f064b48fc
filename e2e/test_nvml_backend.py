"""The plugin with ``--backend nvml`` (users' default) against our C mock NVML.

`PluginProcess(backend="nvml")` runs the plugin on a fake driver root whose
``libnvidia-ml.so`` is the mock (e2e.harness.mocknvml), serving the very GPUs of the simulated
backend's profile. What it publishes must equal what the simulated backend publishes;
a whole GPU, a static MIG device and a dynamic MIG placement are prepared and
unprepared through the plugin's socket as kubelet calls it; an XID that NVML's events
deliver taints the device. The crash-at-every-step tests of dynamic MIG run on this
backend too (e2e/test_dynamic_mig.py).
"""

from __future__ import annotations

import json
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from drasil.driver.simulated.gpus import simulated_gpus
from e2e.harness.kube import RESOURCE, Kube, NotYet, wait_for
from e2e.harness.mocknvml import CAPS_MAJOR, mig_cap_minor
from e2e.harness.pluginproc import DRIVER, ClaimId, KubeletClient, PluginProcess
from e2e.test_dynamic_mig import (
    MIG_CLASS,
    PROFILE_3G,
    claim_pod,
    classes,  # noqa: F401 (a fixture)
    wait_allocated,
)
from e2e.test_kubeletplugin import cdi_file, checkpoint_claims, node_slices

MIXED = "h100-80gb:2,a100-40gb-mig:1,l4:1"
# From sysfs, not NVML (nvml.sysfs_pcie_root): the mock's bus ids are not on this
# machine's PCI bus, so the nvml backend publishes no PCIe root; the only difference.
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
XID_DBE = 48  # double-bit ECC error: critical (not in BENIGN_XIDS)


@pytest.fixture
def node(make_node: Callable[..., dict[str, Any]]) -> str:
    name = f"e2e-nvml-{secrets.token_hex(3)}"
    make_node(name)
    return name


@pytest.fixture
def roots() -> Iterator[Callable[[], Path]]:
    """Short temp roots (unix socket paths stay under ~105 bytes), removed afterwards."""
    made: list[Path] = []

    def make() -> Path:
        made.append(Path(tempfile.mkdtemp(prefix="drasil-nv-")))
        return made[-1]

    yield make
    for root in made:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def plugins() -> Iterator[list[PluginProcess]]:
    """Plugins a test starts; stopped afterwards, whatever happened."""
    started: list[PluginProcess] = []
    yield started
    for plugin in started:
        plugin.stop()


def start(
    plugins: list[PluginProcess],
    root: Path,
    kubeconfig: Path,
    node: str,
    *,
    backend: str,
    profile: str,
    mig_mode: str = "static",
) -> PluginProcess:
    plugin = PluginProcess(
        root=root,
        kubeconfig=kubeconfig,
        node_name=node,
        profile=profile,
        backend=backend,
        env={"MIG_MODE": mig_mode},
    )
    plugins.append(plugin)
    plugin.start()
    return plugin


def pool_slices(kube: Kube, node: str) -> list[dict[str, Any]]:
    """The node's slices once its pool is complete: every slice of the newest
    generation there (``resourceSliceCount`` of them)."""

    def complete() -> Any:
        slices = node_slices(kube, node)
        if not slices:
            return NotYet("no slice")
        newest = max(s["spec"]["pool"]["generation"] for s in slices)
        current = [s for s in slices if s["spec"]["pool"]["generation"] == newest]
        if len(current) != current[0]["spec"]["pool"]["resourceSliceCount"]:
            return NotYet(len(current))
        return current

    result: list[dict[str, Any]] = wait_for(complete, timeout=60, what=f"the pool of {node}")
    return result


def published(kube: Kube, node: str) -> dict[str, Any]:
    """What the scheduler reads of the node's pool, minus the generation: devices by
    name, counter sets by name, and every other spec field of the slices."""
    slices = pool_slices(kube, node)
    devices = {d["name"]: d for s in slices for d in s["spec"].get("devices") or []}
    counters = {c["name"]: c for s in slices for c in s["spec"].get("sharedCounters") or []}
    rest = []
    for s in slices:
        spec = {k: v for k, v in s["spec"].items() if k not in ("devices", "sharedCounters")}
        spec["pool"] = {k: v for k, v in spec["pool"].items() if k != "generation"}
        rest.append(json.dumps(spec, sort_keys=True))
    return {"devices": devices, "counters": counters, "slices": sorted(rest)}


def diff(got: Any, want: Any, path: str = "") -> dict[str, Any]:
    """The leaves where ``got`` differs from ``want``, by path: (got, want)."""
    if isinstance(got, dict) and isinstance(want, dict):
        out: dict[str, Any] = {}
        for key in sorted(set(got) | set(want), key=str):
            out.update(diff(got.get(key), want.get(key), f"{path}.{key}"))
        return out
    return {} if got == want else {path: (got, want)}


def delete_slices(kube: Kube, node: str) -> None:
    for s in node_slices(kube, node):
        kube.delete(RESOURCE, "ResourceSlice", s["metadata"]["name"])
    wait_for(
        lambda: NotYet("slices left") if node_slices(kube, node) else True,
        timeout=30,
        what=f"the slices of {node} deleted",
    )


@pytest.mark.parametrize("mig_mode", ["static", "dynamic"])
def test_slices_equal_the_simulated_backends(
    kube: Kube,
    node: str,
    roots: Callable[[], Path],
    plugins: list[PluginProcess],
    plugin_kubeconfig: Path,
    mig_mode: str,
) -> None:
    simulated = start(
        plugins, roots(), plugin_kubeconfig, node,
        backend="simulated", profile=MIXED, mig_mode=mig_mode,
    )  # fmt: skip
    want = published(kube, node)
    simulated.stop()
    delete_slices(kube, node)
    start(
        plugins, roots(), plugin_kubeconfig, node,
        backend="nvml", profile=MIXED, mig_mode=mig_mode,
    )  # fmt: skip
    got = published(kube, node)

    assert sorted(got["devices"]) == sorted(want["devices"])
    for name, device in want["devices"].items():
        assert PCIE_ROOT not in got["devices"][name]["attributes"], name
        assert PCIE_ROOT in device["attributes"], name
        attributes = {k: v for k, v in device["attributes"].items() if k != PCIE_ROOT}
        assert diff(got["devices"][name], {**device, "attributes": attributes}) == {}, name
    assert got["counters"] == want["counters"]
    assert got["slices"] == want["slices"]
    if mig_mode == "static":  # the A100's MIG devices, the others whole
        assert {"gpu-0", "gpu-1", "gpu-3"} <= set(got["devices"])
        assert sum("mig" in name for name in got["devices"]) == 4, sorted(got["devices"])


def claim_device(
    kube: Kube, namespace: str, node: str, *, device_class: str, cel: str
) -> tuple[ClaimId, str]:
    return wait_allocated(
        kube, namespace, claim_pod(kube, namespace, node, device_class=device_class, cel=cel)
    )


def cdi_nodes(plugin: PluginProcess, uid: str) -> list[dict[str, Any]]:
    spec = json.loads(cdi_file(plugin, uid).read_text())
    return [n for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes") or []]


def assert_char_node(node: dict[str, Any], path: str, major: int, minor: int) -> None:
    assert node["path"] == path, node
    assert (node.get("type"), node.get("major"), node.get("minor")) == ("c", major, minor), node


def test_whole_gpu_and_static_mig_device_are_prepared_and_unprepared(
    kube: Kube,
    namespace: str,
    node: str,
    classes: None,  # noqa: F811
    roots: Callable[[], Path],
    plugins: list[PluginProcess],
    plugin_kubeconfig: Path,
) -> None:
    plugin = start(plugins, roots(), plugin_kubeconfig, node, backend="nvml", profile=MIXED)
    pool_slices(kube, node)
    gpus = simulated_gpus(MIXED, node_name=node)
    kubelet = KubeletClient(plugin)

    whole, _ = claim_device(
        kube,
        namespace,
        node,
        device_class=DRIVER,
        cel='device.attributes["gpu.drasil.dev"].index == 1',
    )
    a100 = gpus[2]
    mig = next(m for m in a100.migs if m.instance.profile.name == "3g.20gb")
    gi = mig.instance.gpu_instance_id
    static, static_device = claim_device(
        kube, namespace, node, device_class=MIG_CLASS,
        cel=f'device.attributes["{DRIVER}"].profile == "3g.20gb"',
    )  # fmt: skip

    answers = kubelet.prepare([whole, static]).claims
    assert answers[whole.uid].error == ""
    assert answers[static.uid].error == ""

    spec = json.loads(cdi_file(plugin, whole.uid).read_text())
    env = [e for d in spec["devices"] for e in d["containerEdits"].get("env") or []]
    assert any(e.endswith(f"={gpus[1].uuid}") for e in env), env
    # GPU nodes name their host file under the driver root's dev/ (the runtime stats it).
    (gpu_node,) = [n for n in cdi_nodes(plugin, whole.uid) if n["path"] == "/dev/nvidia1"]
    assert gpu_node["hostPath"] == str(plugin.mock_root().root / "dev" / "nvidia1"), gpu_node

    nodes = cdi_nodes(plugin, static.uid)
    by_path = {n["path"]: n for n in nodes}
    assert by_path["/dev/nvidia2"]["hostPath"] == str(plugin.mock_root().root / "dev/nvidia2")
    caps = sorted(
        (n for n in nodes if n["path"].startswith("/dev/nvidia-caps/")), key=lambda n: n["minor"]
    )
    want = [mig_cap_minor(a100.minor, gi, None), mig_cap_minor(a100.minor, gi, 0)]
    assert len(caps) == 2, nodes
    for cap, minor in zip(caps, want, strict=True):
        assert_char_node(cap, f"/dev/nvidia-caps/nvidia-cap{minor}", CAPS_MAJOR, minor)
    mig_env = [
        e
        for d in json.loads(cdi_file(plugin, static.uid).read_text())["devices"]
        for e in d["containerEdits"].get("env") or []
    ]
    assert any(e.endswith(f"={mig.uuid}") for e in mig_env), (static_device, mig_env)

    for ref in (whole, static):
        assert kubelet.unprepare([ref]).claims[ref.uid].error == ""
    assert checkpoint_claims(plugin) == {}
    assert list(plugin.cdi_root.glob("*.json")) == []
    # A static MIG device stays: unprepare destroys no instance it did not cut. The mock
    # writes its state file at every MIG change, so no file means no change at all.
    if plugin.gpu_state_file.exists():
        assert gi in {i["id"] for i in gpu_instances(plugin, a100.uuid)}


def gpu_instances(plugin: PluginProcess, gpu_uuid: str) -> list[Any]:
    """The GPU instances the GPU state file records for the GPU (simulated backend's
    format, which the mock shares)."""
    if not plugin.gpu_state_file.exists():
        return []
    state = json.loads(plugin.gpu_state_file.read_text())
    entry = (state.get("gpus") or {}).get(gpu_uuid) or {}
    return list(entry.get("gpuInstances") or [])


def test_dynamic_mig_placement_is_cut_and_destroyed_through_nvml(
    kube: Kube,
    namespace: str,
    node: str,
    classes: None,  # noqa: F811
    roots: Callable[[], Path],
    plugins: list[PluginProcess],
    plugin_kubeconfig: Path,
) -> None:
    plugin = start(
        plugins, roots(), plugin_kubeconfig, node,
        backend="nvml", profile="h100-80gb:1", mig_mode="dynamic",
    )  # fmt: skip
    pool_slices(kube, node)
    (h100,) = simulated_gpus("h100-80gb:1", node_name=node)
    ref, device = claim_device(kube, namespace, node, device_class=MIG_CLASS, cel=PROFILE_3G)
    assert device.startswith("gpu-0-mig-3g40gb-at-")
    kubelet = KubeletClient(plugin)
    assert kubelet.prepare([ref]).claims[ref.uid].error == ""
    cut = gpu_instances(plugin, h100.uuid)
    assert len(cut) == 1, json.loads(plugin.gpu_state_file.read_text())
    record = checkpoint_claims(plugin)[ref.uid]["devices"][0]["mig"]
    assert record["state"] == "Created"
    caps = [n for n in cdi_nodes(plugin, ref.uid) if n["path"].startswith("/dev/nvidia-caps/")]
    assert len(caps) == 2, cdi_nodes(plugin, ref.uid)
    assert all(n.get("type") == "c" and n.get("major") == CAPS_MAJOR for n in caps), caps

    assert kubelet.unprepare([ref]).claims[ref.uid].error == ""
    assert gpu_instances(plugin, h100.uuid) == []
    assert checkpoint_claims(plugin) == {}


def test_an_xid_from_nvml_events_taints_the_device(
    kube: Kube,
    node: str,
    roots: Callable[[], Path],
    plugins: list[PluginProcess],
    plugin_kubeconfig: Path,
) -> None:
    plugin = start(plugins, roots(), plugin_kubeconfig, node, backend="nvml", profile=MIXED)
    pool_slices(kube, node)
    gpus = simulated_gpus(MIXED, node_name=node)

    def taints() -> dict[str, Any]:
        return {
            d["name"]: d.get("taints")
            for s in node_slices(kube, node)
            for d in s["spec"].get("devices") or []
        }

    plugin.inject_xid(gpus[1].uuid, XID_DBE)
    tainted = wait_for(
        lambda: taints() if taints().get("gpu-1") else NotYet(taints()),
        timeout=30,
        what="gpu-1 tainted after an XID",
    )
    assert tainted["gpu-1"][0]["key"] == f"{DRIVER}/unhealthy"
    assert tainted["gpu-1"][0]["effect"] == "NoSchedule"
    assert not tainted["gpu-0"]
    assert not tainted["gpu-3"]


def test_the_mock_sees_the_driver_roots_device_nodes(
    roots: Callable[[], Path], plugin_kubeconfig: Path
) -> None:
    """The plugin's GPUs and the mock's are the same device nodes: one dev dir."""
    plugin = PluginProcess(
        root=roots(), kubeconfig=plugin_kubeconfig, node_name="x", profile=MIXED, backend="nvml"
    )
    mock = plugin.mock_root()
    assert mock.node.dev_root.resolve() == (mock.root / "dev").resolve()
    for gpu in simulated_gpus(MIXED, node_name="x"):
        mode = (mock.root / "dev" / f"nvidia{gpu.minor}").stat().st_mode
        assert stat.S_ISCHR(mode)

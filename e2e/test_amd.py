"""AMD Instinct GPUs on the real node: the node's plugin simulates AMD GPUs (a fake
amdgpu sysfs tree in its state dir) beside or instead of NVIDIA ones; Pods claim them
through the chart's DeviceClasses and run under containerd and runc.

The module's fixture renders the chart's AMD DeviceClasses (`amdgpu.drasil.dev`,
`amdgpu-partition.drasil.dev`, `any-gpu.drasil.dev`) and restarts the node's plugin
with the profile a test needs, on a fresh sysfs tree (partition modes and RAS counters
are state the tree keeps); afterwards the node simulates its eight H100s again. A device
plugin for `amd.com/gpu` runs as a process of its own beside the DRA plugin.

What is asserted is what a user sees: the device nodes inside the container (their
major and minor numbers) and its env, the claim's CDI spec, the Pod's events, the
ResourceSlice's taints, the Node's allocatable.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from drasil.driver.amd.partitions import current_mode
from drasil.driver.devices import Vendor
from drasil.driver.simulated.amdsysfs import DRM_MAJOR, KFD_MAJOR, bump_ras_errors
from drasil.kubeletplugin.deviceplugin.resources import AMD_RESOURCE_NAME, socket_name
from e2e.harness.chart import render
from e2e.harness.cluster.node import Node
from e2e.harness.kube import RESOURCE, Kube, NotYet, wait_for
from e2e.harness.pluginproc import DRIVER, PluginProcess
from e2e.harness.pods import (
    POD_TIMEOUT,
    cdi_spec,
    container_env,
    delete_pod,
    device_variable,
    events,
    pod,
    template,
    visible_uuids,
    wait_running,
)
from e2e.test_deviceplugin import described
from e2e.test_kubeletplugin import node_slices
from e2e.test_node import pod_claim

AMD_CLASS = "amdgpu.drasil.dev"
PARTITION_CLASS = "amdgpu-partition.drasil.dev"
ANY_CLASS = "any-gpu.drasil.dev"
# gpu-0 (NVIDIA), amdgpu-1 and amdgpu-9 (an MI300X's card and render nodes are followed
# by its seven spare XCP ones).
MIXED = "h100-80gb:1,mi300x:2"
CPX = "mi300x-cpx:1"  # one MI300X in CPX/NPS4: amdgpu-1-cpx-0 .. amdgpu-1-cpx-7
# One MI300X in SPX/NPS1 with --amd-partition-mode dynamic: amdgpu-1, its two DPX, four
# QPX and eight CPX partitions.
DYNAMIC = "mi300x:1"
DYNAMIC_DEVICES = 15
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
METADATA_DIR = "/var/run/kubernetes.io/dra-device-attributes"
AMD_TREE = "simulated-amd-sysfs"  # in the plugin's state dir (PluginOptions.simulated_amd_root)
# The health watcher polls every 5 s; the plugin republishes on a change.
TAINT_TIMEOUT = 60
# Prints the container's character devices (`DEV <path> <major> <minor>`, hex) and the
# names in /dev, then the env; then waits, exiting at once on SIGTERM.
COMMAND = (
    'for f in /dev/kfd /dev/dri/*; do [ -c "$f" ] && stat -c "DEV %n %t %T" "$f"; done; '
    'echo "DEVDIR $(ls /dev | tr "\\n" " ")"; '
    "env | sort; trap 'exit 0' TERM; sleep 3600 & wait"
)


# -- helpers -------------------------------------------------------------------------


@dataclass(frozen=True)
class ContainerView:
    """What a container printed (COMMAND): its char devices by path as (major, minor),
    the names in its /dev, its env."""

    devices: dict[str, tuple[int, int]]
    dev_names: list[str]
    env: dict[str, str]

    def render_nodes(self) -> list[str]:
        return sorted(p for p in self.devices if p.startswith("/dev/dri/renderD"))

    def card_nodes(self) -> list[str]:
        return sorted(p for p in self.devices if p.startswith("/dev/dri/card"))


def container_view(kube: Kube, namespace: str, name: str) -> ContainerView:
    env = container_env(kube, namespace, name)  # waits until the env is printed
    log = kube.core.read_namespaced_pod_log(name, namespace, container="c")
    devices: dict[str, tuple[int, int]] = {}
    dev_names: list[str] = []
    for line in log.splitlines():
        if line.startswith("DEV "):
            _, path, major, minor = line.split()
            devices[path] = (int(major, 16), int(minor, 16))
        elif line.startswith("DEVDIR "):
            dev_names = line.split()[1:]
    return ContainerView(devices=devices, dev_names=dev_names, env=env)


def amd_pod(kube: Kube, ns: str, node: Node, **kw: Any) -> str:
    """A Pod (printing COMMAND) with a claim from a fresh template (`template`'s kw)."""
    return pod(kube, ns, node, template_name=template(kube, ns, **kw), command=COMMAND)


def published(kube: Kube, node: Node) -> dict[str, dict[str, Any]]:
    """The node's devices of our driver by name: {"attributes": plain values, "taints"}."""
    return {
        d["name"]: {
            "attributes": {
                k: next(v for v in value.values() if v is not None)
                for k, value in d["attributes"].items()
            },
            "taints": d.get("taints") or [],
        }
        for s in node_slices(kube, node.name)
        if s["spec"]["driver"] == DRIVER
        for d in s["spec"].get("devices") or []
    }


def expected_nodes(attributes: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """The device nodes an AMD device's container gets: /dev/kfd and the device's own
    DRM card and render nodes, by the numbers amdgpu gives them."""
    card, render = attributes["cardIndex"], attributes["renderIndex"]
    return {
        "/dev/kfd": (KFD_MAJOR, 0),
        f"/dev/dri/card{card}": (DRM_MAJOR, card),
        f"/dev/dri/renderD{render}": (DRM_MAJOR, render),
    }


def results(claim: dict[str, Any]) -> dict[str, str]:
    """The claim's allocated devices: device -> request."""
    found = claim["status"]["allocation"]["devices"]["results"]
    assert {r["driver"] for r in found} == {DRIVER}
    return {r["device"]: r["request"] for r in found}


# -- fixtures ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def simulate(kube: Kube, node: Node) -> Iterator[Callable[..., Node]]:
    """simulate(profile, devices, partition_mode="static"): the node's plugin restarted
    to simulate `profile` on fresh GPUs (a new sysfs tree) with that
    --amd-partition-mode, once `devices` are published; a no-op when it already does.
    Creates the chart's AMD DeviceClasses for the module; afterwards the plugin
    simulates the node's own profile again."""
    classes = [
        obj
        for obj in render(namespace="drasil")
        if obj["kind"] == "DeviceClass"
        and obj["metadata"]["name"] in (AMD_CLASS, PARTITION_CLASS, ANY_CLASS)
    ]
    assert len(classes) == 3, [c["metadata"]["name"] for c in classes]
    for obj in classes:
        kube.delete(RESOURCE, "DeviceClass", obj["metadata"]["name"])
        kube.create({k: obj[k] for k in ("apiVersion", "kind", "metadata", "spec")})
    original = node.plugin.profile
    current = {"profile": original, "mode": "static"}

    def restart(profile: str, devices: int, partition_mode: str = "static") -> Node:
        if (current["profile"], current["mode"]) == (profile, partition_mode):
            return node
        node.plugin.stop()
        shutil.rmtree(node.plugin.state_dir / AMD_TREE, ignore_errors=True)
        node.plugin.profile = profile
        env = {"AMD_PARTITION_MODE": None if partition_mode == "static" else partition_mode}
        node.restart_plugin_with(env, published=devices, reset_gpus=True)
        current.update(profile=profile, mode=partition_mode)
        return node

    try:
        yield restart
    finally:
        restart(original, 8)
        for obj in classes:
            kube.delete(RESOURCE, "DeviceClass", obj["metadata"]["name"])


@pytest.fixture
def mixed(simulate: Callable[..., Node]) -> Node:
    """The node with one H100 (gpu-0) and two MI300Xs (amdgpu-1, amdgpu-9)."""
    return simulate(MIXED, 3)


@pytest.fixture
def cpx(simulate: Callable[..., Node]) -> Node:
    """The node with one MI300X in CPX mode: eight partitions."""
    return simulate(CPX, 8)


@pytest.fixture
def dynamic(simulate: Callable[..., Node]) -> Node:
    """The node with one MI300X in SPX whose partitions prepare makes (dynamic mode)."""
    return simulate(DYNAMIC, DYNAMIC_DEVICES, partition_mode="dynamic")


def in_mode(mode: str) -> list[dict[str, Any]]:
    """One request "gpu" for an AMD partition of compute mode `mode`."""
    expression = f'device.attributes["{DRIVER}"].computePartition == "{mode}"'
    selectors = [{"cel": {"expression": expression}}]
    return [
        {"name": "gpu", "exactly": {"deviceClassName": PARTITION_CLASS, "selectors": selectors}}
    ]


# -- tests ---------------------------------------------------------------------------


def test_a_pod_sees_kfd_and_only_its_own_gpus_render_and_card_nodes(
    kube: Kube, ns: str, mixed: Node
) -> None:
    name = amd_pod(kube, ns, mixed, device_class=AMD_CLASS)
    wait_running(kube, ns, name)
    claim = pod_claim(kube, ns, name)
    (device,) = results(claim)
    devices = published(kube, mixed)
    attributes = devices[device]["attributes"]
    assert attributes["type"] == "amdgpu"
    assert attributes["vendor"] == "amd"
    assert attributes["productName"] == "AMD Instinct MI300X"
    assert attributes["family"] == "gfx942"

    view = container_view(kube, ns, name)
    # /dev/kfd and the GPU's own card and render nodes, by number; nothing of the other
    # MI300X, of its spare XCP nodes or of the H100.
    assert view.devices == expected_nodes(attributes), view
    assert len(view.render_nodes()) == len(view.card_nodes()) == 1
    assert not [n for n in view.dev_names if n.startswith("nvidia")], view.dev_names
    uuid = str(attributes["uuid"])
    assert visible_uuids(view.env) == [uuid]
    assert view.env[device_variable(device)] == uuid
    assert not [k for k in view.env if k.startswith(("NVIDIA_", "CUDA_"))], view.env

    # The CDI spec containerd read: the device nodes by number, no hooks, and no mount
    # but the request's device metadata file (KEP-5304): no driver files.
    spec = json.loads(cdi_spec(mixed, claim["metadata"]["uid"]).read_text())
    edits = [spec.get("containerEdits") or {}] + [d["containerEdits"] for d in spec["devices"]]
    assert not [e for e in edits if e.get("hooks")], spec
    mounts = [m["containerPath"] for e in edits for m in e.get("mounts") or []]
    assert [m for m in mounts if not m.startswith(f"{METADATA_DIR}/")] == [], spec
    nodes = {n["path"]: (n["major"], n["minor"]) for e in edits for n in e.get("deviceNodes") or []}
    assert nodes == expected_nodes(attributes), spec


def test_each_class_gets_its_vendors_gpus_and_any_gpu_can_take_one_of_each(
    kube: Kube, ns: str, mixed: Node
) -> None:
    def all_of(request: str, device_class: str) -> dict[str, Any]:
        return {
            "name": request,
            "exactly": {"deviceClassName": device_class, "allocationMode": "All"},
        }

    devices = published(kube, mixed)
    types = {name: d["attributes"]["type"] for name, d in devices.items()}
    assert types == {"gpu-0": "gpu", "amdgpu-1": "amdgpu", "amdgpu-9": "amdgpu"}

    # One claim, every GPU of each vendor's class: each request gets its vendor's only.
    name = amd_pod(kube, ns, mixed, requests=[all_of("nvidia", DRIVER), all_of("amd", AMD_CLASS)])
    wait_running(kube, ns, name)
    got = results(pod_claim(kube, ns, name))
    assert got == {"gpu-0": "nvidia", "amdgpu-1": "amd", "amdgpu-9": "amd"}
    view = container_view(kube, ns, name)
    uuids = {n: str(d["attributes"]["uuid"]) for n, d in devices.items()}
    assert visible_uuids(view.env) == sorted(uuids.values())
    assert view.env["NVIDIA_VISIBLE_DEVICES"] == "void"  # the H100's spec, as for any
    assert view.devices == {
        **expected_nodes(devices["amdgpu-1"]["attributes"]),
        **expected_nodes(devices["amdgpu-9"]["attributes"]),
    }
    delete_pod(kube, ns, name)  # frees the three GPUs for the next claim

    # any-gpu.drasil.dev, two GPUs of distinct types: one NVIDIA and one AMD GPU.
    any_two = [
        {
            "name": "gpus",
            "exactly": {"deviceClassName": ANY_CLASS, "allocationMode": "ExactCount", "count": 2},
        }
    ]
    distinct = {"requests": ["gpus"], "distinctAttribute": f"{DRIVER}/type"}
    claim_name = "one-of-each"
    kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "ResourceClaim",
            "metadata": {"name": claim_name},
            "spec": {"devices": {"requests": any_two, "constraints": [distinct]}},
        },
        ns,
    )
    name = pod(kube, ns, mixed, claim_name=claim_name, command=COMMAND)
    wait_running(kube, ns, name)
    got = results(pod_claim(kube, ns, name))
    assert sorted(types[d] for d in got) == ["amdgpu", "gpu"], got
    view = container_view(kube, ns, name)
    assert visible_uuids(view.env) == sorted(uuids[d] for d in got)
    (amd,) = (d for d in got if types[d] == "amdgpu")
    assert view.devices == expected_nodes(devices[amd]["attributes"])


@pytest.mark.parametrize("with_nvidia", [False, True], ids=["amd-only", "mixed"])
def test_a_gpu_config_for_the_amd_request_is_refused_naming_the_vendor(
    kube: Kube, ns: str, mixed: Node, with_nvidia: bool
) -> None:
    """A TimeSlicing GpuConfig naming the claim's AMD request: prepare refuses it, the
    Pod never starts, its events say why. Alone, the AMD request is all the claim's
    requests, and the scheduler hands the config over with no requests at all."""
    parameters = {
        "apiVersion": "resource.drasil.dev/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}},
    }
    requests: list[dict[str, Any]] = [{"name": "amd", "exactly": {"deviceClassName": AMD_CLASS}}]
    if with_nvidia:
        requests.insert(0, {"name": "nvidia", "exactly": {"deviceClassName": DRIVER}})
    configs = [{"requests": ["amd"], "opaque": {"driver": DRIVER, "parameters": parameters}}]
    name = amd_pod(kube, ns, mixed, requests=requests, configs=configs)

    def reported() -> Any:
        found = [e for e in events(kube, ns, name) if "AMD GPU" in e]
        return found or NotYet(events(kube, ns, name))

    (event, *_) = wait_for(
        reported, timeout=POD_TIMEOUT, what=f"the plugin's refusal in the events of {name}"
    )
    assert "GpuConfig" in event
    assert "request amd" in event
    assert "takes no opaque config" in event
    assert kube.get("v1", "Pod", name, ns)["status"]["phase"] == "Pending"
    claim = pod_claim(kube, ns, name)
    assert sorted(results(claim).values()) == sorted(r["name"] for r in requests)
    assert not cdi_spec(mixed, claim["metadata"]["uid"]).exists()
    delete_pod(kube, ns, name)


def test_ras_errors_taint_only_that_gpu_and_new_pods_get_the_other(
    kube: Kube, ns: str, mixed: Node
) -> None:
    """Last on the mixed node: the taint would last 5 minutes (the watcher's recovery
    time), so the next profile starts the plugin on a fresh tree."""
    devices = published(kube, mixed)
    assert not [d for d in devices.values() if d["taints"]], devices
    broken = "amdgpu-9"
    bdf = devices[broken]["attributes"]["resource.kubernetes.io/pciBusID"]
    bump_ras_errors(mixed.plugin.state_dir / AMD_TREE, bdf, "umc", uncorrectable=1)

    def tainted() -> Any:
        now = {n: d["taints"] for n, d in published(kube, mixed).items()}
        return now if now.get(broken) else NotYet(now)

    taints = wait_for(tainted, timeout=TAINT_TIMEOUT, what=f"{broken} tainted in its slice")
    (taint,) = taints[broken]
    assert (taint["key"], taint["value"], taint["effect"]) == (
        f"{DRIVER}/unhealthy",
        "true",
        "NoSchedule",
    )
    assert taints["amdgpu-1"] == taints["gpu-0"] == []

    name = amd_pod(kube, ns, mixed, device_class=AMD_CLASS)
    wait_running(kube, ns, name)
    assert list(results(pod_claim(kube, ns, name))) == ["amdgpu-1"]


def test_a_cpx_partition_pod_sees_only_its_partitions_render_node(
    kube: Kube, ns: str, cpx: Node
) -> None:
    devices = published(kube, cpx)
    assert sorted(devices) == [f"amdgpu-1-cpx-{i}" for i in range(8)]
    assert {d["attributes"]["type"] for d in devices.values()} == {"amdgpu-partition"}
    assert {d["attributes"]["partitionProfile"] for d in devices.values()} == {"cpx_nps4"}

    name = amd_pod(kube, ns, cpx, device_class=PARTITION_CLASS)
    wait_running(kube, ns, name)
    (device,) = results(pod_claim(kube, ns, name))
    attributes = devices[device]["attributes"]
    view = container_view(kube, ns, name)
    assert view.devices == expected_nodes(attributes), view
    assert view.render_nodes() == [f"/dev/dri/renderD{attributes['renderIndex']}"]
    assert visible_uuids(view.env) == [attributes["uuid"]]
    assert view.env[device_variable(device)] == attributes["uuid"]


def test_a_cpx_partition_is_made_at_prepare_and_another_mode_waits_with_an_explanation(
    kube: Kube, ns: str, dynamic: Node
) -> None:
    devices = published(kube, dynamic)
    assert len(devices) == DYNAMIC_DEVICES
    counts = {m: sum(f"-{m}-" in n for n in devices) for m in ("dpx", "qpx", "cpx")}
    assert counts == {"dpx": 2, "qpx": 4, "cpx": 8}
    tree = dynamic.plugin.state_dir / AMD_TREE
    bdf = devices["amdgpu-1"]["attributes"][PCI_BUS_ID]
    assert current_mode(tree, bdf) == "SPX"

    first = amd_pod(kube, ns, dynamic, requests=in_mode("CPX"))
    wait_running(kube, ns, first)
    assert current_mode(tree, bdf) == "CPX"  # prepare switched the GPU
    (device,) = results(pod_claim(kube, ns, first))
    index = int(device.removeprefix("amdgpu-1-cpx-"))
    # Partition 0 has the GPU's own nodes (card1, renderD128), partition i those of the
    # GPU's i-th spare XCP device (card 1+i, renderD 128+i), as amdgpu numbers them.
    view = container_view(kube, ns, first)
    assert view.devices == expected_nodes({"cardIndex": 1 + index, "renderIndex": 128 + index})
    (uuid,) = visible_uuids(view.env)
    assert view.env[device_variable(device)] == uuid

    # A DPX partition: the scheduler finds four dies free for it, but the GPU is in CPX
    # for the first claim; prepare refuses, and the Pod's events say why.
    second = amd_pod(kube, ns, dynamic, requests=in_mode("DPX"))

    def refused() -> Any:
        found = [e for e in events(kube, ns, second) if "held in CPX mode" in e]
        return found or NotYet(events(kube, ns, second))

    (event, *_) = wait_for(refused, timeout=POD_TIMEOUT, what=f"{second}'s refusal in its events")
    assert "needs its GPU in DPX mode" in event
    assert f"claim {ns}/{pod_claim(kube, ns, first)['metadata']['name']}" in event
    assert kube.get("v1", "Pod", second, ns)["status"]["phase"] == "Pending"

    # Once the first claim is gone the GPU is free: kubelet's retry switches it to DPX.
    delete_pod(kube, ns, first)
    wait_running(kube, ns, second)
    assert current_mode(tree, bdf) == "DPX"
    delete_pod(kube, ns, second)
    # The last claim gone, the GPU is back in the mode it had.
    wait_for(
        lambda: current_mode(tree, bdf) == "SPX" or NotYet(current_mode(tree, bdf)),
        timeout=POD_TIMEOUT,
        what="the GPU back in SPX",
    )


# -- device-plugin mode (last: it runs beside the node's DRA plugin) ------------------


@dataclass
class AmdDevicePlugin(PluginProcess):
    """The plugin in device-plugin mode on an AMD-only node: its one socket is
    `amd.com/gpu`'s (no `drasil.dev/gpu` one), which is what `wait_ready` dials."""

    @property
    def device_plugin_socket(self) -> Path:
        return self.device_plugins_dir / socket_name(AMD_RESOURCE_NAME, vendor=Vendor.AMD)


@pytest.fixture(scope="module")
def amd_device_plugin(node: Node) -> Iterator[Node]:
    """A device plugin simulating `mi300x:2` beside the node's DRA plugin, registered
    with kubelet and both GPUs allocatable; afterwards stopped and none allocatable."""
    node.check_device_plugin_socket()
    plugin = AmdDevicePlugin(
        root=node.run_dir / "amd-device-plugin",
        kubeconfig=node.plugin_kubeconfig,
        node_name=node.name,
        profile="mi300x:2",
        cdi_dir=node.cdi_dir,
        log_file=node.log("drasil-amd-device-plugin"),
        die_with_parent=True,
        mode="device-plugin",
    )
    shutil.rmtree(plugin.root, ignore_errors=True)
    plugin.start(timeout=60)
    try:
        node.wait_registered(plugin, after=0)
        node.wait_extended_resource(AMD_RESOURCE_NAME, capacity=2, allocatable=2)
        yield node
    finally:
        plugin.stop()
        node.wait_extended_resource(AMD_RESOURCE_NAME, allocatable=0)


def test_device_plugin_mode_advertises_the_amd_gpus_as_amd_com_gpu(
    kube: Kube, ns: str, amd_device_plugin: Node, kubectl: Callable[..., Any]
) -> None:
    node = amd_device_plugin
    sections = described(kubectl, node)
    assert sections["Capacity"][AMD_RESOURCE_NAME] == "2"
    assert sections["Allocatable"][AMD_RESOURCE_NAME] == "2"
    kubelet_log = node.log("kubelet").read_text(errors="replace")
    assert re.search(
        r'"Got registration request from device plugin with resource".*'
        rf'resourceName="{re.escape(AMD_RESOURCE_NAME)}"',
        kubelet_log,
    ), "kubelet's log has no registration of amd.com/gpu"
    # The AMD static CDI spec Allocate names: each GPU's nodes by number, nothing else.
    spec = json.loads((node.cdi_dir / f"k8s.{DRIVER}-amd-device.json").read_text())
    nodes = {
        d["name"]: {n["path"]: (n["major"], n["minor"]) for n in d["containerEdits"]["deviceNodes"]}
        for d in spec["devices"]
    }
    assert nodes == {
        "amdgpu-1": expected_nodes({"cardIndex": 1, "renderIndex": 128}),
        "amdgpu-9": expected_nodes({"cardIndex": 9, "renderIndex": 136}),
    }
    assert not spec.get("containerEdits"), spec

    # A Pod written for ROCm's device plugin runs unchanged and sees one GPU's nodes.
    name = pod(kube, ns, node, command=COMMAND, limits={AMD_RESOURCE_NAME: "1"})
    wait_running(kube, ns, name)
    view = container_view(kube, ns, name)
    (uuid,) = visible_uuids(view.env)
    (device,) = (n for n, nodes_of in nodes.items() if view.devices == nodes_of)
    assert view.env[device_variable(device)] == uuid
    assert not [k for k in view.env if k.startswith("NVIDIA_")]

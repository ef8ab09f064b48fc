"""Device-plugin mode with AMD GPUs: resources, Allocate, the static CDI specs, health.

AMD devices are built by hand here (``amd_gpu``, ``amd_partition``: the shape
``drasil.driver.amd.devices`` gives them), beside NVIDIA ones from the simulated
backend. The server tests run the real ``DevicePluginServer`` against the kubelet-like
``FakeKubelet`` of ``test_deviceplugin_kubelet``, with discovery answering those
devices; one runs the simulated backend's own AMD GPUs end to end.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc
import jsonschema
import pytest
from kubelet_client import DEADLINE, node_devices, wait_until
from test_deviceplugin_kubelet import (
    FAST,
    GPU,
    NODE,
    FakeKubelet,
    Node,
    allocate,
    health_of,
    node_options,
    preferred_ids,
    short_root,
    stream_until,
)

from drasil.api.kubelet.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from drasil.driver.cdi.spec import ContainerEdits, DeviceNode, Hook, Mount, validate_spec
from drasil.driver.cdi.staticspec import (
    build_device_spec,
    device_cdi_id,
    device_spec_path,
    write_device_specs,
)
from drasil.driver.devices import CharDevice, Device, DeviceType, Vendor
from drasil.kubeletplugin.deviceplugin.allocation import container_response, resolve
from drasil.kubeletplugin.deviceplugin.plugin import DevicePluginServer
from drasil.kubeletplugin.deviceplugin.resources import (
    DevicePluginConfigError,
    Resource,
    plan_resources,
    socket_name,
)
from drasil.kubeletplugin.options import parse_options
from drasil.kubeletplugin.vendors.registry import open_vendors

DRIVER = "gpu.drasil.dev"
AMD = "amd.com/gpu"
KFD = CharDevice("/dev/kfd", "/dev/kfd", 235, 0)
NVIDIA_ENV = "NVIDIA_VISIBLE_DEVICES"


def _nodes(card: int, render: int) -> tuple[CharDevice, ...]:
    return (
        KFD,
        CharDevice(f"/dev/dri/card{card}", f"/dev/dri/card{card}", 226, card),
        CharDevice(f"/dev/dri/renderD{render}", f"/dev/dri/renderD{render}", 226, render),
    )


def amd_gpu(card: int, *, numa: int = 0) -> Device:
    """A whole AMD GPU (SPX), as ``drasil.driver.amd.devices`` names and shapes it."""
    uuid = f"GPU-{0xA000 + card:016x}"
    return Device(
        name=f"amdgpu-{card}",
        type=DeviceType.AMDGPU,
        uuid=uuid,
        minor=card,
        attributes={"type": "amdgpu", "uuid": uuid, "productName": "AMD Instinct MI300X"},
        capacity={"memory": 192 << 30, "computeUnits": 304},
        char_devices=_nodes(card, 127 + card),
        numa_node=numa,
        pcie_root=f"pci0000:{card:02x}",
    )


def amd_partition(parent_card: int, index: int, *, numa: int = 1) -> Device:
    """Partition ``index`` of a CPX-mode GPU: its own card and render node, the GPU's kfd."""
    parent = f"GPU-{0xB000 + parent_card:016x}"
    card = parent_card + index
    return Device(
        name=f"amdgpu-{parent_card}-cpx-{index}",
        type=DeviceType.AMDGPU_PARTITION,
        uuid=f"{parent}-{index}",
        minor=card,
        attributes={"type": "amdgpu-partition", "uuid": f"{parent}-{index}"},
        capacity={"memory": 24 << 30, "computeUnits": 38},
        parent_uuid=parent,
        char_devices=_nodes(card, 127 + card),
        numa_node=numa,
        pcie_root=f"pci0000:{parent_card:02x}",
    )


AMD_GPUS = [amd_gpu(1), amd_gpu(2, numa=1)]
CPX = [amd_partition(9, i) for i in range(4)]
AMD_DEVICES = AMD_GPUS + CPX
AMD_IDS = ["amdgpu-1", "amdgpu-2", "amdgpu-9-cpx-0", "amdgpu-9-cpx-1", "amdgpu-9-cpx-2"]
AMD_IDS += ["amdgpu-9-cpx-3"]
BY_NAME = {d.name: d for d in AMD_DEVICES}


def nvidia(profile: str = "h100-80gb:2") -> list[Device]:
    return list(node_devices(profile, node=NODE).values())


def plan(
    devices: Sequence[Device], strategy: str = "none", *, replicas: int = 1, amd: str = AMD
) -> dict[str, Resource]:
    resources = plan_resources(
        devices,
        resource_name=GPU,
        mig_strategy=strategy,
        replicas=replicas,
        amd_resource_name=amd,
    )
    return {r.name: r for r in resources}


def ids(resource: Resource) -> list[str]:
    return [u.id for u in resource.units]


# ---- resources ---------------------------------------------------------------------------------


def test_amd_devices_are_advertised_under_their_own_resource_beside_nvidia() -> None:
    resources = plan(nvidia() + AMD_DEVICES)
    assert list(resources) == [GPU, AMD]  # NVIDIA's first, as before
    assert ids(resources[GPU]) == ["gpu-0", "gpu-1"]
    # Whole GPUs and partitions alike, one ID each, by card number.
    assert ids(resources[AMD]) == AMD_IDS
    assert resources[AMD].vendor is Vendor.AMD
    assert resources[GPU].vendor is Vendor.NVIDIA


def test_a_node_with_amd_devices_only_serves_no_nvidia_resource() -> None:
    for strategy in ("none", "single", "mixed"):
        assert list(plan(AMD_DEVICES, strategy)) == [AMD]
    # A node without any device still serves --resource-name, empty, as it always did.
    assert {n: ids(r) for n, r in plan([]).items()} == {GPU: []}


def test_the_amd_resource_name_is_a_flag() -> None:
    opts = parse_options(["--node-name=n1"], {})
    assert opts.amd_resource_name == AMD
    assert opts.resource_name == GPU
    assert list(plan(AMD_DEVICES, amd="example.com/rocm-gpu")) == ["example.com/rocm-gpu"]
    with pytest.raises(DevicePluginConfigError, match="resource name 'gpu'"):
        plan(AMD_DEVICES, amd="gpu")
    # Registered twice, the second registration would replace the first in kubelet.
    with pytest.raises(DevicePluginConfigError, match="give --resource-name and --amd"):
        plan(nvidia() + AMD_DEVICES, amd=GPU)


def test_time_slicing_replicates_nvidia_devices_only() -> None:
    resources = plan(nvidia() + AMD_DEVICES, replicas=3)
    assert ids(resources[GPU]) == [f"gpu-{g}::{n}" for g in range(2) for n in range(3)]
    assert ids(resources[AMD]) == AMD_IDS


def test_mig_strategies_apply_to_nvidia_devices_only() -> None:
    migs = nvidia("a100-40gb-mig:1,l4:1")
    mixed = plan(migs + AMD_DEVICES, "mixed")
    assert list(mixed) == [
        GPU,
        "drasil.dev/mig-1g.5gb",
        "drasil.dev/mig-2g.10gb",
        "drasil.dev/mig-3g.20gb",
        AMD,
    ]
    assert ids(mixed[GPU]) == ["gpu-1"]
    assert ids(mixed[AMD]) == AMD_IDS
    # single without NVIDIA MIG devices falls back to full GPUs, AMD partitions or not.
    single = plan(nvidia("l4:2") + CPX, "single")
    assert {n: ids(r) for n, r in single.items()} == {
        GPU: ["gpu-0", "gpu-1"],
        AMD: [d.name for d in CPX],
    }
    # ... and its every-GPU-in-MIG-mode rule looks at NVIDIA GPUs only.
    only_migs = nvidia("a100-40gb-mig:1")
    assert list(plan(only_migs + AMD_GPUS, "none")) == [GPU, AMD]
    with pytest.raises(DevicePluginConfigError, match=r"found 1g\.5gb") as err:
        plan(only_migs + AMD_GPUS, "single")
    assert "amdgpu" not in str(err.value)


def test_amd_sockets_never_take_nvidia_ones() -> None:
    assert socket_name(GPU) == "drasil-gpu.sock"
    assert socket_name(AMD, vendor=Vendor.AMD) == "drasil-amd-gpu.sock"
    assert socket_name(AMD, vendor=Vendor.AMD, pod_uid="p-1") == "drasil-amd-gpu-p-1.sock"


# ---- Allocate --------------------------------------------------------------------------------


def test_allocate_gives_amd_devices_their_nodes_and_nothing_of_nvidia() -> None:
    (resource,) = plan(AMD_DEVICES).values()
    response = container_response(resolve(resource, ["amdgpu-2", "amdgpu-9-cpx-1"]), driver=DRIVER)
    uuids = [BY_NAME["amdgpu-2"].uuid, BY_NAME["amdgpu-9-cpx-1"].uuid]
    assert dict(response.envs) == {
        "DRASIL_VISIBLE_DEVICES": ",".join(uuids),
        "DRASIL_DEVICE_AMDGPU_2": uuids[0],
        "DRASIL_DEVICE_AMDGPU_9_CPX_1": uuids[1],
    }
    # No host device nodes: AMD's are given by number through the CDI devices, which
    # a runtime creates without looking for them on the host.
    assert list(response.devices) == []
    assert [c.name for c in response.cdi_devices] == [
        "k8s.gpu.drasil.dev/amd-device=amdgpu-2",
        "k8s.gpu.drasil.dev/amd-device=amdgpu-9-cpx-1",
    ]


def test_allocate_of_nvidia_devices_is_unchanged_beside_amd() -> None:
    resources = plan(nvidia() + AMD_DEVICES)
    response = container_response(resolve(resources[GPU], ["gpu-1"]), driver=DRIVER)
    uuid = nvidia()[1].uuid
    assert dict(response.envs) == {
        NVIDIA_ENV: uuid,
        "DRASIL_VISIBLE_DEVICES": uuid,
        "DRASIL_DEVICE_GPU_1": uuid,
    }
    assert [c.name for c in response.cdi_devices] == ["k8s.gpu.drasil.dev/device=gpu-1"]


# ---- the static CDI specs ----------------------------------------------------------------------

NVIDIA_EDITS = ContainerEdits(
    device_nodes=(DeviceNode(path="/dev/nvidiactl"),),
    mounts=(Mount("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/libcuda.so.1", ("ro",)),),
    hooks=(Hook("/opt/drasil/nvidia-cdi-hook", ("nvidia-cdi-hook", "update-ldcache")),),
)


def test_amd_spec_names_each_device_with_its_nodes_by_number(
    schema_validator: jsonschema.Draft7Validator,
) -> None:
    spec = build_device_spec(AMD_DEVICES, driver=DRIVER, vendor=Vendor.AMD)
    schema_validator.validate(spec)
    validate_spec(spec)
    assert spec["kind"] == "k8s.gpu.drasil.dev/amd-device"
    assert "containerEdits" not in spec  # nothing spec-wide
    assert [d["name"] for d in spec["devices"]] == AMD_IDS
    cpx1 = next(d for d in spec["devices"] if d["name"] == "amdgpu-9-cpx-1")
    assert cpx1["containerEdits"] == {
        "env": [f"DRASIL_DEVICE_AMDGPU_9_CPX_1={BY_NAME['amdgpu-9-cpx-1'].uuid}"],
        "deviceNodes": [
            {"path": "/dev/kfd", "type": "c", "major": 235, "minor": 0},
            {"path": "/dev/dri/card10", "type": "c", "major": 226, "minor": 10},
            {"path": "/dev/dri/renderD137", "type": "c", "major": 226, "minor": 137},
        ],
    }
    assert device_cdi_id(driver=DRIVER, device_name="amdgpu-1", vendor=Vendor.AMD) == (
        "k8s.gpu.drasil.dev/amd-device=amdgpu-1"
    )


def test_a_spec_holds_one_vendors_devices_and_only_nvidias_takes_driver_edits() -> None:
    with pytest.raises(ValueError, match="nvidia device spec cannot hold amdgpu-1"):
        build_device_spec([*nvidia(), AMD_GPUS[0]], driver=DRIVER, common=NVIDIA_EDITS)
    with pytest.raises(ValueError, match="amd device spec cannot hold gpu-0"):
        build_device_spec([*nvidia(), AMD_GPUS[0]], driver=DRIVER, vendor=Vendor.AMD)
    with pytest.raises(ValueError, match="no spec-wide edits"):
        build_device_spec(AMD_GPUS, driver=DRIVER, vendor=Vendor.AMD, common=NVIDIA_EDITS)


def test_mixed_node_writes_two_specs_and_nvidia_edits_reach_nvidia_devices_only(
    tmp_path: Path, schema_validator: jsonschema.Draft7Validator
) -> None:
    cdi = tmp_path / "cdi"
    paths = write_device_specs(
        nvidia() + AMD_DEVICES, cdi_root=cdi, driver=DRIVER, nvidia_common=NVIDIA_EDITS
    )
    assert paths == {
        Vendor.NVIDIA: cdi / "k8s.gpu.drasil.dev-device.json",
        Vendor.AMD: cdi / "k8s.gpu.drasil.dev-amd-device.json",
    }
    nv = json.loads(paths[Vendor.NVIDIA].read_text())  # type: ignore[union-attr]
    amd = json.loads(paths[Vendor.AMD].read_text())  # type: ignore[union-attr]
    for spec in (nv, amd):
        schema_validator.validate(spec)
        validate_spec(spec)
    assert [d["name"] for d in nv["devices"]] == ["gpu-0", "gpu-1"]
    assert nv["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidiactl"}]
    assert nv["containerEdits"]["hooks"]
    assert nv["containerEdits"]["mounts"]
    assert [d["name"] for d in amd["devices"]] == AMD_IDS
    assert "containerEdits" not in amd
    assert "nvidia" not in paths[Vendor.AMD].read_text().lower()  # type: ignore[union-attr]

    # The node loses its NVIDIA GPUs: their spec goes, AMD's stays; then AMD's too.
    paths = write_device_specs(AMD_DEVICES, cdi_root=cdi, driver=DRIVER)
    assert paths[Vendor.NVIDIA] is None
    assert [p.name for p in cdi.iterdir()] == ["k8s.gpu.drasil.dev-amd-device.json"]
    write_device_specs([], cdi_root=cdi, driver=DRIVER)
    assert list(cdi.iterdir()) == []


# ---- the server, over real sockets -----------------------------------------------------------


@contextmanager
def running_amd_node(
    devices: Callable[[], list[Device]], *flags: str, profile: str = "h100-80gb:2"
) -> Iterator[Node]:
    """``running_node`` with discovery answering ``devices()`` (hand-built AMD ones)."""
    with short_root() as root:
        opts = node_options(root, *flags, profile=profile)
        kubelet = FakeKubelet(opts.device_plugins_dir).start()
        plugin = DevicePluginServer(opts, vendors=open_vendors(opts)[1], intervals=FAST)
        plugin.node.discover = devices  # type: ignore[method-assign]
        plugin.start()
        try:
            yield Node(root=root, opts=opts, kubelet=kubelet, plugin=plugin)
        finally:
            plugin.stop()
            kubelet.stop()


def unhealthy(response: pb.ListAndWatchResponse) -> set[str]:
    return {i for i, h in health_of(response).items() if h == "Unhealthy"}


def test_a_mixed_node_registers_both_resources_on_their_own_sockets() -> None:
    with running_amd_node(lambda: nvidia() + AMD_DEVICES) as node:
        gpu = node.kubelet.wait_for_registrations(1, GPU)
        amd = node.kubelet.wait_for_registrations(1, AMD)
        assert (gpu.endpoint, amd.endpoint) == ("drasil-gpu.sock", "drasil-amd-gpu.sock")
        assert amd.options.get_preferred_allocation_available is True
        wait_until(lambda: all(e.registered for e in node.plugin.endpoints), what="both")
        assert node.plugin.check_health() == (True, "ok (registered)")
        with node.kubelet.dial(AMD) as stub:
            listed = stream_until(stub, lambda r: True, what="AMD devices")
            numa = {d.ID: [n.ID for n in d.topology.nodes] for d in listed.devices}
            response = allocate(stub, "amdgpu-1", "amdgpu-9-cpx-0")
            # Topology: the other partitions of the GPU share its NUMA node and root.
            assert preferred_ids(
                stub, available=AMD_IDS, must_include=["amdgpu-9-cpx-2"], size=2
            ) == [
                "amdgpu-9-cpx-2",
                "amdgpu-9-cpx-0",
            ]
        with node.kubelet.dial(GPU) as stub:
            assert [d.ID for d in stream_until(stub, lambda r: True, what="GPUs").devices] == [
                "gpu-0",
                "gpu-1",
            ]
            nv_response = allocate(stub, "gpu-0")
        cdi = node.opts.cdi_root
        nv_spec = json.loads(device_spec_path(cdi, driver=DRIVER).read_text())
        amd_path = device_spec_path(cdi, driver=DRIVER, vendor=Vendor.AMD)
        amd_spec = json.loads(amd_path.read_text())
    assert numa == {
        "amdgpu-1": [0],
        "amdgpu-2": [1],
        **{f"amdgpu-9-cpx-{i}": [1] for i in range(4)},
    }
    assert NVIDIA_ENV not in response.envs
    assert response.envs["DRASIL_DEVICE_AMDGPU_1"] == BY_NAME["amdgpu-1"].uuid
    assert list(response.devices) == []
    assert [c.name for c in response.cdi_devices] == [
        "k8s.gpu.drasil.dev/amd-device=amdgpu-1",
        "k8s.gpu.drasil.dev/amd-device=amdgpu-9-cpx-0",
    ]
    assert nv_response.envs[NVIDIA_ENV] == nvidia()[0].uuid
    # Whatever NVIDIA's spec carries spec-wide, AMD's spec carries nothing spec-wide.
    assert [d["name"] for d in nv_spec["devices"]] == ["gpu-0", "gpu-1"]
    assert [d["name"] for d in amd_spec["devices"]] == AMD_IDS
    assert "containerEdits" not in amd_spec
    validate_spec(amd_spec)


def test_an_amd_only_node_serves_the_amd_resource_alone() -> None:
    with running_amd_node(lambda: list(AMD_DEVICES), "--time-slicing-replicas=4") as node:
        node.kubelet.wait_for_registrations(1, AMD)
        assert node.plugin.sockets == [node.opts.device_plugins_dir / "drasil-amd-gpu.sock"]
        with node.kubelet.dial(AMD) as stub:
            listed = stream_until(stub, lambda r: True, what="AMD devices")
        assert node.kubelet.registrations(GPU) == []
        cdi = node.opts.cdi_root
        assert [p.name for p in cdi.iterdir()] == ["k8s.gpu.drasil.dev-amd-device.json"]
    assert [d.ID for d in listed.devices] == AMD_IDS  # no replicas for AMD


def test_unhealthy_amd_devices_are_reported_on_their_resource_only() -> None:
    with running_amd_node(lambda: nvidia() + AMD_DEVICES) as node:
        with node.kubelet.dial(AMD) as stub:
            responses = stub.ListAndWatch(pb.Empty(), timeout=DEADLINE)
            try:
                assert unhealthy(next(responses)) == set()
                # What `drasil fault inject` (and the AMD health watcher) do by name.
                node.inject_fault({"amdgpu-2": "RAS umc ue", "amdgpu-9-cpx-3": "reset"})
                assert unhealthy(next(responses)) == {"amdgpu-2", "amdgpu-9-cpx-3"}
                node.inject_fault({})
                assert unhealthy(next(responses)) == set()
            finally:
                responses.cancel()
        node.inject_fault({"amdgpu-1": "broken"})
        with node.kubelet.dial(AMD) as stub:
            stream_until(stub, lambda r: unhealthy(r) == {"amdgpu-1"}, what="amdgpu-1 down")
        with node.kubelet.dial(GPU) as stub:
            assert unhealthy(stream_until(stub, lambda r: True, what="GPUs")) == set()


def test_unknown_ids_on_the_amd_resource_fail_naming_them() -> None:
    with (
        running_amd_node(lambda: nvidia() + AMD_DEVICES) as node,
        node.kubelet.dial(AMD) as stub,
        pytest.raises(grpc.RpcError) as err,
    ):
        allocate(stub, "amdgpu-1", "gpu-0")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown device IDs for resource amd.com/gpu: gpu-0" in (err.value.details() or "")


def test_the_simulated_backends_amd_gpus_are_served() -> None:
    profile = "h100-80gb:1,mi300x:1,mi300x-cpx:1"
    with short_root() as root:
        opts = node_options(root, profile=profile)
        kubelet = FakeKubelet(opts.device_plugins_dir).start()
        plugin = DevicePluginServer(opts, vendors=open_vendors(opts)[1], intervals=FAST)
        plugin.start()
        try:
            with kubelet.dial(AMD) as stub:
                listed = stream_until(stub, lambda r: True, what="AMD devices")
                first = listed.devices[0].ID
                response = allocate(stub, first)
            with kubelet.dial(GPU) as stub:
                gpus = stream_until(stub, lambda r: True, what="GPUs")
        finally:
            plugin.stop()
            kubelet.stop()
    amd_ids = [d.ID for d in listed.devices]
    # One whole MI300X and the eight CPX partitions of the other.
    assert len(amd_ids) == 9
    assert sum("-cpx-" in i for i in amd_ids) == 8
    assert [d.ID for d in gpus.devices] == ["gpu-0"]
    assert NVIDIA_ENV not in response.envs
    assert list(response.devices) == []
    assert [c.name for c in response.cdi_devices] == [f"k8s.gpu.drasil.dev/amd-device={first}"]

"""Device-plugin mode end to end over real sockets, with a kubelet-like test client.

The plugin runs in-process on simulated GPUs (``h100-80gb:8``: gpu-0..3 on NUMA node
0, gpu-4..7 on node 1, two GPUs per PCIe root); kubelet is ``FakeKubelet``. Every call
goes through gRPC on unix sockets, as kubelet makes it.
"""

from __future__ import annotations

import grpc
import pytest
from kubelet_client import DEADLINE, node_devices, wait_until
from test_deviceplugin_kubelet import (
    GPU,
    NODE,
    PROFILE,
    Node,
    allocate,
    health_of,
    node_options,
    preferred_ids,
    running_node,
    short_root,
    stream_until,
)

from drasil.api.kubelet.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from drasil.driver.cdi.staticspec import device_spec_path
from drasil.kubeletplugin.deviceplugin.plugin import DevicePluginServer
from drasil.kubeletplugin.deviceplugin.resources import DevicePluginConfigError
from drasil.kubeletplugin.vendors.registry import open_vendors

GPUS = [f"gpu-{i}" for i in range(8)]
UUIDS = {name: d.uuid for name, d in node_devices(PROFILE, node=NODE).items()}


def all_healthy(response: pb.ListAndWatchResponse) -> bool:
    return bool(response.devices) and set(health_of(response).values()) == {"Healthy"}


def only_unhealthy(*ids: str):  # type: ignore[no-untyped-def]
    def check(response: pb.ListAndWatchResponse) -> bool:
        return {i for i, h in health_of(response).items() if h == "Unhealthy"} == set(ids)

    return check


def sample(node: Node, counter: str, *, result: str) -> float | None:
    return node.plugin.metrics.registry.get_sample_value(
        f"drasil_device_plugin_{counter}_total", {"resource": GPU, "result": result}
    )


# ---- registration -------------------------------------------------------------------------


def test_registers_the_gpu_resource_with_kubelet() -> None:
    with running_node() as node:
        request = node.kubelet.wait_for_registrations(1)
        assert request.version == "v1beta1"
        assert request.endpoint == "drasil-gpu.sock"  # relative to device-plugins/
        assert request.resource_name == "drasil.dev/gpu"
        assert request.options.get_preferred_allocation_available is True
        assert request.options.pre_start_required is False
        with node.kubelet.dial() as stub:
            options = stub.GetDevicePluginOptions(pb.Empty(), timeout=DEADLINE)
        assert options == request.options
        assert node.plugin.sockets == [node.opts.device_plugins_dir / "drasil-gpu.sock"]
        ok, detail = node.plugin.check_health()
        assert ok, detail
        assert detail == "ok (registered)"


def test_an_unchanged_registration_is_not_repeated() -> None:
    with running_node() as node:
        node.kubelet.wait_for_registrations(1)
        (endpoint,) = node.plugin.endpoints
        wait_until(lambda: endpoint.registered, what="the plugin to see its registration")
        # One more check, as the watch loop makes every tick: nothing changed, no call.
        assert endpoint.sync() is False
        assert len(node.kubelet.registrations()) == 1


def test_registers_once_kubelet_comes_up() -> None:
    with running_node(kubelet_first=False) as node:
        ok, detail = node.plugin.check_health()
        assert ok
        assert detail == "ok (not yet registered: drasil.dev/gpu)"
        node.kubelet.start()
        assert node.kubelet.wait_for_registrations(1).endpoint == "drasil-gpu.sock"


def test_a_refused_registration_is_retried() -> None:
    with running_node(refuse=2) as node:
        node.kubelet.wait_for_registrations(1)
        (endpoint,) = node.plugin.endpoints
        wait_until(lambda: endpoint.registered, what="the plugin to see its registration")
        assert endpoint.registrations == 1
        assert endpoint.last_error == ""
        assert sample(node, "registrations", result="error") == 2
        assert sample(node, "registrations", result="success") == 1


# ---- ListAndWatch and health ------------------------------------------------------------------


def test_list_and_watch_streams_eight_healthy_gpus_with_numa() -> None:
    with running_node() as node, node.kubelet.dial() as stub:
        response = stream_until(stub, all_healthy, what="a device list")
    assert [d.ID for d in response.devices] == GPUS
    numa = {d.ID: [n.ID for n in d.topology.nodes] for d in response.devices}
    assert numa == {f"gpu-{i}": [0 if i < 4 else 1] for i in range(8)}


def test_a_fault_turns_a_device_unhealthy_and_clearing_it_heals_it() -> None:
    with running_node() as node, node.kubelet.dial() as stub:
        responses = stub.ListAndWatch(pb.Empty(), timeout=DEADLINE)
        try:
            assert all_healthy(next(responses))
            node.inject_fault({"gpu-3": "fell off the bus"})
            # One stream: the plugin re-sends the complete list on each change.
            assert only_unhealthy("gpu-3")(next(responses))
            node.inject_fault({})
            assert all_healthy(next(responses))
        finally:
            responses.cancel()
        registry = node.plugin.metrics.registry
        assert registry.get_sample_value("drasil_devices", {"health": "Unhealthy"}) == 0
        assert registry.get_sample_value("drasil_devices", {"health": "Healthy"}) == 8


def test_a_fault_injected_before_start_shows_in_the_first_list() -> None:
    with running_node(kubelet_first=False) as node:
        node.inject_fault({"gpu-6": "broken"})
        node.kubelet.start()
        with node.kubelet.dial() as stub:
            stream_until(stub, only_unhealthy("gpu-6"), what="gpu-6 unhealthy")


# ---- Allocate -------------------------------------------------------------------------------


def test_allocate_two_gpus_returns_their_uuids_and_cdi_devices() -> None:
    with running_node() as node, node.kubelet.dial() as stub:
        response = allocate(stub, "gpu-1", "gpu-6")
        spec = device_spec_path(node.opts.cdi_root, driver="gpu.drasil.dev")
        assert spec.is_file()
        # The runtime applies CDI edits after Allocate's env: no spec-wide "void" may
        # hide the GPUs Allocate names, by variable or by the legacy hook's mount.
        assert "NVIDIA_VISIBLE_DEVICES" not in spec.read_text()
        assert "nvidia-container-devices" not in spec.read_text()
    uuids = response.envs["NVIDIA_VISIBLE_DEVICES"].split(",")
    assert uuids == [UUIDS["gpu-1"], UUIDS["gpu-6"]]
    assert len(set(uuids)) == 2
    assert response.envs["DRASIL_VISIBLE_DEVICES"] == response.envs["NVIDIA_VISIBLE_DEVICES"]
    assert response.envs["DRASIL_DEVICE_GPU_6"] == UUIDS["gpu-6"]
    assert [c.name for c in response.cdi_devices] == [
        "k8s.gpu.drasil.dev/device=gpu-1",
        "k8s.gpu.drasil.dev/device=gpu-6",
    ]
    assert list(response.devices) == []  # simulated GPUs have no device nodes


def test_allocate_of_unknown_ids_fails_naming_them() -> None:
    with running_node() as node, node.kubelet.dial() as stub:
        with pytest.raises(grpc.RpcError) as err:
            allocate(stub, "gpu-1", "gpu-9", "bogus")
        assert sample(node, "allocations", result="error") == 1
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert "unknown device IDs for resource drasil.dev/gpu: gpu-9, bogus" in details
    assert "gpu-1," not in details.split("(")[0]


def test_pre_start_container_is_a_no_op() -> None:
    with running_node() as node, node.kubelet.dial() as stub:
        reply = stub.PreStartContainer(
            pb.PreStartContainerRequest(devices_ids=["gpu-0"]), timeout=DEADLINE
        )
    assert reply == pb.PreStartContainerResponse()


# ---- GetPreferredAllocation ----------------------------------------------------------------


def test_preferred_allocation_honours_must_include_then_numa_then_pcie_root() -> None:
    with running_node() as node, node.kubelet.dial() as stub:
        # gpu-5 is on NUMA node 1 and shares its root with gpu-4.
        assert preferred_ids(stub, available=GPUS, must_include=["gpu-5"], size=2) == [
            "gpu-5",
            "gpu-4",
        ]
        # A fresh request of four fills one NUMA node.
        assert preferred_ids(stub, available=GPUS, size=4) == GPUS[:4]
        # Node 0 has one GPU left, node 1 four: a pair comes from node 1, on one root.
        left = ["gpu-0", "gpu-4", "gpu-5", "gpu-6", "gpu-7"]
        assert preferred_ids(stub, available=left, size=2) == ["gpu-4", "gpu-5"]
        # ... and a single GPU from the small node, keeping node 1 whole.
        assert preferred_ids(stub, available=left, size=1) == ["gpu-0"]
        # Same NUMA node everywhere: the pair that shares a root wins over lower numbers.
        assert preferred_ids(stub, available=["gpu-0", "gpu-2", "gpu-3"], size=2) == [
            "gpu-2",
            "gpu-3",
        ]
        with pytest.raises(grpc.RpcError) as err:
            preferred_ids(stub, available=["gpu-0", "gpu-12"], size=1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "gpu-12" in (err.value.details() or "")


# ---- sharing ----------------------------------------------------------------------------------


def test_time_slicing_advertises_replicas_mapped_back_to_their_gpu() -> None:
    with running_node("--time-slicing-replicas=3") as node, node.kubelet.dial() as stub:
        response = stream_until(stub, all_healthy, what="a device list")
        ids = [d.ID for d in response.devices]
        assert ids == [f"gpu-{g}::{n}" for g in range(8) for n in range(3)]
        assert {d.ID: d.topology.nodes[0].ID for d in response.devices}["gpu-5::2"] == 1

        same_gpu = allocate(stub, "gpu-2::0", "gpu-2::1")
        assert same_gpu.envs["NVIDIA_VISIBLE_DEVICES"] == UUIDS["gpu-2"]
        assert [c.name for c in same_gpu.cdi_devices] == ["k8s.gpu.drasil.dev/device=gpu-2"]
        two = allocate(stub, "gpu-2::1", "gpu-5::0")
        assert two.envs["NVIDIA_VISIBLE_DEVICES"] == f"{UUIDS['gpu-2']},{UUIDS['gpu-5']}"

        # Replicas of distinct GPUs first, and the least-used GPU (most free IDs) first.
        assert preferred_ids(stub, available=ids, size=2) == ["gpu-0::0", "gpu-1::0"]
        busy_gpu0 = [i for i in ids if i not in ("gpu-0::0", "gpu-0::1")]
        assert preferred_ids(stub, available=busy_gpu0, size=1) == ["gpu-1::0"]

        node.inject_fault({"gpu-2": "XID 79"})
        stream_until(
            stub, only_unhealthy("gpu-2::0", "gpu-2::1", "gpu-2::2"), what="gpu-2 unhealthy"
        )


def test_mixed_mig_serves_one_resource_per_profile() -> None:
    flags = ("--mig-strategy=mixed",)
    with running_node(*flags, profile="a100-40gb-mig:2") as node:
        expected = {
            "drasil.dev/gpu": ("drasil-gpu.sock", 0),
            "drasil.dev/mig-1g.5gb": ("drasil-mig-1g.5gb.sock", 4),
            "drasil.dev/mig-2g.10gb": ("drasil-mig-2g.10gb.sock", 2),
            "drasil.dev/mig-3g.20gb": ("drasil-mig-3g.20gb.sock", 2),
        }
        for resource, (endpoint, count) in expected.items():
            assert node.kubelet.wait_for_registrations(1, resource).endpoint == endpoint
            with node.kubelet.dial(resource) as stub:
                response = stream_until(stub, lambda r: True, what=f"{resource} devices")
                assert len(response.devices) == count
        assert sorted(r.resource_name for r in node.kubelet.requests) == sorted(expected)
        with node.kubelet.dial("drasil.dev/mig-1g.5gb") as stub:
            ids = [d.ID for d in stream_until(stub, all_healthy, what="MIG devices").devices]
            assert all("-mig-1g5gb-" in i for i in ids)
            allocated = allocate(stub, ids[0], ids[3])
    uuids = allocated.envs["NVIDIA_VISIBLE_DEVICES"].split(",")
    assert len(set(uuids)) == 2
    assert all(u.startswith("MIG-") for u in uuids)
    assert [c.name for c in allocated.cdi_devices] == [
        f"k8s.gpu.drasil.dev/device={ids[0]}",
        f"k8s.gpu.drasil.dev/device={ids[3]}",
    ]


def test_single_mig_strategy_with_several_profiles_fails_at_start() -> None:
    with short_root() as root:
        opts = node_options(root, "--mig-strategy=single", profile="a100-40gb-mig:2")
        plugin = DevicePluginServer(opts, vendors=open_vendors(opts)[1])
        with pytest.raises(DevicePluginConfigError, match=r"found 1g\.5gb, 2g\.10gb, 3g\.20gb"):
            plugin.start()
        assert not list(opts.device_plugins_dir.glob("*.sock"))


# ---- kubelet restarts ---------------------------------------------------------------------


def test_a_deleted_socket_is_served_again_and_registered_keeping_health() -> None:
    with running_node() as node:
        node.kubelet.wait_for_registrations(1)
        node.inject_fault({"gpu-3": "XID 48"})
        with node.kubelet.dial() as stub:
            stream_until(stub, only_unhealthy("gpu-3"), what="gpu-3 unhealthy")
        # What kubelet does to every socket in device-plugins/ when it restarts.
        (node.opts.device_plugins_dir / "drasil-gpu.sock").unlink()
        request = node.kubelet.wait_for_registrations(2)
        assert request.endpoint == "drasil-gpu.sock"
        with node.kubelet.dial() as stub:
            stream_until(stub, only_unhealthy("gpu-3"), what="gpu-3 still unhealthy")


def test_a_kubelet_restart_is_followed_by_a_new_registration() -> None:
    with running_node() as node:
        node.kubelet.wait_for_registrations(1)
        node.kubelet.stop()
        for socket in node.opts.device_plugins_dir.glob("*.sock"):
            socket.unlink()
        node.kubelet.start()
        assert node.kubelet.wait_for_registrations(2).endpoint == "drasil-gpu.sock"
        with node.kubelet.dial() as stub:
            assert allocate(stub, "gpu-0").envs["DRASIL_VISIBLE_DEVICES"] == UUIDS["gpu-0"]


def test_stop_removes_the_sockets() -> None:
    with running_node("--mig-strategy=mixed", profile="a100-40gb-mig:1") as node:
        sockets = node.plugin.sockets
        assert len(sockets) == 4
        assert all(s.is_socket() for s in sockets)
        node.plugin.stop()
        assert not any(s.exists() for s in sockets)

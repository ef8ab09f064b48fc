"""GetPreferredAllocation's choice and Allocate's answer, as pure functions.

Topology of the simulated ``h100-80gb:8``: gpu-0..3 on NUMA node 0, gpu-4..7 on node 1;
PCIe roots pair them: (0, 1), (2, 3), (4, 5), (6, 7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from kubelet_client import node_devices

from drasil.driver.devices import Device
from drasil.kubeletplugin.deviceplugin.allocation import (
    UnknownDeviceIds,
    container_response,
    preferred,
    resolve,
)
from drasil.kubeletplugin.deviceplugin.resources import Resource, plan_resources

DRIVER = "gpu.drasil.dev"


def resource(profile: str = "h100-80gb:8", *, replicas: int = 1) -> Resource:
    (only,) = plan_resources(
        list(node_devices(profile).values()),
        resource_name="drasil.dev/gpu",
        mig_strategy="none",
        replicas=replicas,
    )
    return only


H100 = resource()
ALL = [u.id for u in H100.units]


def pick(
    available: Sequence[str],
    *,
    size: int,
    must: Sequence[str] = (),
    res: Resource = H100,
) -> list[str]:
    chosen = preferred(resolve(res, available), must_include=resolve(res, must), size=size)
    return [u.id for u in chosen]


# ---- GetPreferredAllocation ---------------------------------------------------------------


def test_must_include_comes_first_even_across_numa_nodes() -> None:
    assert pick(ALL, must=["gpu-7", "gpu-0"], size=3) == ["gpu-7", "gpu-0", "gpu-1"]


def test_must_include_pulls_the_rest_to_its_numa_node_and_root() -> None:
    assert pick(ALL, must=["gpu-5"], size=2) == ["gpu-5", "gpu-4"]
    assert pick(ALL, must=["gpu-6"], size=4) == ["gpu-6", "gpu-7", "gpu-4", "gpu-5"]


def test_a_fresh_request_takes_the_smallest_numa_node_that_holds_it() -> None:
    available = ["gpu-1", "gpu-2", "gpu-4", "gpu-5", "gpu-6", "gpu-7"]
    # Node 0 has exactly two left: they go, and node 1 stays whole for a bigger request.
    assert pick(available, size=2) == ["gpu-1", "gpu-2"]
    assert pick(available, size=3) == ["gpu-4", "gpu-5", "gpu-6"]


def test_a_request_larger_than_any_numa_node_starts_with_the_biggest() -> None:
    available = ["gpu-0", "gpu-4", "gpu-5", "gpu-6", "gpu-7"]
    assert pick(available, size=5) == ["gpu-4", "gpu-5", "gpu-6", "gpu-7", "gpu-0"]


def test_within_a_numa_node_a_shared_root_wins_over_low_numbers() -> None:
    assert pick(["gpu-0", "gpu-2", "gpu-3"], size=2) == ["gpu-2", "gpu-3"]


def test_unknown_topology_still_gives_a_deterministic_answer() -> None:
    bare = [replace(d, numa_node=None, pcie_root=None) for d in node_devices("l4:4").values()]
    (res,) = plan_resources(bare, resource_name="drasil.dev/gpu", mig_strategy="none", replicas=1)
    available = ["gpu-3", "gpu-1", "gpu-2"]
    assert pick(available, size=2, res=res) == ["gpu-1", "gpu-2"]


def test_never_more_than_available_and_same_answer_every_time() -> None:
    assert pick(["gpu-3", "gpu-1"], size=4) == ["gpu-1", "gpu-3"]
    answers = {tuple(pick(list(reversed(ALL)), size=3)) for _ in range(5)}
    assert answers == {("gpu-0", "gpu-1", "gpu-2")}


def test_replicas_of_distinct_gpus_come_before_a_second_replica() -> None:
    shared = resource(replicas=4)
    every = [u.id for u in shared.units]
    assert pick(every, size=3, res=shared) == ["gpu-0::0", "gpu-1::0", "gpu-2::0"]
    assert pick(every, must=["gpu-4::2"], size=2, res=shared) == ["gpu-4::2", "gpu-5::0"]
    # Only one GPU has free replicas left: then they come from it.
    assert pick(["gpu-3::1", "gpu-3::2"], size=2, res=shared) == ["gpu-3::1", "gpu-3::2"]


def test_replicas_prefer_the_least_used_gpu() -> None:
    shared = resource(replicas=4)
    # gpu-0 has one free replica, gpu-1 all four: gpu-1 is the less busy GPU.
    available = ["gpu-0::3", "gpu-1::0", "gpu-1::1", "gpu-1::2", "gpu-1::3"]
    assert pick(available, size=1, res=shared) == ["gpu-1::0"]


# ---- Allocate ---------------------------------------------------------------------------------


def test_unknown_ids_are_named() -> None:
    with pytest.raises(UnknownDeviceIds) as err:
        resolve(H100, ["gpu-0", "gpu-8", "GPU-0"])
    assert err.value.ids == ("gpu-8", "GPU-0")
    message = str(err.value)
    assert message.startswith("unknown device IDs for resource drasil.dev/gpu: gpu-8, GPU-0 ")
    assert "(advertised: gpu-0, gpu-1, gpu-2, gpu-3, gpu-4, gpu-5, gpu-6, gpu-7)" in message


def test_the_hint_lists_a_few_advertised_ids_only() -> None:
    with pytest.raises(UnknownDeviceIds, match=r"gpu-1::3 and 24 more\)$"):
        resolve(resource(replicas=4), ["x"])


def test_replicas_of_one_gpu_are_one_device_in_the_container() -> None:
    shared = resource(replicas=2)
    response = container_response(resolve(shared, ["gpu-1::1", "gpu-1::0"]), driver=DRIVER)
    uuid = shared.by_id["gpu-1::0"].device.uuid
    assert dict(response.envs) == {
        "NVIDIA_VISIBLE_DEVICES": uuid,
        "DRASIL_VISIBLE_DEVICES": uuid,
        "DRASIL_DEVICE_GPU_1": uuid,
    }
    assert [c.name for c in response.cdi_devices] == ["k8s.gpu.drasil.dev/device=gpu-1"]


def test_device_nodes_are_passed_once_with_rw_access() -> None:
    migs: list[Device] = [
        replace(d, device_nodes=("/dev/nvidia0",)) for d in node_devices("a100-40gb-mig:1").values()
    ]
    mixed = plan_resources(migs, resource_name="drasil.dev/gpu", mig_strategy="mixed", replicas=1)
    small = next(r for r in mixed if r.name == "drasil.dev/mig-1g.5gb")
    response = container_response(list(small.units), driver=DRIVER)
    assert [(d.container_path, d.host_path, d.permissions) for d in response.devices] == [
        ("/dev/nvidia0", "/dev/nvidia0", "rw")
    ]
    uuids = response.envs["NVIDIA_VISIBLE_DEVICES"].split(",")
    assert uuids == [u.device.uuid for u in small.units]
    assert len(response.cdi_devices) == 2

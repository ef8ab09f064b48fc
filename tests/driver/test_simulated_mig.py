"""The fake NVML's MIG management: NVML's rules and errors, and its state file."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.nvidia.nvml import (
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    ComputeInstance,
    DeviceHandle,
    GpuInstance,
    NvmlInsufficientResources,
    NvmlInUse,
    NvmlNotFound,
    NvmlNotSupported,
    NvmlQueryError,
    Placement,
)
from drasil.driver.simulated.gpus import mig_uuid, simulated_gpus
from drasil.driver.simulated.nvml import FakeNvml, simulated_library

P3G, P2G, P1G, P1G_ME, P1G_DOUBLE, P4G, P7G = 9, 14, 19, 20, 15, 5, 0


def h100(
    *, state_file: Path | None = None, boot: str = "boot-1", spec: str = "h100-80gb:2"
) -> FakeNvml:
    gpus = simulated_gpus(spec, node_name="n")
    return FakeNvml(gpus, state_file=state_file, boot_id=lambda: boot)


def enabled(lib: FakeNvml, index: int = 0) -> DeviceHandle:
    gpu = lib.device_handle_by_index(index)
    lib.device_set_mig_mode(gpu, True)
    return gpu


def test_profiles_and_placements_answer_with_mig_off() -> None:
    lib = h100()
    gpu = lib.device_handle_by_index(0)
    assert not lib.device_mig_mode(gpu).current
    profiles = lib.gpu_instance_profiles(gpu)
    assert [p.profile_id for p in profiles] == [19, 20, 15, 14, 9, 5, 0]
    assert profiles[4].name == "3g.40gb"
    assert lib.gpu_instance_placements(gpu, P3G) == (Placement(0, 4), Placement(4, 4))
    with pytest.raises(NvmlQueryError) as err:
        lib.gpu_instance_placements(gpu, 42)
    assert err.value.code == NVML_ERROR_INVALID_ARGUMENT


def test_gpus_without_mig_answer_not_supported() -> None:
    lib = simulated_library("l4:1", node_name="n")
    lib.init()
    gpu = lib.device_handle_by_index(0)
    for call in (
        lambda: lib.gpu_instance_profiles(gpu),
        lambda: lib.device_set_mig_mode(gpu, True),
        lambda: lib.create_gpu_instance(gpu, P1G, Placement(0, 1)),
    ):
        with pytest.raises(NvmlNotSupported):
            call()


def test_instances_need_mig_mode() -> None:
    lib = h100()
    gpu = lib.device_handle_by_index(0)
    with pytest.raises(NvmlNotSupported) as err:
        lib.create_gpu_instance(gpu, P3G, Placement(0, 4))
    assert err.value.code == NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(NvmlNotSupported):
        lib.gpu_instances(gpu)
    assert lib.device_set_mig_mode(gpu, True).current
    assert lib.gpu_instances(gpu) == ()


def test_create_destroy_cycle_and_enumeration() -> None:
    lib = h100()
    gpu = enabled(lib)
    gi = lib.create_gpu_instance(gpu, P3G, Placement(4, 4))
    assert gi == GpuInstance(gpu_instance_id=2, profile_id=P3G, placement=Placement(4, 4))
    # A GPU instance without a compute instance is not a MIG device yet.
    with pytest.raises(NvmlNotFound):
        lib.device_mig_device_handle_by_index(gpu, 0)
    assert lib.create_compute_instance(gpu, 2) == ComputeInstance(0, profile_id=2)
    assert lib.compute_instances(gpu, 2) == (ComputeInstance(0, 2),)
    mig = lib.device_mig_device_handle_by_index(gpu, 0)
    assert lib.device_uuid(mig) == mig_uuid("n", 0, 2, 0)
    assert lib.device_gpu_instance_id(mig) == 2
    assert lib.device_compute_instance_id(mig) == 0
    assert lib.device_attributes(mig).multiprocessor_count == 60
    assert lib.device_memory_total(mig) == 40448 * 2**20

    with pytest.raises(NvmlInUse):
        lib.destroy_gpu_instance(gpu, 2)
    with pytest.raises(NvmlInUse):
        lib.device_set_mig_mode(gpu, False)
    lib.destroy_compute_instance(gpu, 2, 0)
    with pytest.raises(NvmlNotFound):
        lib.device_uuid(mig)  # the handle outlived its MIG device
    lib.destroy_gpu_instance(gpu, 2)
    assert lib.gpu_instances(gpu) == ()
    assert not lib.device_set_mig_mode(gpu, False).current


def test_missing_instances_are_not_found() -> None:
    lib = h100()
    gpu = enabled(lib)
    for call in (
        lambda: lib.destroy_gpu_instance(gpu, 1),
        lambda: lib.compute_instances(gpu, 1),
        lambda: lib.create_compute_instance(gpu, 1),
        lambda: lib.destroy_compute_instance(gpu, 1, 0),
    ):
        with pytest.raises(NvmlNotFound):
            call()
    lib.create_gpu_instance(gpu, P1G, Placement(0, 1))
    with pytest.raises(NvmlNotFound):
        lib.destroy_compute_instance(gpu, 7, 0)


def test_one_compute_instance_per_gpu_instance() -> None:
    lib = h100()
    gpu = enabled(lib)
    lib.create_gpu_instance(gpu, P2G, Placement(2, 2))
    lib.create_compute_instance(gpu, 4)
    with pytest.raises(NvmlInsufficientResources):
        lib.create_compute_instance(gpu, 4)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ((P3G, 0, 4), (P1G, 3, 1)),
        ((P7G, 0, 8), (P1G, 6, 1)),
        ((P1G_DOUBLE, 6, 2), (P3G, 4, 4)),
        ((P2G, 2, 2), (P1G_ME, 3, 1)),
        ((P4G, 0, 4), (P3G, 0, 4)),
    ],
)
def test_overlapping_placements_are_insufficient_resources(
    first: tuple[int, int, int], second: tuple[int, int, int]
) -> None:
    lib = h100()
    gpu = enabled(lib)
    lib.create_gpu_instance(gpu, first[0], Placement(first[1], first[2]))
    with pytest.raises(NvmlInsufficientResources, match="overlap"):
        lib.create_gpu_instance(gpu, second[0], Placement(second[1], second[2]))


def test_instance_limits() -> None:
    lib = h100()
    gpu = enabled(lib)
    lib.create_gpu_instance(gpu, P1G_ME, Placement(0, 1))
    with pytest.raises(NvmlInsufficientResources, match=re.escape("all 1 1g.10gb+me")):
        lib.create_gpu_instance(gpu, P1G_ME, Placement(1, 1))
    for start in range(1, 7):
        lib.create_gpu_instance(gpu, P1G, Placement(start, 1))
    assert [gi.gpu_instance_id for gi in lib.gpu_instances(gpu)] == list(range(7, 14))


def test_a_placement_the_profile_does_not_have_is_invalid() -> None:
    lib = h100()
    gpu = enabled(lib)
    for profile, start, size in [(P3G, 2, 4), (P1G, 7, 1), (P2G, 6, 2), (P1G, 0, 2)]:
        with pytest.raises(NvmlQueryError) as err:
            lib.create_gpu_instance(gpu, profile, Placement(start, size))
        assert err.value.code == NVML_ERROR_INVALID_ARGUMENT
        assert not isinstance(err.value, NvmlInsufficientResources)
    with pytest.raises(NvmlQueryError) as err:
        lib.create_gpu_instance(gpu, 42, Placement(0, 1))
    assert err.value.code == NVML_ERROR_INVALID_ARGUMENT


def test_static_layouts_are_instances_that_can_be_destroyed() -> None:
    lib = simulated_library("a100-40gb-mig:1", node_name="n")
    lib.init()
    gpu = lib.device_handle_by_index(0)
    assert [gi.gpu_instance_id for gi in lib.gpu_instances(gpu)] == [2, 3, 9, 10]
    lib.destroy_compute_instance(gpu, 9, 0)
    lib.destroy_gpu_instance(gpu, 9)
    names = [d.name for d in discover(lib, node_name="n").devices]
    assert names == ["gpu-0-mig-3g20gb-2-0", "gpu-0-mig-2g10gb-3-0", "gpu-0-mig-1g5gb-10-0"]
    # The freed slice takes a 1g.5gb+me now.
    assert lib.create_gpu_instance(gpu, P1G_ME, Placement(2, 1)).gpu_instance_id == 9


def test_discovery_sees_created_instances() -> None:
    lib = h100()
    gpu = enabled(lib)
    lib.create_gpu_instance(gpu, P1G_DOUBLE, Placement(6, 2))
    lib.create_compute_instance(gpu, 6)
    result = discover(lib, node_name="n")
    assert [d.name for d in result.devices] == ["gpu-0-mig-1g20gb-6-0", "gpu-1"]
    assert result.devices[0].uuid == mig_uuid("n", 0, 6, 0)


def test_mig_device_nodes_are_none_simulated() -> None:
    assert h100().mig_device_nodes(0, 1, 0) == ()


# ---- fault injection ------------------------------------------------------------------


def test_fail_next_before_and_after() -> None:
    lib = h100()
    gpu = enabled(lib)
    lib.fail_next("create_gpu_instance", NVML_ERROR_TIMEOUT)
    with pytest.raises(NvmlQueryError) as err:
        lib.create_gpu_instance(gpu, P3G, Placement(0, 4))
    assert err.value.code == NVML_ERROR_TIMEOUT
    assert lib.gpu_instances(gpu) == ()  # failed before taking effect

    lib.fail_next("create_gpu_instance", NVML_ERROR_TIMEOUT, after=True)
    with pytest.raises(NvmlQueryError):
        lib.create_gpu_instance(gpu, P3G, Placement(0, 4))
    assert [gi.gpu_instance_id for gi in lib.gpu_instances(gpu)] == [1]  # it did
    lib.create_compute_instance(gpu, 1)  # the next call is fine again

    with pytest.raises(ValueError, match="not one of"):
        lib.fail_next("device_name")
    lib.fail_next("destroy_compute_instance")
    lib.clear_faults()
    lib.destroy_compute_instance(gpu, 1, 0)


# ---- the state file ---------------------------------------------------------------------


def test_a_second_process_sees_the_first_ones_instances(tmp_path: Path) -> None:
    path = tmp_path / "state" / "simulated-gpus.json"
    first = h100(state_file=path)
    gpu = enabled(first)
    first.create_gpu_instance(gpu, P3G, Placement(4, 4))
    first.create_compute_instance(gpu, 2)
    doc = json.loads(path.read_text())
    assert doc["bootId"] == "boot-1"
    (entry,) = [e for e in doc["gpus"].values() if e["gpuInstances"]]
    assert entry == {
        "migEnabled": True,
        "gpuInstances": [{"id": 2, "profileId": 9, "start": 4, "size": 4, "computeInstances": [0]}],
    }

    second = h100(state_file=path)  # the plugin restarted
    gpu2 = second.device_handle_by_index(0)
    assert second.device_mig_mode(gpu2).current
    assert second.gpu_instances(gpu2) == first.gpu_instances(gpu)
    mig = second.device_mig_device_handle_by_index(gpu2, 0)
    assert second.device_uuid(mig) == first.device_uuid(
        first.device_mig_device_handle_by_index(gpu, 0)
    )

    # Both see each other's changes from then on.
    second.destroy_compute_instance(gpu2, 2, 0)
    second.destroy_gpu_instance(gpu2, 2)
    assert first.gpu_instances(gpu) == ()
    second.create_gpu_instance(gpu2, P1G, Placement(0, 1))
    with pytest.raises(NvmlInsufficientResources):
        first.create_gpu_instance(gpu, P7G, Placement(0, 8))


def test_a_reboot_drops_instances_and_keeps_mig_mode(tmp_path: Path) -> None:
    path = tmp_path / "simulated-gpus.json"
    before = h100(state_file=path, boot="boot-1")
    gpu = enabled(before)
    before.create_gpu_instance(gpu, P3G, Placement(0, 4))
    after = h100(state_file=path, boot="boot-2")
    gpu = after.device_handle_by_index(0)
    assert after.device_mig_mode(gpu).current
    assert after.gpu_instances(gpu) == ()
    assert not after.device_mig_mode(after.device_handle_by_index(1)).current
    after.create_gpu_instance(gpu, P1G, Placement(0, 1))
    assert json.loads(path.read_text())["bootId"] == "boot-2"


def test_a_damaged_file_is_logged_and_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "simulated-gpus.json"
    path.write_text('{"version": 1, "bootId": "boot-1", "gpus": {')
    with caplog.at_level(logging.ERROR):
        lib = h100(state_file=path, spec="a100-40gb-mig:1")
        gpu = lib.device_handle_by_index(0)
        assert [gi.gpu_instance_id for gi in lib.gpu_instances(gpu)] == [2, 3, 9, 10]
    assert "damaged" in caplog.text
    lib.destroy_compute_instance(gpu, 2, 0)  # and the next change rewrites it whole
    assert json.loads(path.read_text())["version"] == 1


def test_a_file_naming_impossible_instances_is_damaged(tmp_path: Path) -> None:
    path = tmp_path / "simulated-gpus.json"
    lib = h100(state_file=path)
    gpu = enabled(lib)
    doc = json.loads(path.read_text())
    uuid = lib.device_uuid(gpu)
    doc["gpus"][uuid]["gpuInstances"] = [
        {"id": 1, "profileId": 9, "start": 2, "size": 4, "computeInstances": [0]}
    ]
    path.write_text(json.dumps(doc))
    assert not h100(state_file=path).device_mig_mode(gpu).current


def test_no_state_file_is_written_until_something_changes(tmp_path: Path) -> None:
    path = tmp_path / "missing-dir" / "simulated-gpus.json"
    lib = h100(state_file=path)
    discover(lib, node_name="n")
    assert not path.parent.exists()

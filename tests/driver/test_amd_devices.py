"""AMD discovery against fake sysfs trees of every simulated model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from amdtrees import discover, tree

from drasil.driver.amd.devices import discover_amd
from drasil.driver.amd.sysfs import read_sysfs
from drasil.driver.devices import CharDevice, DeviceType, Version
from drasil.driver.simulated.amdcatalog import GIB
from drasil.driver.simulated.amdsysfs import layout

PCI = "resource.kubernetes.io/pciBusID"


def test_mi300x_spx_is_one_whole_gpu_each(tmp_path: Path) -> None:
    found = discover(tmp_path, ("mi300x", 8))
    assert found.skipped == ()
    assert [d.name for d in found.devices] == [f"amdgpu-{1 + 8 * i}" for i in range(8)]
    gpu = found.devices[0]
    assert gpu.type == DeviceType.AMDGPU
    assert gpu.uuid.startswith("GPU-")
    assert len(gpu.uuid) == 4 + 16
    assert dict(gpu.capacity) == {
        "memory": 192 * GIB,
        "computeUnits": 304,
        "simdUnits": 1216,
    }
    attrs = gpu.attributes
    assert attrs["type"] == "amdgpu"
    assert attrs["vendor"] == "amd"
    assert attrs["productName"] == "AMD Instinct MI300X"
    assert attrs["family"] == "gfx942"
    assert attrs["deviceID"] == "0x74a1"
    assert attrs["computePartition"] == "SPX"
    assert attrs["memoryPartition"] == "NPS1"
    assert attrs["partitionProfile"] == "spx_nps1"
    assert attrs["cardIndex"] == 1
    assert attrs["renderIndex"] == 128
    assert attrs["driverVersion"] == Version("6.10.5")
    assert attrs[PCI] == "0000:03:00.0"
    assert attrs["resource.kubernetes.io/pcieRoot"] == "pci0000:00"
    assert attrs["resource.kubernetes.io/numaNode"] == 0
    assert (gpu.numa_node, gpu.pcie_root, gpu.minor) == (0, "pci0000:00", 1)
    assert gpu.device_nodes == ()
    assert gpu.char_devices == (
        CharDevice("/dev/kfd", "/dev/kfd", 235, 0),
        CharDevice("/dev/dri/card1", "/dev/dri/card1", 226, 1),
        CharDevice("/dev/dri/renderD128", "/dev/dri/renderD128", 226, 128),
    )
    assert [d.numa_node for d in found.devices] == [0] * 4 + [1] * 4
    assert len({d.uuid for d in found.devices}) == 8


def test_mi300x_cpx_publishes_eight_partitions_per_gpu(tmp_path: Path) -> None:
    found = discover(tmp_path, ("mi300x-cpx", 2))
    assert found.skipped == ()
    names = [d.name for d in found.devices]
    assert names[:8] == [f"amdgpu-1-cpx-{i}" for i in range(8)]
    assert names[8:] == [f"amdgpu-9-cpx-{i}" for i in range(8)]
    part = found.devices[3]
    assert part.type == DeviceType.AMDGPU_PARTITION
    assert dict(part.capacity) == {"memory": 24 * GIB, "computeUnits": 38, "simdUnits": 152}
    parent = part.attributes["parentUUID"]
    assert part.parent_uuid == parent
    assert part.uuid == f"{parent}-3"  # amdgpu gives partitions the GPU's unique id
    assert part.attributes["partitionIndex"] == 3
    assert part.attributes["partitionProfile"] == "cpx_nps4"
    assert part.attributes["type"] == "amdgpu-partition"
    assert part.attributes[PCI] == "0000:03:00.0"
    # Partition 0 has the GPU's own nodes; the others an amdgpu_xcp device's.
    assert found.devices[0].attributes["cardIndex"] == 1
    assert part.attributes["cardIndex"] == 4
    assert part.attributes["renderIndex"] == 131
    assert part.char_devices[1:] == (
        CharDevice("/dev/dri/card4", "/dev/dri/card4", 226, 4),
        CharDevice("/dev/dri/renderD131", "/dev/dri/renderD131", 226, 131),
    )
    assert sum(d.capacity["computeUnits"] for d in found.devices[:8]) == 304


def test_mi325x(tmp_path: Path) -> None:
    (gpu,) = discover(tmp_path, ("mi325x", 1)).devices
    assert gpu.attributes["productName"] == "AMD Instinct MI325X"
    assert gpu.attributes["deviceID"] == "0x74a5"
    assert gpu.attributes["family"] == "gfx942"
    assert gpu.capacity["memory"] == 256 * GIB
    assert gpu.capacity["computeUnits"] == 304


def test_mi250x_card_is_two_gpus_without_partition_attributes(tmp_path: Path) -> None:
    found = discover(tmp_path, ("mi250x", 2))
    assert [d.name for d in found.devices] == ["amdgpu-1", "amdgpu-2", "amdgpu-3", "amdgpu-4"]
    gcd = found.devices[1]
    assert gcd.attributes["family"] == "gfx90a"
    assert gcd.attributes["deviceID"] == "0x740c"
    assert dict(gcd.capacity) == {"memory": 64 * GIB, "computeUnits": 110, "simdUnits": 440}
    assert "computePartition" not in gcd.attributes
    assert "partitionProfile" not in gcd.attributes
    # The two GCDs of a card share a root complex; the cards do not.
    roots = [d.pcie_root for d in found.devices]
    assert roots[0] == roots[1] != roots[2] == roots[3]


def test_mi210(tmp_path: Path) -> None:
    (gpu,) = discover(tmp_path, ("mi210", 1)).devices
    assert gpu.attributes["deviceID"] == "0x740f"
    assert gpu.attributes["family"] == "gfx90a"
    assert dict(gpu.capacity) == {"memory": 64 * GIB, "computeUnits": 104, "simdUnits": 416}


def test_mixed_profile_numbers_follow_the_xcp_devices(tmp_path: Path) -> None:
    found = discover(tmp_path, ("mi300x", 1), ("mi210", 1))
    assert [d.name for d in found.devices] == ["amdgpu-1", "amdgpu-9"]
    assert found.devices[1].attributes["renderIndex"] == 136


def test_missing_kfd_node_skips_that_gpu_only(tmp_path: Path) -> None:
    root = tree(tmp_path, ("mi300x", 3))
    victim = layout([("mi300x", 3)], "node-a")[1]
    nodes = root / "class/kfd/kfd/topology/nodes"
    for node in nodes.iterdir():
        if f"drm_render_minor {victim.render}\n" in (node / "properties").read_text():
            shutil.rmtree(node)
    found = discover_amd(root)
    assert [d.name for d in found.devices] == ["amdgpu-1", "amdgpu-17"]
    (skipped,) = found.skipped
    assert skipped.bdf == victim.bdf
    assert "no KFD topology node" in skipped.reason
    assert str(nodes) in skipped.reason


def test_malformed_file_names_gpu_and_file(tmp_path: Path) -> None:
    root = tree(tmp_path, ("mi210", 2))
    bdf = layout([("mi210", 2)], "node-a")[0].bdf
    numa = root / "bus/pci/drivers/amdgpu" / bdf / "numa_node"
    numa.write_text("lots\n")
    found = discover_amd(root)
    assert [d.name for d in found.devices] == ["amdgpu-2"]
    (skipped,) = found.skipped
    assert skipped.bdf == bdf
    assert "numa_node" in skipped.reason
    assert "'lots'" in skipped.reason


def test_missing_card_dev_file(tmp_path: Path) -> None:
    root = tree(tmp_path, ("mi210", 1))
    gpu = layout([("mi210", 1)], "node-a")[0]
    (root / gpu.pci_path / "drm/card1/dev").unlink()
    found = discover_amd(root)
    assert found.devices == ()
    assert "card1/dev is missing" in found.skipped[0].reason


def test_no_kfd_skips_every_gpu(tmp_path: Path) -> None:
    root = tree(tmp_path, ("mi210", 2))
    (root / "class/kfd/kfd/dev").unlink()
    found = discover_amd(root)
    assert found.devices == ()
    assert len(found.skipped) == 2
    assert "KFD" in found.skipped[0].reason


def test_in_tree_driver_has_no_version(tmp_path: Path) -> None:
    root = tree(tmp_path, ("mi210", 1))
    (root / "module/amdgpu/version").unlink()
    (gpu,) = discover_amd(root).devices
    assert "driverVersion" not in gpu.attributes


@pytest.mark.parametrize("version", ["6.8.5-2041575.22.04", "1.2", ""])
def test_non_semver_driver_version_is_left_out(tmp_path: Path, version: str) -> None:
    root = tree(tmp_path, ("mi210", 1))
    (root / "module/amdgpu/version").write_text(version + "\n")
    (gpu,) = discover_amd(root).devices
    assert "driverVersion" not in gpu.attributes


def test_partition_with_own_unique_id_uses_it(tmp_path: Path) -> None:
    root = tree(tmp_path, ("mi300x-cpx", 1))
    gpu = layout([("mi300x-cpx", 1)], "node-a")[0]
    nodes = root / "class/kfd/kfd/topology/nodes"
    for node in nodes.iterdir():
        props = node / "properties"
        text = props.read_text()
        if f"drm_render_minor {gpu.xcps[1].render}\n" in text:
            own = text.replace(f"unique_id {gpu.unique_id}", "unique_id 4660")
            props.write_text(own)
    devices = discover_amd(root).devices
    assert devices[2].uuid == "GPU-0000000000001234"
    assert devices[1].uuid.endswith("-1")


def test_read_sysfs_records(tmp_path: Path) -> None:
    snapshot = read_sysfs(tree(tmp_path, ("mi300x", 1)))
    (gpu,) = snapshot.gpus
    assert gpu.available_compute_partitions == ("SPX", "DPX", "QPX", "CPX")
    assert gpu.available_memory_partitions == ("NPS1", "NPS4")
    assert gpu.vendor_id == 0x1002
    assert gpu.partitions[0].kfd.num_xcc == 8
    assert snapshot.driver_version == "6.10.5"


def test_empty_tree_has_nothing(tmp_path: Path) -> None:
    found = discover_amd(tmp_path)
    assert (found.devices, found.skipped) == ((), ())

"""The fake AMD sysfs tree: profiles, determinism, idempotence, mode changes."""

from __future__ import annotations

from pathlib import Path

import pytest
from amdtrees import tree

from drasil.driver.amd.devices import discover_amd
from drasil.driver.simulated.amdsysfs import (
    bump_ras_errors,
    is_amd_model,
    layout,
    parse_amd_profile,
    record_reset,
    set_partition_mode,
    write_simulated_tree,
)


def test_profiles() -> None:
    assert is_amd_model("mi300x")
    assert not is_amd_model("h100")
    assert parse_amd_profile("mi300x:8,mi250x:2") == (("mi300x", 8), ("mi250x", 2))
    with pytest.raises(ValueError, match="no AMD model"):
        parse_amd_profile("a100:1")
    with pytest.raises(ValueError, match="positive number"):
        parse_amd_profile("mi210:0")
    with pytest.raises(ValueError, match="more than 64"):
        layout([("mi250x", 33)], "n")


def test_mi250x_count_is_cards() -> None:
    assert len(layout([("mi250x", 2)], "n")) == 4


def test_uuids_are_per_node_and_stable(tmp_path: Path) -> None:
    a = discover_amd(tree(tmp_path / "a", ("mi210", 2), node_name="a")).devices
    again = discover_amd(tree(tmp_path / "a2", ("mi210", 2), node_name="a")).devices
    b = discover_amd(tree(tmp_path / "b", ("mi210", 2), node_name="b")).devices
    assert [d.uuid for d in a] == [d.uuid for d in again]
    assert not {d.uuid for d in a} & {d.uuid for d in b}


def test_rewriting_keeps_a_changed_mode_and_counters(tmp_path: Path) -> None:
    root = tree(tmp_path, ("mi300x", 2))
    bdf = layout([("mi300x", 2)], "node-a")[0].bdf
    set_partition_mode(root, bdf, "cpx", "nps4")
    bump_ras_errors(root, bdf, "umc", uncorrectable=2)
    write_simulated_tree([("mi300x", 2)], root, node_name="node-a")
    names = [d.name for d in discover_amd(root).devices]
    assert names == [f"amdgpu-1-cpx-{i}" for i in range(8)] + ["amdgpu-9"]
    ras = (root / "bus/pci/drivers/amdgpu" / bdf / "ras/umc_err_count").read_text()
    assert ras == "ue: 2\nce: 0\n"


def test_mode_changes_rebuild_kfd_not_xcp(tmp_path: Path) -> None:
    root = tree(tmp_path, ("mi300x", 1))
    bdf = layout([("mi300x", 1)], "node-a")[0].bdf
    xcps = sorted(p.name for p in (root / "devices/platform").iterdir())
    assert len(xcps) == 7
    set_partition_mode(root, bdf, "QPX")
    devices = discover_amd(root).devices
    assert [d.name for d in devices] == [f"amdgpu-1-qpx-{i}" for i in range(4)]
    assert devices[0].capacity["computeUnits"] == 76
    assert devices[0].capacity["memory"] == 48 << 30
    assert devices[0].attributes["partitionProfile"] == "qpx_nps1"
    set_partition_mode(root, bdf, "DPX")
    assert [d.capacity["computeUnits"] for d in discover_amd(root).devices] == [152, 152]
    set_partition_mode(root, bdf, "SPX")
    assert [d.name for d in discover_amd(root).devices] == ["amdgpu-1"]
    assert sorted(p.name for p in (root / "devices/platform").iterdir()) == xcps


def test_mode_changes_are_checked(tmp_path: Path) -> None:
    root = tree(tmp_path, ("mi300x", 1), ("mi210", 1))
    gpus = layout([("mi300x", 1), ("mi210", 1)], "node-a")
    with pytest.raises(ValueError, match="allows NPS1, not NPS4"):
        set_partition_mode(root, gpus[0].bdf, "SPX", "NPS4")
    with pytest.raises(ValueError, match="no compute mode 'TPX'"):
        set_partition_mode(root, gpus[0].bdf, "TPX")
    with pytest.raises(ValueError, match="allowed: none"):
        set_partition_mode(root, gpus[1].bdf, "CPX")
    with pytest.raises(ValueError, match="no simulated GPU"):
        set_partition_mode(root, "0000:ff:00.0", "CPX")


def test_cpx_keeps_nps4_only_where_allowed(tmp_path: Path) -> None:
    root = tree(tmp_path, ("mi300x-cpx", 1))
    bdf = layout([("mi300x-cpx", 1)], "node-a")[0].bdf
    set_partition_mode(root, bdf, "QPX")  # QPX allows NPS4: kept
    assert discover_amd(root).devices[0].attributes["memoryPartition"] == "NPS4"
    set_partition_mode(root, bdf, "SPX")  # SPX does not: NPS1
    assert discover_amd(root).devices[0].attributes["memoryPartition"] == "NPS1"


def test_a_different_profile_unbinds_old_gpus(tmp_path: Path) -> None:
    root = tree(tmp_path, ("mi210", 3))
    write_simulated_tree([("mi210", 1)], root, node_name="node-a")
    assert [d.name for d in discover_amd(root).devices] == ["amdgpu-1"]


def test_bumps(tmp_path: Path) -> None:
    root = tree(tmp_path, ("mi210", 1))
    bdf = layout([("mi210", 1)], "node-a")[0].bdf
    gpu_dir = root / "bus/pci/drivers/amdgpu" / bdf
    bump_ras_errors(root, bdf, "gfx", uncorrectable=0, correctable=5)
    bump_ras_errors(root, bdf, "gfx")
    assert (gpu_dir / "ras/gfx_err_count").read_text() == "ue: 1\nce: 5\n"
    assert (record_reset(root, bdf), record_reset(root, bdf)) == ("devcd1", "devcd2")
    failing = root / "class/devcoredump/devcd2/failing_device"
    assert failing.resolve() == gpu_dir.resolve()
    with pytest.raises(ValueError, match="no GPU"):
        record_reset(root, "0000:ff:00.0")

"""AMD dynamic partitions in the Preparer: the GPU's mode switched at prepare, put back.

Everything runs over a simulated MI300X sysfs tree, the way the plugin runs it: a
second Preparer (or a second process, after a crash) sees the mode the first one set,
as it would on a real GPU. Crash tests kill a child process at each step and check
that repeating the call (or unpreparing instead) leaves the GPU in the mode the
checkpoint says: the claim's while it is prepared, the one from before afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kubelet_client import (
    DRIVER,
    NODE,
    FileClaims,
    claim_json,
    crash_in_child,
    ref_of,
    result,
    spec_file,
)

from drasil.api.checkpoint import ClaimState
from drasil.driver.amd.partitions import current_mode
from drasil.driver.checkpoint import CHECKPOINT_DIR, CheckpointStore
from drasil.driver.devices import Device
from drasil.driver.discovery.backends import discover_node, no_nvidia_gpus
from drasil.driver.simulated.amdsysfs import KFD_BUSY_FILE, write_mode, write_simulated_tree
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.vendors.amd.modes import PartitionModes

BDF = "0000:03:00.0"
WHOLE = "amdgpu-1"
CPX_0 = "amdgpu-1-cpx-0"
CPX_3 = "amdgpu-1-cpx-3"
DPX_1 = "amdgpu-1-dpx-1"

UID_A = "aaaaaaaa-0000-4000-8000-000000000001"
UID_B = "bbbbbbbb-0000-4000-8000-000000000002"
UID_C = "cccccccc-0000-4000-8000-000000000003"


def sysfs(root: Path) -> Path:
    tree = root / "sys"
    if not tree.exists():
        write_simulated_tree([("mi300x", 1)], tree, node_name=NODE)
    return tree


def devices(root: Path) -> dict[str, Device]:
    found = discover_node(
        no_nvidia_gpus(), sysfs(root), node_name=NODE, amd_partition_mode="dynamic"
    )
    return {d.name: d for d in found.devices}


def preparer(root: Path) -> Preparer:
    """A Preparer as the plugin builds one, on ``root``'s state, specs and GPU tree."""
    state, cdi = root / "state", root / "cdi"
    state.mkdir(parents=True, exist_ok=True)
    cdi.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore(state / CHECKPOINT_DIR)
    store.load()
    p = Preparer(
        driver=DRIVER,
        pool=NODE,
        devices=devices(root),
        claims=FileClaims(root / "claims"),
        store=store,
        cdi_root=cdi,
        state_dir=state,
    )
    p.partitions = PartitionModes(
        sysfs(root), store=store, state_lock=p.state_lock, state_dir=state, write=write_mode
    )
    return p


def put_claim(root: Path, uid: str, *device_names: str) -> Any:
    claim = claim_json(
        uid,
        *(result(d, request=f"r{i}") for i, d in enumerate(device_names)),
        name=f"c-{uid[:4]}",
        namespace="ml",
    )
    FileClaims(root / "claims").put(claim)
    return ref_of(claim)


def mode(root: Path) -> str:
    return current_mode(sysfs(root), BDF)


def spec_nodes(root: Path, uid: str) -> list[str]:
    spec = json.loads(spec_file(root, uid).read_text())
    return sorted(
        n["path"] for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes") or []
    )


# ---- what is published ---------------------------------------------------------------


def test_a_gpu_publishes_every_mode_its_memory_mode_allows(tmp_path: Path) -> None:
    found = devices(tmp_path)
    names = sorted(found)
    assert WHOLE in names
    assert sum(n.startswith("amdgpu-1-dpx-") for n in names) == 2
    assert sum(n.startswith("amdgpu-1-qpx-") for n in names) == 4
    assert sum(n.startswith("amdgpu-1-cpx-") for n in names) == 8
    slot = found[CPX_3].compute_partition
    assert slot is not None
    assert (slot.mode, slot.index, slot.start, slot.size) == ("CPX", 3, 3, 1)
    assert found[CPX_3].uuid == ""  # it exists once the GPU is in CPX
    assert found[CPX_3].capacity["computeUnits"] == 38
    assert found[CPX_3].capacity["memory"] == 24 * 2**30
    draws = found[DPX_1].consumes_counters[0]
    assert draws.counter_set == "amdgpu-1-counters"
    assert sorted(draws.counters) == ["xcd-4", "xcd-5", "xcd-6", "xcd-7"]


def test_nps4_leaves_out_the_modes_it_rules_out(tmp_path: Path) -> None:
    tree = tmp_path / "sys"
    write_simulated_tree([("mi300x-cpx", 1)], tree, node_name=NODE)
    found = discover_node(no_nvidia_gpus(), tree, node_name=NODE, amd_partition_mode="dynamic")
    names = {d.name for d in found.devices}
    assert WHOLE not in names  # SPX needs NPS1
    assert not any("-dpx-" in n for n in names)
    assert {n for n in names if "-cpx-" in n} == {f"amdgpu-1-cpx-{i}" for i in range(8)}
    assert {d.attributes["partitionProfile"] for d in found.devices} == {"cpx_nps4", "qpx_nps4"}


def test_gpus_without_partitions_publish_as_in_static_mode(tmp_path: Path) -> None:
    tree = tmp_path / "sys"
    write_simulated_tree([("mi210", 2)], tree, node_name=NODE)
    found = discover_node(no_nvidia_gpus(), tree, node_name=NODE, amd_partition_mode="dynamic")
    static = discover_node(no_nvidia_gpus(), tree, node_name=NODE)
    assert found.devices == static.devices
    assert found.counter_sets == ()


# ---- prepare and unprepare -------------------------------------------------------------


def test_prepare_switches_the_gpu_and_the_last_unprepare_switches_it_back(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    a, b = put_claim(tmp_path, UID_A, CPX_3), put_claim(tmp_path, UID_B, CPX_0)
    assert p.prepare(a).error == ""
    assert mode(tmp_path) == "CPX"
    # Partition 3 has the nodes of the GPU's third spare XCP device (card 4, render 131).
    assert spec_nodes(tmp_path, UID_A) == ["/dev/dri/card4", "/dev/dri/renderD131", "/dev/kfd"]
    gpu = next(iter(p.store.gpus().values()))
    assert (gpu.previous_compute_partition, gpu.compute_partition) == ("SPX", "CPX")
    record = p.store.get(UID_A)
    assert record is not None
    assert record.state == ClaimState.PREPARE_COMPLETED
    assert record.devices[0].partition is not None
    assert record.devices[0].partition.mode == "CPX"
    assert p.prepare(b).error == ""  # the same mode: nothing to switch
    assert spec_nodes(tmp_path, UID_B) == ["/dev/dri/card1", "/dev/dri/renderD128", "/dev/kfd"]
    assert p.unprepare(a) == ""
    assert mode(tmp_path) == "CPX"  # b still holds it
    assert p.unprepare(b) == ""
    assert mode(tmp_path) == "SPX"
    assert p.store.gpus() == {}


def test_another_mode_waits_until_the_gpu_is_free(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    a, c = put_claim(tmp_path, UID_A, CPX_0), put_claim(tmp_path, UID_C, DPX_1)
    assert p.prepare(a).error == ""
    refused = p.prepare(c)
    assert "needs its GPU in DPX mode" in refused.error
    assert "held in CPX mode" in refused.error
    assert "ml/c-aaaa" in refused.error
    assert p.store.get(UID_C) is None  # a refused claim holds nothing
    assert mode(tmp_path) == "CPX"
    assert p.unprepare(a) == ""
    assert p.prepare(c).error == ""  # kubelet's retry
    assert mode(tmp_path) == "DPX"
    assert p.unprepare(c) == ""
    assert mode(tmp_path) == "SPX"


def test_the_whole_gpu_needs_spx_and_every_die(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    a, b = put_claim(tmp_path, UID_A, CPX_0), put_claim(tmp_path, UID_B, WHOLE)
    assert p.prepare(a).error == ""
    assert "shares compute dies (XCDs)" in p.prepare(b).error


def test_one_claim_cannot_hold_a_gpu_in_two_modes(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    ref = put_claim(tmp_path, UID_A, CPX_0, DPX_1)
    error = p.prepare(ref).error
    assert "in two modes" in error
    assert p.store.get(UID_A) is None
    assert mode(tmp_path) == "SPX"


def test_a_busy_gpu_refuses_the_switch_and_the_claim_says_why(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    busy = sysfs(tmp_path) / "bus/pci/drivers/amdgpu" / BDF / KFD_BUSY_FILE
    busy.write_text("")
    ref = put_claim(tmp_path, UID_A, CPX_0)
    error = p.prepare(ref).error
    assert "EBUSY" in error
    assert "/dev/kfd" in error
    assert mode(tmp_path) == "SPX"
    busy.unlink()
    assert p.prepare(ref).error == ""  # kubelet's retry, once the GPU is free
    assert mode(tmp_path) == "CPX"


def test_a_restart_puts_back_a_gpu_no_claim_holds(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    ref = put_claim(tmp_path, UID_A, CPX_0)
    assert p.prepare(ref).error == ""
    with p.state_lock():
        p.store.remove(UID_A)  # as if unprepared by a plugin that died before settling
    restarted = preparer(tmp_path)
    assert restarted.partitions is not None
    assert restarted.partitions.settle() == [f"restored compute partition mode SPX of GPU {BDF}"]
    assert mode(tmp_path) == "SPX"
    assert restarted.store.gpus() == {}


# ---- crashes ---------------------------------------------------------------------------

PREPARE_CRASHES = [
    "prepare-after-started",
    "partition-after-previous",
    "partition-after-switch",
    "prepare-after-cdi",
    "prepare-after-completed",
]
UNPREPARE_CRASHES = ["unprepare-after-cdi", "unprepare-after-removed"]


def crashed(root: Path, operation: str, ref: Any, point: str) -> None:
    crash_in_child("test_amd_dynamic", root, operation, ref, point)


@pytest.mark.parametrize("point", PREPARE_CRASHES)
def test_a_prepare_repeated_after_a_crash_gets_its_partition(tmp_path: Path, point: str) -> None:
    ref = put_claim(tmp_path, UID_A, CPX_3)
    crashed(tmp_path, "prepare", ref, point)
    p = preparer(tmp_path)  # the restarted plugin
    assert p.prepare(ref).error == ""
    assert mode(tmp_path) == "CPX"
    assert spec_nodes(tmp_path, UID_A) == ["/dev/dri/card4", "/dev/dri/renderD131", "/dev/kfd"]
    assert p.unprepare(ref) == ""
    assert mode(tmp_path) == "SPX"
    assert p.store.gpus() == {}


@pytest.mark.parametrize("point", PREPARE_CRASHES)
def test_an_unprepare_after_a_crashed_prepare_puts_the_gpu_back(tmp_path: Path, point: str) -> None:
    ref = put_claim(tmp_path, UID_A, CPX_3)
    crashed(tmp_path, "prepare", ref, point)
    p = preparer(tmp_path)
    assert p.unprepare(ref) == ""
    assert mode(tmp_path) == "SPX"
    assert p.store.gpus() == {}


@pytest.mark.parametrize("point", UNPREPARE_CRASHES)
def test_a_crashed_unprepare_is_settled_by_the_next_call_or_start(
    tmp_path: Path, point: str
) -> None:
    ref = put_claim(tmp_path, UID_A, CPX_3)
    assert preparer(tmp_path).prepare(ref).error == ""
    crashed(tmp_path, "unprepare", ref, point)
    p = preparer(tmp_path)
    assert p.unprepare(ref) == ""  # kubelet repeats the call
    assert p.partitions is not None
    p.partitions.settle()  # and the start of the next plugin settles whatever is left
    assert mode(tmp_path) == "SPX"
    assert p.store.gpus() == {}

"""Dynamic MIG in the Preparer: instances cut at prepare, destroyed at unprepare.

Everything runs over the simulated NVML with its state in a file, the way the plugin
runs it: a second Preparer (or a second process, after a crash) sees the instances
the first one created, as it would on a real GPU. Crash tests kill a child process at
each step and check that repeating the call (or unpreparing instead) leaves exactly
the instances the checkpoint holds: no orphan, none missing, no placement twice.
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

from drasil.api.checkpoint import ClaimState, MigState
from drasil.driver.checkpoint import CHECKPOINT_DIR, CheckpointStore
from drasil.driver.devices import Device
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.nvidia.nvml import NvmlLibrary, Placement
from drasil.driver.simulated.nvml import simulated_library
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.vendors.nvidia.migs import MigInstances

PROFILE = "h100-80gb:1"
HALF_0 = "gpu-0-mig-3g40gb-at-0"
HALF_4 = "gpu-0-mig-3g40gb-at-4"
SMALL_2 = "gpu-0-mig-1g10gb-at-2"
WHOLE = "gpu-0"

UID_A = "aaaaaaaa-0000-4000-8000-000000000001"
UID_B = "bbbbbbbb-0000-4000-8000-000000000002"


def library(root: Path) -> NvmlLibrary:
    return simulated_library(PROFILE, node_name=NODE, state_file=root / "gpus.json")


def devices(root: Path) -> dict[str, Device]:
    found = discover(library(root), node_name=NODE, mig_mode="dynamic")
    return {d.name: d for d in found.devices}


def preparer(root: Path) -> Preparer:
    """A Preparer as the plugin builds one, on ``root``'s state, specs and GPUs."""
    state, cdi = root / "state", root / "cdi"
    state.mkdir(parents=True, exist_ok=True)
    cdi.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore(state / CHECKPOINT_DIR)
    store.load()
    lib = library(root)
    return Preparer(
        driver=DRIVER,
        pool=NODE,
        devices=devices(root),
        claims=FileClaims(root / "claims"),
        store=store,
        cdi_root=cdi,
        state_dir=state,
        migs=MigInstances(lib, state_dir=state),
    )


def put_claim(root: Path, uid: str, *device_names: str, name: str = "") -> Any:
    claim = claim_json(
        uid,
        *(result(d, request=f"r{i}") for i, d in enumerate(device_names)),
        name=name or f"c-{uid[:4]}",
        namespace="ml",
    )
    FileClaims(root / "claims").put(claim)
    return ref_of(claim)


def gpu_instances(root: Path) -> list[tuple[int, int, int]]:
    """(profile id, start, compute instances) of every GPU instance on the GPU."""
    lib = library(root)
    lib.init()
    handle = lib.device_handle_by_index(0)
    if not lib.device_mig_mode(handle).current:
        return []
    return sorted(
        (g.profile_id, g.placement.start, len(lib.compute_instances(handle, g.gpu_instance_id)))
        for g in lib.gpu_instances(handle)
    )


def spec_uuids(root: Path, uid: str) -> list[str]:
    spec = json.loads(spec_file(root, uid).read_text())
    env = [e for d in spec["devices"] for e in d["containerEdits"].get("env") or []]
    return [e.split("=", 1)[1] for e in env if e.split("=", 1)[1].startswith("MIG-")]


def test_dynamic_devices_carry_their_placement(tmp_path: Path) -> None:
    found = devices(tmp_path)
    placement = found[HALF_4].mig_placement
    assert placement is not None
    assert (placement.profile, placement.start, placement.size) == ("3g.40gb", 4, 4)
    assert found[HALF_4].uuid == ""
    assert found[WHOLE].consumes_counters


def test_prepare_cuts_the_instance_and_unprepare_destroys_it(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    ref = put_claim(tmp_path, UID_A, HALF_4)
    outcome = p.prepare(ref)
    assert outcome.error == ""
    assert gpu_instances(tmp_path) == [(9, 4, 1)]
    record = p.store.get(UID_A)
    assert record is not None
    assert record.state == ClaimState.PREPARE_COMPLETED
    mig = record.devices[0].mig
    assert mig is not None
    assert mig.state == MigState.CREATED
    assert spec_uuids(tmp_path, UID_A) == [mig.uuid]
    # A repeated prepare answers from the checkpoint and cuts nothing more.
    assert p.prepare(ref).devices == outcome.devices
    assert gpu_instances(tmp_path) == [(9, 4, 1)]
    assert p.unprepare(ref) == ""
    assert gpu_instances(tmp_path) == []
    assert p.store.get(UID_A) is None


def test_two_halves_get_two_instances_with_their_own_uuids(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    a, b = put_claim(tmp_path, UID_A, HALF_0), put_claim(tmp_path, UID_B, HALF_4)
    assert p.prepare(a).error == ""
    assert p.prepare(b).error == ""
    assert gpu_instances(tmp_path) == [(9, 0, 1), (9, 4, 1)]
    assert spec_uuids(tmp_path, UID_A) != spec_uuids(tmp_path, UID_B)


def test_an_overlapping_placement_is_refused_naming_the_holder(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    assert p.prepare(put_claim(tmp_path, UID_A, HALF_0, name="train")).error == ""
    error = p.prepare(put_claim(tmp_path, UID_B, SMALL_2)).error
    assert "memory slices" in error
    assert "ml/train" in error
    assert gpu_instances(tmp_path) == [(9, 0, 1)]


def test_the_whole_gpu_waits_for_its_parts_and_turns_mig_mode_off(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    half = put_claim(tmp_path, UID_A, HALF_0, name="half")
    assert p.prepare(half).error == ""
    whole = put_claim(tmp_path, UID_B, WHOLE)
    assert "ml/half" in p.prepare(whole).error
    assert p.unprepare(half) == ""
    assert p.prepare(whole).error == ""
    lib = library(tmp_path)
    lib.init()
    assert not lib.device_mig_mode(lib.device_handle_by_index(0)).current


def test_an_instance_left_at_the_placement_is_adopted(tmp_path: Path) -> None:
    lib = library(tmp_path)
    lib.init()
    handle = lib.device_handle_by_index(0)
    lib.device_set_mig_mode(handle, True)
    lib.create_gpu_instance(handle, 9, Placement(start=4, size=4))  # a crash left it
    p = preparer(tmp_path)
    assert p.prepare(put_claim(tmp_path, UID_A, HALF_4)).error == ""
    assert gpu_instances(tmp_path) == [(9, 4, 1)]


def test_reconcile_destroys_orphans_and_names_claims_that_lost_theirs(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    assert p.prepare(put_claim(tmp_path, UID_A, HALF_0)).error == ""
    lib = library(tmp_path)
    lib.init()
    handle = lib.device_handle_by_index(0)
    orphan = lib.create_gpu_instance(handle, 9, Placement(start=4, size=4))
    lib.create_compute_instance(handle, orphan.gpu_instance_id)
    gpus = [d for d in p.devices.values() if d.mig_placement is not None]
    assert p.migs is not None
    report = p.migs.reconcile(gpus, p.store.claims())
    assert len(report.destroyed) == 1
    assert "3g.40gb at 4" in report.destroyed[0]
    assert report.missing == ()
    assert gpu_instances(tmp_path) == [(9, 0, 1)]
    # Now the claim's own instance vanishes (a GPU reset): the claim is named.
    (held,) = lib.gpu_instances(handle)
    for compute in lib.compute_instances(handle, held.gpu_instance_id):
        lib.destroy_compute_instance(handle, held.gpu_instance_id, compute.compute_instance_id)
    lib.destroy_gpu_instance(handle, held.gpu_instance_id)
    report = p.migs.reconcile(gpus, p.store.claims())
    assert report.missing == (UID_A,)
    assert "prepared again" in report.message


# ---- crashes ---------------------------------------------------------------------------

PREPARE_CRASHES = [
    "prepare-after-started",
    "mig-after-gi",
    "mig-after-ci",
    "prepare-after-mig",
    "prepare-after-cdi",
    "prepare-after-completed",
]
UNPREPARE_CRASHES = ["unprepare-after-cdi", "mig-destroy-after-ci", "unprepare-after-mig"]


def crashed(root: Path, operation: str, ref: Any, point: str) -> None:
    crash_in_child("test_dynamic_mig", root, operation, ref, point)


@pytest.mark.parametrize("point", PREPARE_CRASHES)
def test_a_prepare_repeated_after_a_crash_holds_exactly_one_instance(
    tmp_path: Path, point: str
) -> None:
    ref = put_claim(tmp_path, UID_A, HALF_4)
    crashed(tmp_path, "prepare", ref, point)
    p = preparer(tmp_path)  # the restarted plugin
    assert p.prepare(ref).error == ""
    assert gpu_instances(tmp_path) == [(9, 4, 1)]
    record = p.store.get(UID_A)
    assert record is not None
    mig = record.devices[0].mig
    assert mig is not None
    assert mig.state == MigState.CREATED
    assert spec_uuids(tmp_path, UID_A) == [mig.uuid]
    assert p.unprepare(ref) == ""
    assert gpu_instances(tmp_path) == []


@pytest.mark.parametrize("point", PREPARE_CRASHES)
def test_an_unprepare_after_a_crashed_prepare_leaves_no_instance(
    tmp_path: Path, point: str
) -> None:
    ref = put_claim(tmp_path, UID_A, HALF_4)
    crashed(tmp_path, "prepare", ref, point)
    p = preparer(tmp_path)
    assert p.unprepare(ref) == ""
    assert gpu_instances(tmp_path) == []
    assert p.store.claims() == {}


@pytest.mark.parametrize("point", PREPARE_CRASHES)
def test_a_crashed_prepare_keeps_its_placement_from_other_claims(
    tmp_path: Path, point: str
) -> None:
    ref = put_claim(tmp_path, UID_A, HALF_4, name="first")
    crashed(tmp_path, "prepare", ref, point)
    p = preparer(tmp_path)
    error = p.prepare(put_claim(tmp_path, UID_B, HALF_4)).error
    assert "ml/first" in error
    # What the reconcile at start does keeps the crashed claim's instance, if any.
    gpus = [d for d in p.devices.values() if d.mig_placement is not None]
    assert p.migs is not None
    assert p.migs.reconcile(gpus, p.store.claims()).destroyed == ()


@pytest.mark.parametrize("point", UNPREPARE_CRASHES)
def test_an_unprepare_repeated_after_a_crash_destroys_the_instance(
    tmp_path: Path, point: str
) -> None:
    ref = put_claim(tmp_path, UID_A, HALF_4)
    assert preparer(tmp_path).prepare(ref).error == ""
    crashed(tmp_path, "unprepare", ref, point)
    p = preparer(tmp_path)
    assert p.unprepare(ref) == ""
    assert gpu_instances(tmp_path) == []
    assert p.store.claims() == {}
    assert not spec_file(tmp_path, UID_A).exists()

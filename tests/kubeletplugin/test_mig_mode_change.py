"""A change of ``--mig-mode`` under prepared claims (a ``helm upgrade`` of ``migMode``).

Claims prepared under the old mode are kept: the plugin in the new mode never destroys
what they hold and never hands it to a second claim; unprepare cleans up what the record
says was made (an instance drasil cut is destroyed, one the operator made never is).

Each test prepares with one Preparer over the simulated NVML (its MIG state in a file,
as on a real GPU), then starts another over the same state dir in the other mode, the
way the plugin starts after an upgrade: ``reconcile_migs`` first, then prepares.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubelet_client import DRIVER, NODE, FileClaims, claim_json, ref_of, result

from drasil.driver.checkpoint import CHECKPOINT_DIR, CheckpointStore
from drasil.driver.devices import DeviceType
from drasil.driver.migrecords import held_by_dynamic_claims
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.nvidia.nvml import NvmlLibrary, Placement
from drasil.driver.simulated.nvml import simulated_library
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.vendors.nvidia.migs import MigInstances
from drasil.kubeletplugin.vendors.nvidia.recovery import reconcile_migs

HALF_PROFILE = 9  # 3g.40gb on an H100
SMALL_PROFILE = 19  # 1g.10gb
HALF_0 = "gpu-0-mig-3g40gb-at-0"
HALF_4 = "gpu-0-mig-3g40gb-at-4"
SMALL_5 = "gpu-0-mig-1g10gb-at-5"
WHOLE = "gpu-0"

UID_A = "aaaaaaaa-0000-4000-8000-00000000000a"
UID_B = "bbbbbbbb-0000-4000-8000-00000000000b"
UID_C = "cccccccc-0000-4000-8000-00000000000c"


def library(root: Path) -> NvmlLibrary:
    return simulated_library("h100-80gb:1", node_name=NODE, state_file=root / "gpus.json")


def preparer(root: Path, mig_mode: str) -> Preparer:
    """The plugin's Preparer in ``mig_mode`` over ``root``'s checkpoint and GPUs."""
    state, cdi = root / "state", root / "cdi"
    state.mkdir(parents=True, exist_ok=True)
    cdi.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore(state / CHECKPOINT_DIR)
    store.load()
    lib = library(root)
    found = discover(lib, node_name=NODE, mig_mode=mig_mode)
    return Preparer(
        driver=DRIVER,
        pool=NODE,
        devices={d.name: d for d in found.devices},
        claims=FileClaims(root / "claims"),
        store=store,
        cdi_root=cdi,
        state_dir=state,
        migs=MigInstances(lib, state_dir=state),
    )


def started(root: Path, mig_mode: str) -> tuple[Preparer, str]:
    """A plugin started in ``mig_mode``: its Preparer and the reconcile's message."""
    p = preparer(root, mig_mode)
    assert isinstance(p.migs, MigInstances)
    message = reconcile_migs(
        p.migs, store=p.store, state_lock=p.state_lock, devices=p.devices, mig_mode=mig_mode
    )
    return p, message


def put_claim(root: Path, uid: str, device: str, *, name: str) -> Any:
    claim = claim_json(uid, result(device, request="r0"), name=name, namespace="ml")
    FileClaims(root / "claims").put(claim)
    return ref_of(claim)


def operator_cuts(root: Path, profile_id: int, start: int, size: int) -> None:
    """An instance made by hand (``nvidia-smi mig -cgi … -C``), MIG mode on first."""
    lib = library(root)
    lib.init()
    handle = lib.device_handle_by_index(0)
    if not lib.device_mig_mode(handle).current:
        lib.device_set_mig_mode(handle, True)
    made = lib.create_gpu_instance(handle, profile_id, Placement(start=start, size=size))
    lib.create_compute_instance(handle, made.gpu_instance_id)


def gpu_instances(root: Path) -> list[tuple[int, int]]:
    """(profile id, start) of every GPU instance on the GPU."""
    lib = library(root)
    lib.init()
    handle = lib.device_handle_by_index(0)
    if not lib.device_mig_mode(handle).current:
        return []
    return sorted((g.profile_id, g.placement.start) for g in lib.gpu_instances(handle))


def static_mig_device(p: Preparer) -> str:
    (name,) = [d.name for d in p.devices.values() if d.type == DeviceType.MIG]
    return name


def forget_static_records(p: Preparer, uid: str) -> None:
    """Make the record as an earlier drasil wrote it: no ``staticMig``."""
    record = p.store.get(uid)
    assert record is not None
    devices = [d.model_copy(update={"static_mig": None}) for d in record.devices]
    with p.state_lock():
        p.store.replace_devices(uid, devices)


# ---- static -> dynamic ----------------------------------------------------------------


@pytest.mark.parametrize("earlier_record", [False, True], ids=["recorded", "earlier-drasil"])
def test_dynamic_mode_keeps_a_static_claims_instance_and_refuses_overlaps(
    tmp_path: Path, earlier_record: bool
) -> None:
    operator_cuts(tmp_path, HALF_PROFILE, start=4, size=4)
    static = preparer(tmp_path, "static")
    held = put_claim(tmp_path, UID_A, static_mig_device(static), name="static-job")
    assert static.prepare(held).error == ""
    record = static.store.get(UID_A)
    assert record is not None
    site = record.devices[0].static_mig
    assert site is not None
    assert (site.profile_id, site.placement_start, site.placement_size) == (HALF_PROFILE, 4, 4)
    if earlier_record:
        forget_static_records(static, UID_A)

    dynamic, message = started(tmp_path, "dynamic")
    assert "kept 1 MIG instance" in message
    assert "ml/static-job" in message
    assert gpu_instances(tmp_path) == [(HALF_PROFILE, 4)]
    kept = dynamic.store.get(UID_A)
    assert kept is not None
    assert kept.devices[0].static_mig == site  # filled in where an earlier drasil had none

    for uid, name in ((UID_B, HALF_4), (UID_B, SMALL_5), (UID_B, WHOLE)):
        error = dynamic.prepare(put_claim(tmp_path, uid, name, name="second")).error
        assert "ml/static-job" in error, name
    assert gpu_instances(tmp_path) == [(HALF_PROFILE, 4)]
    # The other half of the GPU is free.
    assert dynamic.prepare(put_claim(tmp_path, UID_C, HALF_0, name="beside")).error == ""
    assert gpu_instances(tmp_path) == [(HALF_PROFILE, 0), (HALF_PROFILE, 4)]

    # The operator's instance is never destroyed by an unprepare, in any mode.
    assert dynamic.unprepare(held) == ""
    assert gpu_instances(tmp_path) == [(HALF_PROFILE, 0), (HALF_PROFILE, 4)]
    assert dynamic.store.get(UID_A) is None
    # And a later prepare there works (dynamic mode adopts what sits at the placement).
    later = put_claim(tmp_path, UID_B, HALF_4, name="later")
    assert dynamic.prepare(later).error == ""
    assert dynamic.unprepare(later) == ""
    assert gpu_instances(tmp_path) == [(HALF_PROFILE, 0)]


def test_a_restart_in_dynamic_mode_keeps_the_static_instance_again(tmp_path: Path) -> None:
    operator_cuts(tmp_path, HALF_PROFILE, start=0, size=4)
    static = preparer(tmp_path, "static")
    assert (
        static.prepare(put_claim(tmp_path, UID_A, static_mig_device(static), name="a")).error == ""
    )
    started(tmp_path, "dynamic")
    _, message = started(tmp_path, "dynamic")  # the plugin restarted once more
    assert "kept 1" in message
    assert "destroyed" not in message
    assert gpu_instances(tmp_path) == [(HALF_PROFILE, 0)]


def test_a_static_claim_of_a_whole_gpu_keeps_dynamic_placements_off_it(tmp_path: Path) -> None:
    static = preparer(tmp_path, "static")
    held = put_claim(tmp_path, UID_A, WHOLE, name="whole-job")
    assert static.prepare(held).error == ""
    dynamic, _ = started(tmp_path, "dynamic")
    error = dynamic.prepare(put_claim(tmp_path, UID_B, SMALL_5, name="part")).error
    assert "ml/whole-job" in error
    assert gpu_instances(tmp_path) == []
    assert dynamic.unprepare(held) == ""
    assert dynamic.prepare(put_claim(tmp_path, UID_C, SMALL_5, name="part")).error == ""


# ---- dynamic -> static ----------------------------------------------------------------


def test_static_mode_refuses_a_held_dynamic_instance_and_unprepare_destroys_it(
    tmp_path: Path,
) -> None:
    dynamic = preparer(tmp_path, "dynamic")
    held = put_claim(tmp_path, UID_A, HALF_4, name="dynamic-job")
    assert dynamic.prepare(held).error == ""
    assert gpu_instances(tmp_path) == [(HALF_PROFILE, 4)]

    static, message = started(tmp_path, "static")
    assert "ml/dynamic-job" in message
    assert gpu_instances(tmp_path) == [(HALF_PROFILE, 4)]
    republished = static_mig_device(static)  # the same instance, under a static name
    assert held_by_dynamic_claims(static.devices.values(), static.store.claims()) == {republished}
    error = static.prepare(put_claim(tmp_path, UID_B, republished, name="second")).error
    assert "ml/dynamic-job" in error
    assert "shares GPU memory slices" in error

    # Unprepared in static mode, the instance drasil cut is destroyed all the same.
    assert static.unprepare(held) == ""
    assert gpu_instances(tmp_path) == []
    assert static.store.claims() == {}

    # The operator lays the GPU out again; a restarted static plugin hands it out, and
    # the operator's instance outlives the claim.
    operator_cuts(tmp_path, SMALL_PROFILE, start=0, size=1)
    again, message = started(tmp_path, "static")
    assert message == ""
    later = put_claim(tmp_path, UID_C, static_mig_device(again), name="later")
    assert again.prepare(later).error == ""
    assert again.unprepare(later) == ""
    assert gpu_instances(tmp_path) == [(SMALL_PROFILE, 0)]


def test_a_dynamic_claim_of_a_whole_gpu_stays_held_in_static_mode(tmp_path: Path) -> None:
    dynamic = preparer(tmp_path, "dynamic")
    held = put_claim(tmp_path, UID_A, WHOLE, name="whole-job")
    assert dynamic.prepare(held).error == ""
    static, _ = started(tmp_path, "static")
    error = static.prepare(put_claim(tmp_path, UID_B, WHOLE, name="second")).error
    assert "ml/whole-job" in error
    assert static.unprepare(held) == ""
    assert static.prepare(put_claim(tmp_path, UID_C, WHOLE, name="later")).error == ""


def test_static_devices_know_their_gpu_instance(tmp_path: Path) -> None:
    operator_cuts(tmp_path, HALF_PROFILE, start=4, size=4)
    found = discover(library(tmp_path), node_name=NODE, mig_mode="static")
    (mig,) = [d for d in found.devices if d.type == DeviceType.MIG]
    assert mig.mig_site is not None
    assert (mig.mig_site.profile_id, mig.mig_site.start, mig.mig_site.size) == (9, 4, 4)

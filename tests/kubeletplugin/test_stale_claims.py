"""Clean-up after crashes and deleted claims: stale entries, leaked specs, rebuilds."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from kubelet_client import (
    KubeNames,
    MemoryClaims,
    claim_json,
    make_preparer,
    ref_of,
    result,
    spec_file,
)

from drasil.api.checkpoint import ClaimState, PreparedDevice
from drasil.driver.checkpoint import CHECKPOINT_DIR
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.dra.reconcile import (
    TEMP_MAX_AGE,
    _leaked_specs,
    rebuild_from_specs,
    reconcile,
    stale_claims,
)

UID_A = "0b7c3f2e-8d1a-4c55-9e0f-1a2b3c4d5e6f"
UID_B = "1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f9"
UID_C = "2a3b4c5d-6e7f-4a8b-9c0d-e1f2a3b4c5d6"
UID_D = "3c4d5e6f-7a8b-4c9d-8e0f-a1b2c3d4e5f6"


def three_prepared(tmp_path: Path) -> tuple[Preparer, MemoryClaims]:
    claims = [
        claim_json(UID_A, result("gpu-0"), name="a"),
        claim_json(UID_B, result("gpu-1"), name="b"),
        claim_json(UID_C, result("gpu-2"), name="c"),
    ]
    reader = MemoryClaims(*claims)
    preparer = make_preparer(tmp_path, reader)
    for claim in claims:
        assert preparer.prepare(ref_of(claim)).error == ""
    return preparer, reader


def test_stale_claims_are_gone_or_recreated(tmp_path: Path) -> None:
    preparer, reader = three_prepared(tmp_path)
    assert stale_claims(preparer, reader) == []

    reader.delete("default", "b")  # deleted while the plugin was down
    reader.put(claim_json(UID_D, result("gpu-3"), name="c"))  # same name, new claim
    assert sorted(stale_claims(preparer, reader)) == sorted([UID_B, UID_C])


def test_reconcile_unprepares_stale_claims_and_deletes_leaked_specs(tmp_path: Path) -> None:
    preparer, reader = three_prepared(tmp_path)
    reader.delete("default", "b")
    # A spec that no checkpoint entry accounts for.
    leaked = spec_file(tmp_path, UID_D)
    leaked.write_bytes(spec_file(tmp_path, UID_A).read_bytes())

    assert reconcile(preparer, reader) == 2
    assert not spec_file(tmp_path, UID_B).exists()
    assert preparer.store.get(UID_B) is None
    assert not leaked.exists()
    # Live claims keep everything.
    for uid in (UID_A, UID_C):
        assert spec_file(tmp_path, uid).is_file()
        record = preparer.store.get(uid)
        assert record is not None
        assert record.state == ClaimState.PREPARE_COMPLETED

    assert reconcile(preparer, reader) == 0


def test_leaked_specs_keeps_specs_of_started_prepares(tmp_path: Path) -> None:
    preparer, _ = three_prepared(tmp_path)
    with preparer.state_lock():
        preparer.store.remove(UID_A)
        preparer.store.mark_started(
            UID_B,
            namespace="default",
            name="b",
            devices=[PreparedDevice(pool_name="n1", device_name="gpu-1")],
        )
    assert _leaked_specs(preparer) == 1
    assert not spec_file(tmp_path, UID_A).exists()
    assert spec_file(tmp_path, UID_B).exists()
    assert spec_file(tmp_path, UID_C).exists()


def test_reconcile_sweeps_only_old_temp_files(tmp_path: Path) -> None:
    preparer, reader = three_prepared(tmp_path)
    cdi = tmp_path / "cdi"
    old = cdi / f"{spec_file(tmp_path, UID_D).name}.0123456789ab.tmp"
    fresh = cdi / f"{spec_file(tmp_path, UID_D).name}.ba9876543210.tmp"
    old.write_text("{")
    fresh.write_text("{")
    long_ago = time.time() - TEMP_MAX_AGE - 60
    os.utime(old, (long_ago, long_ago))

    assert reconcile(preparer, reader) == 1
    assert not old.exists()
    assert fresh.exists()  # may belong to a write in progress


def lose_checkpoint(tmp_path: Path, reader: MemoryClaims) -> Preparer:
    shutil.rmtree(tmp_path / "state" / CHECKPOINT_DIR)
    return make_preparer(tmp_path, reader)


def test_rebuild_from_specs_reserves_the_devices_again(tmp_path: Path) -> None:
    claims = [
        claim_json(
            UID_A,
            result("gpu-0", request="a"),
            result("gpu-3", request="b"),
            name="x",
            namespace="ns1",
        ),
        claim_json(UID_B, result("gpu-1"), name="y", namespace="ns2"),
    ]
    reader = MemoryClaims(*claims)
    first = make_preparer(tmp_path, reader)
    prepared = {ref_of(c).uid: first.prepare(ref_of(c)) for c in claims}
    spec_bytes = spec_file(tmp_path, UID_A).read_bytes()

    preparer = lose_checkpoint(tmp_path, reader)
    assert preparer.store.claims() == {}
    assert rebuild_from_specs(preparer) == 2
    assert rebuild_from_specs(preparer) == 0  # entries exist now

    record = preparer.store.get(UID_A)
    assert record is not None
    assert record.state == ClaimState.PREPARE_STARTED
    assert (record.namespace, record.name) == ("ns1", "x")
    assert [(d.pool_name, d.device_name) for d in record.devices] == [
        ("n1", "gpu-0"),
        ("n1", "gpu-3"),
    ]
    # Each device's own CDI ID; the metadata mounts are no devices and come back with
    # the next prepare (below).
    assert [d.cdi_device_ids for d in record.devices] == [
        d.cdi_device_ids[:1] for d in prepared[UID_A].devices
    ]
    record_b = preparer.store.get(UID_B)
    assert record_b is not None
    assert (record_b.namespace, record_b.name) == ("ns2", "y")

    # The devices stay reserved: another claim cannot take them.
    thief = claim_json(UID_C, result("gpu-3"), name="thief")
    reader.put(thief)
    assert "already prepared for claim ns1/x" in preparer.prepare(ref_of(thief)).error

    # kubelet's next prepare completes the entry from the claim, request names included.
    again = preparer.prepare(ref_of(claims[0]))
    assert again == prepared[UID_A]
    completed = preparer.store.get(UID_A)
    assert completed is not None
    assert completed.state == ClaimState.PREPARE_COMPLETED
    assert spec_file(tmp_path, UID_A).read_bytes() == spec_bytes


def test_leaked_metadata_is_removed(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-0"), name="x")
    reader = MemoryClaims(claim)
    preparer = make_preparer(tmp_path, reader)
    preparer.prepare(ref_of(claim))
    kept = preparer.metadata_root / UID_A
    assert sorted(p.name for p in kept.iterdir()) == ["gpu.json"]
    # A directory no entry accounts for (its entry lost with the spec, say).
    leaked = preparer.metadata_root / UID_B
    leaked.mkdir()
    (leaked / "gpu.json").write_text("{}")
    assert reconcile(preparer, reader) == 1
    assert not leaked.exists()
    assert kept.is_dir()
    assert preparer.unprepare(ref_of(claim)) == ""
    assert not kept.exists()


def test_rebuilt_entry_of_a_deleted_claim_is_cleaned_up(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-0"), name="x")
    reader = MemoryClaims(claim)
    make_preparer(tmp_path, reader).prepare(ref_of(claim))
    preparer = lose_checkpoint(tmp_path, reader)
    assert rebuild_from_specs(preparer) == 1
    reader.delete("default", "x")
    assert reconcile(preparer, reader) == 1
    assert preparer.store.claims() == {}
    assert list((tmp_path / "cdi").iterdir()) == []


def test_rebuild_skips_a_spec_whose_claim_uid_does_not_match(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-0"))
    reader = MemoryClaims(claim)
    make_preparer(tmp_path, reader).prepare(ref_of(claim))
    # A file renamed by hand: its content names another claim.
    spec_file(tmp_path, UID_A).rename(spec_file(tmp_path, UID_B))
    preparer = lose_checkpoint(tmp_path, reader)
    assert rebuild_from_specs(preparer) == 0
    assert preparer.store.claims() == {}


def test_a_record_no_claim_can_match_does_not_stop_the_pass(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-0"), name="x")
    reader = MemoryClaims(claim)
    preparer = make_preparer(tmp_path, reader)
    preparer.prepare(ref_of(claim))
    with preparer.state_lock():
        preparer.store.mark_started("../../evil", namespace="a/b", name="../evil")
        preparer.store.mark_started(UID_B, namespace="default", name="gone")
    names = KubeNames(reader)

    assert reconcile(preparer, names) == 2

    assert sorted(preparer.store.claims()) == [UID_A]
    assert spec_file(tmp_path, UID_A).is_file()

"""What a checkpoint write costs: one record encoded, the same bytes as a full encode,
and the index of held devices kept in step with every change."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

import pytest

import drasil.driver.checkpoint as checkpoint_module
from drasil.api.checkpoint import (
    Checkpoint,
    ClaimRecord,
    ClaimState,
    GpuRecord,
    PreparedDevice,
    assemble_checkpoint,
    decode_checkpoint,
    encode_checkpoint,
    encode_entry,
)
from drasil.driver.checkpoint import CHECKPOINT_FILE, CheckpointStore
from drasil.driver.files import write_atomic

WHEN = datetime(2026, 3, 1, 12, 30, tzinfo=UTC)


def uid(n: int) -> str:
    return f"00000000-0000-4000-8000-{n:012d}"


def device(name: str) -> PreparedDevice:
    return PreparedDevice(request_names=("gpu",), pool_name="node-a", device_name=name)


def record(name: str, *devices: str) -> ClaimRecord:
    return ClaimRecord(
        namespace="team-a",
        name=name,
        state=ClaimState.PREPARE_COMPLETED,
        devices=tuple(device(d) for d in devices),
        updated_at=WHEN,
    )


def store_at(path: Path) -> CheckpointStore:
    store = CheckpointStore(path, boot_id_reader=lambda: "boot-a", clock=lambda: WHEN)
    store.load()
    return store


def test_assembled_bytes_are_those_of_a_full_encode() -> None:
    claims = {uid(n): record(f"c{n}", f"gpu-{n}") for n in (3, 1, 2)}
    checkpoint = Checkpoint(boot_id="b", claims=claims, gpus={"GPU-1": GpuRecord(time_slice=2)})
    entries = {u: encode_entry(u, r) for u, r in claims.items()}
    assert assemble_checkpoint(checkpoint, entries) == encode_checkpoint(checkpoint)
    assert decode_checkpoint(encode_checkpoint(checkpoint)) == checkpoint


def test_an_unknown_field_that_looks_like_the_claims_slot_is_still_encoded_right() -> None:
    # A newer drasil's field whose value is the text the encoder splices claims into.
    odd = Checkpoint.model_validate(
        {"bootId": "b", "claims": {}, "zzz": {"claims": "\x00claims"}}
    ).model_copy(update={"claims": {uid(1): record("c1", "gpu-1")}})
    entries = {uid(1): encode_entry(uid(1), record("c1", "gpu-1"))}
    data = assemble_checkpoint(odd, entries)
    assert decode_checkpoint(data) == odd


def test_a_write_encodes_only_the_record_that_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_at(tmp_path / CHECKPOINT_FILE)
    for n in range(50):
        store.mark_started(uid(n), namespace="team-a", name=f"c{n}", devices=[device("gpu-0")])
    encoded: list[str] = []
    real = checkpoint_module.encode_entry

    def counting(claim_uid: str, rec: ClaimRecord) -> bytes:
        encoded.append(claim_uid)
        return real(claim_uid, rec)

    monkeypatch.setattr(checkpoint_module, "encode_entry", counting)
    store.mark_completed(uid(7), [device("gpu-0")])
    store.remove(uid(8))
    store.set_gpu("GPU-1", GpuRecord(time_slice=2))
    assert encoded == [uid(7)]
    again = store_at(tmp_path / CHECKPOINT_FILE)
    assert again.checkpoint == store.checkpoint
    assert len(again.claims()) == 49


def test_holding_follows_every_change(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE
    store = store_at(path)
    store.mark_started(uid(1), namespace="team-a", name="c1", devices=[device("gpu-0")])
    store.mark_started(uid(2), namespace="team-a", name="c2", devices=[device("gpu-1")])
    assert set(store.holding({"gpu-0"})) == {uid(1)}
    store.mark_completed(uid(1), [device("gpu-3")])  # the record now names another device
    assert store.holding({"gpu-0"}) == {}
    assert set(store.holding({"gpu-3", "gpu-1"})) == {uid(1), uid(2)}
    store.remove(uid(2))
    assert store.holding({"gpu-1"}) == {}


def test_holding_sees_what_another_process_wrote(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE
    store = store_at(path)
    store.index_devices(lambda d: d.device_name.split("-mig")[0])  # key: the parent GPU
    other = store_at(path)
    other.mark_started(uid(5), namespace="team-a", name="c5", devices=[device("gpu-2-mig-1")])
    assert store.reload_if_changed()
    assert set(store.holding({"gpu-2"})) == {uid(5)}


def test_atomic_writes_go_on_where_fallocate_is_not_supported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    target = tmp_path / "spec.json"
    write_atomic(target, b'{"a": 1}')
    assert target.read_bytes() == b'{"a": 1}'

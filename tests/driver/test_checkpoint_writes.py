"""What a checkpoint write costs: one small file, whatever the number of claims held
(counted in files and bytes, not timed), and the index of held devices kept in step
with every change."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import drasil.driver.checkpoint as checkpoint_module
from drasil.api.checkpoint import ClaimRecord, ClaimState, GpuRecord, PreparedDevice
from drasil.driver.checkpoint import CHECKPOINT_DIR, CheckpointStore
from drasil.driver.checkpointdisk import CLAIMS, GPUS, read_state
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


@dataclass
class Writes:
    """The files the store wrote or removed, and the bytes it wrote."""

    files: list[Path] = field(default_factory=list)
    size: int = 0
    unlinked: list[Path] = field(default_factory=list)


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> Writes:
    seen = Writes()
    real_write, real_unlink = checkpoint_module.write_atomic, Path.unlink

    def write(path: Path, data: bytes, **kwargs: Any) -> None:
        seen.files.append(path)
        seen.size += len(data)
        real_write(path, data, **kwargs)

    def unlink(path: Path, missing_ok: bool = False) -> None:
        seen.unlinked.append(path)
        real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(checkpoint_module, "write_atomic", write)
    monkeypatch.setattr(Path, "unlink", unlink)
    return seen


def holding_store(directory: Path, count: int) -> CheckpointStore:
    store = store_at(directory)
    for n in range(count):
        store.mark_started(uid(n), namespace="team-a", name=f"c{n}", devices=[device("gpu-0")])
    return store


def one_of_each_change(store: CheckpointStore) -> None:
    store.mark_started(uid(99_999), namespace="team-a", name="new", devices=[device("gpu-1")])
    store.mark_completed(uid(99_999), [device("gpu-1")])
    store.set_gpu("GPU-1", GpuRecord(time_slice=2))
    store.set_gpu("GPU-1", None)
    store.remove(uid(99_999))


@pytest.mark.parametrize("held", [1, 1000])
def test_a_write_touches_one_small_file_whatever_the_claims_held(
    tmp_path: Path, writes: Writes, held: int
) -> None:
    store = holding_store(tmp_path / CHECKPOINT_DIR, held)
    writes.files.clear()
    writes.size = 0
    writes.unlinked.clear()

    one_of_each_change(store)

    claim = tmp_path / CHECKPOINT_DIR / CLAIMS / f"{uid(99_999)}.json"
    gpu = tmp_path / CHECKPOINT_DIR / GPUS / "GPU-1.json"
    # started, completed, the GPU, the removal's tombstone: one file each
    assert writes.files == [claim, claim, gpu, claim]
    assert writes.size < 4 * 1024
    assert writes.unlinked == [gpu, claim]
    assert len(store.claims()) == held


def test_the_bytes_written_do_not_grow_with_the_claims_held(tmp_path: Path, writes: Writes) -> None:
    sizes = []
    for held in (1, 1000):
        store = holding_store(tmp_path / f"held-{held}" / CHECKPOINT_DIR, held)
        writes.size = 0
        one_of_each_change(store)
        sizes.append(writes.size)
    assert sizes[0] == sizes[1]


def test_changes_are_all_there_for_the_next_load(tmp_path: Path) -> None:
    directory = tmp_path / CHECKPOINT_DIR
    store = holding_store(directory, 50)
    store.mark_completed(uid(7), [device("gpu-0")])
    store.remove(uid(8))
    store.set_gpu("GPU-1", GpuRecord(time_slice=2))
    again = store_at(directory)
    assert again.checkpoint == store.checkpoint
    assert len(again.claims()) == 49
    assert read_state(directory) == store.checkpoint


def test_holding_follows_every_change(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_DIR
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
    path = tmp_path / CHECKPOINT_DIR
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

    target = tmp_path / "spec.json"
    write_atomic(target, b'{"a": 0}')
    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    write_atomic(target, b'{"a": 1}')  # a replacement: its blocks are reserved first
    assert target.read_bytes() == b'{"a": 1}'


def test_only_a_replacement_reserves_its_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reserved: list[int] = []
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, offset, length: reserved.append(length))
    target = tmp_path / "record.json"
    write_atomic(target, b"new", durable=False)
    assert reserved == []  # delayed allocation: cheap to delete before write-back
    write_atomic(target, b"again", durable=False)
    assert reserved == [5]
    assert target.read_bytes() == b"again"

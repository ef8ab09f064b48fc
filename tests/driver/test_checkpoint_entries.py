"""Checkpoint entries that are not regular files: quarantined like corrupt files, and
never opened in a way that can block (a FIFO) or follow out of the directory (a symlink).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from drasil.api.checkpoint import CorruptCheckpoint
from drasil.driver.checkpoint import (
    CHECKPOINT_DIR,
    LEGACY_CHECKPOINT_FILE,
    CheckpointStore,
)
from drasil.driver.checkpointdisk import CLAIMS, GENERATION, GPUS, LoadOutcome, read_checkpoint_file

UID = "0b7c3f2e-8d1a-4c55-9e0f-1a2b3c4d5e6f"
UID2 = "1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f9"
WHEN = datetime(2026, 3, 1, 12, 30, tzinfo=UTC)
STAMP = "20260301T123000.000000Z"


def store_at(directory: Path) -> CheckpointStore:
    return CheckpointStore(directory, boot_id_reader=lambda: "boot-a", clock=lambda: WHEN)


def make_directory(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_text("kept")  # a non-empty directory moves whole


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def make_symlink(path: Path) -> None:
    # A valid claim file elsewhere: following the link would load it as this claim's.
    target = path.parent.parent.parent / "elsewhere.json"
    target.write_bytes((path.parent / f"{UID2}.json").read_bytes())
    path.symlink_to(target)


def make_dangling_symlink(path: Path) -> None:
    path.symlink_to(path.parent / "nowhere")


KINDS = {
    "directory": make_directory,
    "fifo": make_fifo,
    "symlink": make_symlink,
    "dangling-symlink": make_dangling_symlink,
}


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    return tmp_path / "state" / CHECKPOINT_DIR


@pytest.fixture
def two_claims(directory: Path) -> CheckpointStore:
    store = store_at(directory)
    store.load()
    store.mark_started(UID, namespace="team-a", name="train")
    store.mark_started(UID2, namespace="team-b", name="infer")
    return store


def replace_with(path: Path, make: Callable[[Path], None]) -> None:
    path.unlink()
    make(path)


def assert_quarantined_once(directory: Path, path: Path) -> None:
    """The entry was moved aside whole under the usual name; a second load is clean."""
    moved = path.with_name(f"{path.name}.corrupt-{STAMP}")
    assert os.path.lexists(moved)
    assert not os.path.lexists(path)
    again = store_at(directory).load()  # load, not load_or_quarantine: nothing left to refuse
    assert again.outcome is LoadOutcome.LOADED


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_claim_entry_that_is_not_a_file_is_quarantined(
    two_claims: CheckpointStore, directory: Path, kind: str
) -> None:
    path = directory / CLAIMS / f"{UID}.json"
    replace_with(path, KINDS[kind])

    result = store_at(directory).load_or_quarantine()

    assert result.outcome is LoadOutcome.QUARANTINED
    assert list(result.checkpoint.claims) == [UID2]  # the other claim is loaded
    assert result.quarantined == (path.with_name(f"{UID}.json.corrupt-{STAMP}"),)
    assert "not a regular file" in result.detail
    assert_quarantined_once(directory, path)


@pytest.mark.timeout(20)
def test_a_socket_entry_is_quarantined(
    two_claims: CheckpointStore, directory: Path, make_socket: Callable[[Path], None]
) -> None:
    path = directory / CLAIMS / f"{UID}.json"
    replace_with(path, make_socket)

    result = store_at(directory).load_or_quarantine()

    assert list(result.checkpoint.claims) == [UID2]
    assert "a socket" in result.detail
    assert_quarantined_once(directory, path)


def test_a_symlink_is_not_followed(two_claims: CheckpointStore, directory: Path) -> None:
    path = directory / CLAIMS / f"{UID}.json"
    replace_with(path, make_symlink)
    target = path.resolve()

    store_at(directory).load_or_quarantine()

    moved = path.with_name(f"{UID}.json.corrupt-{STAMP}")
    assert moved.is_symlink()  # the link itself moved aside, its target untouched
    assert target.is_file()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_gpu_entry_that_is_not_a_file_is_quarantined(directory: Path, kind: str) -> None:
    store = store_at(directory)
    store.load()
    path = directory / GPUS / "GPU-1.json"
    KINDS[kind](path)

    result = store_at(directory).load_or_quarantine()

    assert result.outcome is LoadOutcome.QUARANTINED
    assert_quarantined_once(directory, path)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_load_without_quarantine_names_the_entry(
    two_claims: CheckpointStore, directory: Path, kind: str
) -> None:
    path = directory / CLAIMS / f"{UID}.json"
    replace_with(path, KINDS[kind])
    with pytest.raises(CorruptCheckpoint, match="not a regular file"):
        store_at(directory).load()
    assert os.path.lexists(path)  # load() changes nothing


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_legacy_checkpoint_that_is_not_a_file_is_quarantined(
    two_claims: CheckpointStore, directory: Path, kind: str
) -> None:
    path = directory.parent / LEGACY_CHECKPOINT_FILE
    KINDS[kind](path)

    result = store_at(directory).load_or_quarantine()

    assert result.outcome is LoadOutcome.QUARANTINED
    assert sorted(result.checkpoint.claims) == sorted([UID, UID2])
    assert_quarantined_once(directory, path)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["directory", "fifo", "dangling-symlink"])
def test_a_generation_that_is_not_a_file_is_quarantined(
    two_claims: CheckpointStore, directory: Path, kind: str
) -> None:
    path = directory / GENERATION
    replace_with(path, KINDS[kind])

    store = store_at(directory)
    result = store.load_or_quarantine()

    assert result.outcome is LoadOutcome.QUARANTINED
    assert sorted(result.checkpoint.claims) == sorted([UID, UID2])
    assert os.path.lexists(path.with_name(f"{GENERATION}.corrupt-{STAMP}"))
    assert path.is_file()  # written again by the load
    assert not path.is_symlink()
    store.mark_started("uid-3", namespace="n", name="c")  # changes work again
    assert store_at(directory).load().outcome is LoadOutcome.LOADED


def test_a_taken_quarantine_name_is_not_overwritten(
    two_claims: CheckpointStore, directory: Path
) -> None:
    path = directory / CLAIMS / f"{UID}.json"
    earlier = path.with_name(f"{UID}.json.corrupt-{STAMP}")
    earlier.write_bytes(b"an earlier quarantine")
    replace_with(path, make_directory)

    result = store_at(directory).load_or_quarantine()

    assert result.quarantined == (path.with_name(f"{UID}.json.corrupt-{STAMP}.1"),)
    assert earlier.read_bytes() == b"an earlier quarantine"
    assert (path.with_name(f"{UID}.json.corrupt-{STAMP}.1") / "inside").read_text() == "kept"


@pytest.mark.timeout(20)
def test_read_checkpoint_file_refuses_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(CorruptCheckpoint, match="a FIFO"):
        read_checkpoint_file(fifo)
    with pytest.raises(CorruptCheckpoint, match="a directory"):
        read_checkpoint_file(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_checkpoint_file(tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"data")
    assert read_checkpoint_file(tmp_path / "file") == b"data"

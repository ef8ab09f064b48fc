"""Entries that are not regular files where ``drasil.driver.files`` expects one: read
without blocking or following, swept only when removing them is safe, and a lock file
that is something else moved aside instead of stopping the plugin.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from drasil.driver import files
from drasil.driver.checkpoint import CHECKPOINT_DIR, CheckpointStore
from drasil.driver.checkpointdisk import CLAIMS, GPUS, LoadOutcome
from drasil.driver.files import (
    FileLock,
    LockFileError,
    NotRegularFile,
    open_regular,
    read_regular,
    sweep_temp_files,
)


def make_directory(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_text("kept")


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def make_symlink(path: Path) -> None:
    target = path.parent / "target"
    target.write_text("the target")
    path.symlink_to(target)


KINDS: dict[str, tuple[Callable[[Path], None], str]] = {
    "directory": (make_directory, "a directory"),
    "fifo": (make_fifo, "a FIFO"),
    "symlink": (make_symlink, "a symlink"),
}


# --- open_regular / read_regular -----------------------------------------------------


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_read_regular_refuses_other_kinds_naming_them(tmp_path: Path, kind: str) -> None:
    make, words = KINDS[kind]
    path = tmp_path / "entry"
    make(path)
    with pytest.raises(NotRegularFile, match=f"not a regular file \\({words}\\)") as err:
        read_regular(path)
    assert err.value.path == path
    assert err.value.kind == words
    assert isinstance(err.value, OSError)


@pytest.mark.timeout(20)
def test_read_regular_refuses_a_socket(tmp_path: Path, make_socket: Callable[[Path], None]) -> None:
    make_socket(tmp_path / "sock")
    with pytest.raises(NotRegularFile, match="a socket"):
        read_regular(tmp_path / "sock")


def test_read_regular_reads_a_file_and_reports_a_missing_one(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"data")
    assert read_regular(tmp_path / "file") == b"data"
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing")


@pytest.mark.timeout(20)
def test_open_regular_creates_but_never_opens_a_fifo_for_writing(tmp_path: Path) -> None:
    make_fifo(tmp_path / "fifo")
    with pytest.raises(NotRegularFile, match="a FIFO"):
        open_regular(tmp_path / "fifo", os.O_RDWR | os.O_CREAT)
    fd = open_regular(tmp_path / "new", os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    assert (tmp_path / "new").is_file()


# --- sweep_temp_files ------------------------------------------------------------------


@pytest.mark.timeout(20)
def test_sweep_leaves_a_directory_and_removes_other_entries_without_following(
    tmp_path: Path,
) -> None:
    (tmp_path / "a.json.1.tmp").write_text("a crashed write")
    make_directory(tmp_path / "a.json.2.tmp")
    make_fifo(tmp_path / "a.json.3.tmp")
    target = tmp_path / "elsewhere"
    target.write_text("not ours to remove")
    (tmp_path / "a.json.4.tmp").symlink_to(target)
    (tmp_path / "a.json.5.tmp").symlink_to(tmp_path / "nowhere")  # dangling

    removed = sweep_temp_files(tmp_path, prefix="a.json")

    assert [p.name for p in removed] == [
        "a.json.1.tmp",
        "a.json.3.tmp",
        "a.json.4.tmp",
        "a.json.5.tmp",
    ]
    assert (tmp_path / "a.json.2.tmp" / "inside").read_text() == "kept"
    assert target.read_text() == "not ours to remove"


def test_sweep_with_an_age_reads_a_dangling_symlinks_own_time(tmp_path: Path) -> None:
    (tmp_path / "a.json.1.tmp").symlink_to(tmp_path / "nowhere")
    make_directory(tmp_path / "a.json.2.tmp")
    old = os.stat(tmp_path).st_mtime - 3600
    os.utime(tmp_path / "a.json.1.tmp", (old, old), follow_symlinks=False)
    assert [p.name for p in sweep_temp_files(tmp_path, prefix="a", older_than=60)] == [
        "a.json.1.tmp"
    ]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("folder", [CLAIMS, GPUS])
def test_a_directory_named_like_a_temp_file_does_not_stop_the_checkpoint_load(
    tmp_path: Path, folder: str
) -> None:
    directory = tmp_path / "state" / CHECKPOINT_DIR
    store = CheckpointStore(directory, boot_id_reader=lambda: "boot-a")
    store.load()
    store.mark_started("uid-1", namespace="n", name="c")
    make_directory(directory / folder / "uid-1.json.abc.tmp")

    result = CheckpointStore(directory, boot_id_reader=lambda: "boot-a").load()

    assert result.outcome is LoadOutcome.LOADED
    assert list(result.checkpoint.claims) == ["uid-1"]


# --- FileLock ------------------------------------------------------------------------


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_lock_file_that_is_not_a_file_is_moved_aside(tmp_path: Path, kind: str) -> None:
    make, _ = KINDS[kind]
    path = tmp_path / "checkpoint.lock"
    make(path)

    with FileLock(path, timeout=5) as lock:
        assert lock.locked
        assert path.is_file()
        assert not path.is_symlink()

    (moved,) = tmp_path.glob("checkpoint.lock.corrupt-*")
    assert os.path.lexists(moved)
    if kind == "symlink":
        assert moved.is_symlink()  # the link moved, its target never opened nor changed
        assert (tmp_path / "target").read_text() == "the target"
    with FileLock(path, timeout=5):  # the next start finds a lock file
        pass
    assert len(list(tmp_path.glob("checkpoint.lock.corrupt-*"))) == 1


def test_a_second_lock_still_waits_for_the_first_after_the_move(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.lock"
    make_directory(path)
    with FileLock(path, timeout=5), pytest.raises(files.LockTimeoutError):
        FileLock(path, timeout=0.05).acquire()


def test_a_regular_lock_file_is_never_moved(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.lock"
    path.write_text("")
    inode = path.stat().st_ino
    with FileLock(path, timeout=5):
        pass
    assert path.stat().st_ino == inode
    assert list(tmp_path.glob("*.corrupt-*")) == []


def test_a_lock_file_that_cannot_be_moved_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.lock"
    make_directory(path)

    def refuse(path: Path) -> Path:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(files, "move_aside", refuse)
    with pytest.raises(LockFileError, match=r"checkpoint\.lock: not a regular file") as err:
        FileLock(path, timeout=5).acquire()
    assert "remove it" in str(err.value)


def test_a_lock_file_put_back_at_once_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.lock"
    make_directory(path)
    move_aside = files.move_aside

    def and_again(entry: Path) -> Path:
        moved = move_aside(entry)
        entry.mkdir()  # whoever made it makes it again
        return moved

    monkeypatch.setattr(files, "move_aside", and_again)
    with pytest.raises(LockFileError, match=r"\(a directory\) even after it was moved aside"):
        FileLock(path, timeout=5).acquire()


class _FixedClock:
    @staticmethod
    def now(tz: object) -> datetime:
        return datetime(2026, 3, 1, 12, 30, tzinfo=UTC)


def test_move_aside_never_replaces_an_earlier_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "datetime", _FixedClock)
    entry = tmp_path / "x"
    entry.write_text("1")
    first = files.move_aside(entry)
    make_directory(entry)
    second = files.move_aside(entry)
    assert first.name == "x.corrupt-20260301T123000.000000Z"
    assert second.name == "x.corrupt-20260301T123000.000000Z.1"
    assert first.read_text() == "1"
    assert (second / "inside").read_text() == "kept"

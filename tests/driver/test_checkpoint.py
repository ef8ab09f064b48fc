"""The checkpoint store and the cross-process FileLock, with real files and processes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from drasil.api.checkpoint import (
    CheckpointError,
    ClaimState,
    PreparedDevice,
    checksum,
    encode_checkpoint,
)
from drasil.driver.checkpoint import (
    CHECKPOINT_FILE,
    CheckpointStore,
    CorruptCheckpoint,
    LoadOutcome,
    read_boot_id,
)
from drasil.driver.files import CRASH_ENV, CRASH_EXIT_CODE, FileLock, LockTimeoutError

UID = "0b7c3f2e-8d1a-4c55-9e0f-1a2b3c4d5e6f"
UID2 = "1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f9"
WHEN = datetime(2026, 3, 1, 12, 30, tzinfo=UTC)


def store_at(path: Path, boot_id: str = "boot-a") -> CheckpointStore:
    return CheckpointStore(path, boot_id_reader=lambda: boot_id, clock=lambda: WHEN)


def device(name: str = "gpu-0", share_id: str | None = None) -> PreparedDevice:
    return PreparedDevice(
        request_names=["gpu"],
        pool_name="node-a",
        device_name=name,
        cdi_device_ids=[f"k8s.gpu.drasil.dev/claim={UID}-{name}"],
        share_id=share_id,
    )


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / CHECKPOINT_FILE


@pytest.fixture
def prepared(path: Path) -> CheckpointStore:
    """A store on disk with one completed claim."""
    store = store_at(path)
    store.load()
    store.mark_started(UID, namespace="team-a", name="train")
    store.mark_completed(UID, [device(), device("gpu-1", share_id="s-1")])
    return store


def test_missing_file_is_an_empty_checkpoint(path: Path) -> None:
    result = store_at(path).load()
    assert result.outcome is LoadOutcome.MISSING
    assert result.checkpoint.claims == {}
    assert result.checkpoint.boot_id == "boot-a"
    assert not path.exists()  # nothing to write until something changes


def test_round_trip_through_the_file(prepared: CheckpointStore, path: Path) -> None:
    again = store_at(path)
    result = again.load()
    assert result.outcome is LoadOutcome.LOADED
    assert result.checkpoint == prepared.checkpoint
    record = again.get(UID)
    assert record is not None
    assert record.state is ClaimState.PREPARE_COMPLETED
    assert (record.namespace, record.name) == ("team-a", "train")
    assert [d.share_id for d in record.devices] == [None, "s-1"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(os.listdir(path.parent)) == [CHECKPOINT_FILE]


def test_started_is_recorded_before_completion(path: Path) -> None:
    store = store_at(path)
    store.load()
    store.mark_started(UID, namespace="team-a", name="train", devices=[device()])
    again = store_at(path)
    again.load()
    record = again.get(UID)
    assert record is not None
    assert record.state is ClaimState.PREPARE_STARTED
    assert record.devices == (device(),)


def test_remove(prepared: CheckpointStore, path: Path) -> None:
    assert prepared.remove(UID) is True
    inode = path.stat().st_ino
    assert prepared.remove(UID) is False
    assert path.stat().st_ino == inode  # a no-op remove writes nothing
    again = store_at(path)
    again.load()
    assert again.claims() == {}


def test_completed_without_started_is_an_error(path: Path) -> None:
    store = store_at(path)
    store.load()
    with pytest.raises(CheckpointError, match="without being started"):
        store.mark_completed(UID, [device()])


def test_use_before_load_is_an_error(path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"load\(\)"):
        store_at(path).mark_started(UID, namespace="n", name="c")


def test_corrupt_file_raises_from_load(prepared: CheckpointStore, path: Path) -> None:
    path.write_bytes(path.read_bytes().replace(b"train", b"trane"))
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        store_at(path).load()


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: data.replace(b"train", b"trane"), id="checksum-mismatch"),
        pytest.param(lambda data: data[: len(data) // 2], id="truncated"),
        pytest.param(lambda data: b"\x00" * len(data), id="zeroed"),
    ],
)
def test_corrupt_file_is_quarantined(
    prepared: CheckpointStore, path: Path, damage: Callable[[bytes], bytes]
) -> None:
    bad = damage(path.read_bytes())
    path.write_bytes(bad)
    store = store_at(path)
    result = store.load_or_quarantine()
    assert result.outcome is LoadOutcome.QUARANTINED
    assert result.checkpoint.claims == {}
    assert result.quarantined_to == path.with_name(
        f"{CHECKPOINT_FILE}.corrupt-20260301T123000.000000Z"
    )
    assert result.quarantined_to.read_bytes() == bad
    assert result.detail
    assert not path.exists()
    # The plugin keeps serving: the next mutation writes a fresh, valid file.
    store.mark_started(UID2, namespace="n", name="c")
    again = store_at(path)
    assert again.load().outcome is LoadOutcome.LOADED
    assert list(again.claims()) == [UID2]


def test_newer_version_is_quarantined_not_lost(path: Path) -> None:
    document = {"version": 99, "bootId": "boot-a", "claims": {}}
    path.write_text(json.dumps({**document, "checksum": checksum(document)}))
    result = store_at(path).load_or_quarantine()
    assert result.outcome is LoadOutcome.QUARANTINED
    assert "newer" in result.detail
    assert result.quarantined_to is not None
    assert json.loads(result.quarantined_to.read_text())["version"] == 99


def test_boot_id_change_discards_prepared_state(prepared: CheckpointStore, path: Path) -> None:
    store = store_at(path, boot_id="boot-b")
    result = store.load_or_quarantine()
    assert result.outcome is LoadOutcome.BOOT_CHANGED
    assert result.checkpoint.claims == {}
    assert result.checkpoint.boot_id == "boot-b"
    assert list(result.discarded) == [UID]
    assert "boot-a" in result.detail
    # The reset is durable: the next start in this boot finds a clean checkpoint.
    again = store_at(path, boot_id="boot-b").load()
    assert again.outcome is LoadOutcome.LOADED
    assert again.checkpoint.claims == {}


def test_unknown_fields_survive_a_rewrite(prepared: CheckpointStore, path: Path) -> None:
    document = json.loads(path.read_bytes())
    del document["checksum"]
    document["futureField"] = {"x": 1}
    path.write_text(json.dumps({**document, "checksum": checksum(document)}))
    store = store_at(path)
    assert store.load().outcome is LoadOutcome.LOADED
    store.mark_started(UID2, namespace="n", name="c")
    assert json.loads(path.read_bytes())["futureField"] == {"x": 1}


def test_threads_do_not_lose_updates(path: Path) -> None:
    store = store_at(path)
    store.load()

    def prepare(worker: int) -> None:
        for i in range(10):
            store.mark_started(f"uid-{worker}-{i}", namespace="n", name="c")

    threads = [threading.Thread(target=prepare, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    again = store_at(path)
    again.load()
    assert len(again.claims()) == 80


def test_read_boot_id() -> None:
    boot_id = read_boot_id()
    assert len(boot_id) == 36
    assert boot_id == read_boot_id()


# --- crashes -------------------------------------------------------------------------------

_CRASHING_WRITER = """
import sys
from datetime import UTC, datetime
from pathlib import Path
from drasil.api.checkpoint import PreparedDevice
from drasil.driver.checkpoint import CheckpointStore

store = CheckpointStore(Path(sys.argv[1]), boot_id_reader=lambda: "boot-a")
store.load()
device = PreparedDevice(pool_name="node-a", device_name="gpu-7")
store.mark_completed(sys.argv[2], [device])
"""


@pytest.mark.parametrize(
    ("point", "survivor"),
    [
        ("checkpoint-mid-write", "old"),
        ("checkpoint-before-rename", "old"),
        ("checkpoint-after-rename", "new"),
    ],
)
def test_crash_during_write_keeps_a_readable_version(path: Path, point: str, survivor: str) -> None:
    store = store_at(path)
    store.load()
    store.mark_started(UID, namespace="team-a", name="train")
    old = path.read_bytes()
    env = {**os.environ, CRASH_ENV: point}
    argv = [sys.executable, "-c", _CRASHING_WRITER, str(path), UID]
    assert subprocess.run(argv, env=env, check=False, timeout=60).returncode == CRASH_EXIT_CODE
    if survivor == "old":
        assert path.read_bytes() == old
    again = store_at(path)
    assert again.load().outcome is LoadOutcome.LOADED  # never corrupt
    record = again.get(UID)
    assert record is not None
    expected = ClaimState.PREPARE_STARTED if survivor == "old" else ClaimState.PREPARE_COMPLETED
    assert record.state is expected
    # load() swept the temp file the crashed writer left behind.
    assert os.listdir(path.parent) == [CHECKPOINT_FILE]


def test_encoded_size_stays_small(prepared: CheckpointStore) -> None:
    # One claim should stay well under a page: every prepare rewrites the file.
    assert len(encode_checkpoint(prepared.checkpoint)) < 1024


# --- FileLock --------------------------------------------------------------------------------

_LOCK_HOLDER = """
import sys
from pathlib import Path
from drasil.driver.files import FileLock

with FileLock(Path(sys.argv[1])):
    print("locked", flush=True)
    sys.stdin.readline()
"""


def _hold_lock(lock_path: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", _LOCK_HOLDER, str(lock_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "locked"
    return child


def test_file_lock_excludes_another_process(tmp_path: Path) -> None:
    lock_path = tmp_path / "prepare.lock"
    child = _hold_lock(lock_path)
    try:
        with pytest.raises(LockTimeoutError), FileLock(lock_path, timeout=0.2):
            pass
        assert child.stdin is not None
        child.stdin.write("release\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
        with FileLock(lock_path, timeout=5) as lock:
            assert lock.locked
        assert not lock.locked
    finally:
        child.kill()
        child.wait()


def test_file_lock_is_released_when_the_holder_dies(tmp_path: Path) -> None:
    lock_path = tmp_path / "prepare.lock"
    child = _hold_lock(lock_path)
    child.kill()
    child.wait()
    with FileLock(lock_path, timeout=5) as lock:
        assert lock.locked


def test_file_lock_excludes_within_one_process(tmp_path: Path) -> None:
    lock_path = tmp_path / "prepare.lock"
    with FileLock(lock_path) as first:
        with pytest.raises(LockTimeoutError):
            FileLock(lock_path, timeout=0.05).acquire()
        with pytest.raises(RuntimeError, match="already locked"):
            first.acquire()
    assert lock_path.exists()  # never deleted: see FileLock


# --- the file changed under a running plugin -----------------------------------------


def test_a_file_deleted_while_running_is_written_back_from_memory(
    prepared: CheckpointStore, path: Path
) -> None:
    path.unlink()

    assert prepared.reload_if_changed()

    assert list(prepared.claims()) == [UID]  # the devices stay reserved
    assert list(store_at(path).load().checkpoint.claims) == [UID]


def test_a_file_corrupted_while_running_is_quarantined_and_written_back(
    prepared: CheckpointStore, path: Path
) -> None:
    path.write_bytes(b"{not json")

    assert prepared.reload_if_changed()

    assert list(prepared.claims()) == [UID]
    assert list(store_at(path).load().checkpoint.claims) == [UID]
    (moved,) = path.parent.glob(f"{CHECKPOINT_FILE}.corrupt-*")
    assert moved.read_bytes() == b"{not json"


def test_a_file_replaced_by_another_instance_is_read(prepared: CheckpointStore, path: Path) -> None:
    other = store_at(path)
    other.load()
    other.mark_started(UID2, namespace="n", name="c")

    assert prepared.reload_if_changed()

    assert sorted(prepared.claims()) == sorted([UID, UID2])

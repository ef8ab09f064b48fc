"""The checkpoint store and the cross-process FileLock, with real files and processes."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from drasil.api.checkpoint import (
    CheckpointError,
    ClaimState,
    PreparedDevice,
    checksum,
    encode_claim_file,
)
from drasil.driver.checkpoint import (
    BOOT_ID_PATH,
    CHECKPOINT_DIR,
    CheckpointStore,
    CorruptCheckpoint,
    read_boot_id,
    use_boot_id_file,
)
from drasil.driver.checkpointdisk import CLAIMS, GENERATION, GPUS, LoadOutcome, read_state
from drasil.driver.files import CRASH_ENV, CRASH_EXIT_CODE, FileLock, LockTimeoutError

UID = "0b7c3f2e-8d1a-4c55-9e0f-1a2b3c4d5e6f"
UID2 = "1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f9"
WHEN = datetime(2026, 3, 1, 12, 30, tzinfo=UTC)
STAMP = "20260301T123000.000000Z"


def store_at(directory: Path, boot_id: str = "boot-a") -> CheckpointStore:
    return CheckpointStore(directory, boot_id_reader=lambda: boot_id, clock=lambda: WHEN)


def device(name: str = "gpu-0", share_id: str | None = None) -> PreparedDevice:
    return PreparedDevice(
        request_names=["gpu"],
        pool_name="node-a",
        device_name=name,
        cdi_device_ids=[f"k8s.gpu.drasil.dev/claim={UID}-{name}"],
        share_id=share_id,
    )


def claim_file(directory: Path, uid: str = UID) -> Path:
    return directory / CLAIMS / f"{uid}.json"


def listing(directory: Path, folder: str = CLAIMS) -> list[str]:
    return sorted(os.listdir(directory / folder))


def reseal(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Edit a stored file and give it a valid checksum again."""
    document = json.loads(path.read_bytes())
    del document["checksum"]
    change(document)
    path.write_text(json.dumps({**document, "checksum": checksum(document)}))


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    return tmp_path / CHECKPOINT_DIR


@pytest.fixture
def prepared(directory: Path) -> CheckpointStore:
    """A store on disk with one completed claim."""
    store = store_at(directory)
    store.load()
    store.mark_started(UID, namespace="team-a", name="train")
    store.mark_completed(UID, [device(), device("gpu-1", share_id="s-1")])
    return store


def test_missing_directory_is_an_empty_checkpoint(directory: Path) -> None:
    result = store_at(directory).load()
    assert result.outcome is LoadOutcome.MISSING
    assert result.checkpoint.claims == {}
    assert result.checkpoint.boot_id == "boot-a"
    assert listing(directory) == []  # no claim is written until one is recorded
    assert store_at(directory).load().outcome is LoadOutcome.LOADED


def test_round_trip_through_the_files(prepared: CheckpointStore, directory: Path) -> None:
    again = store_at(directory)
    result = again.load()
    assert result.outcome is LoadOutcome.LOADED
    assert result.checkpoint == prepared.checkpoint
    assert read_state(directory) == prepared.checkpoint
    record = again.get(UID)
    assert record is not None
    assert record.state is ClaimState.PREPARE_COMPLETED
    assert (record.namespace, record.name) == ("team-a", "train")
    assert [d.share_id for d in record.devices] == [None, "s-1"]
    assert stat.S_IMODE(claim_file(directory).stat().st_mode) == 0o600
    assert listing(directory) == [f"{UID}.json"]
    assert sorted(os.listdir(directory)) == [CLAIMS, GENERATION, GPUS]
    assert os.listdir(directory.parent) == [CHECKPOINT_DIR]


def test_started_is_recorded_before_completion(directory: Path) -> None:
    store = store_at(directory)
    store.load()
    store.mark_started(UID, namespace="team-a", name="train", devices=[device()])
    again = store_at(directory)
    again.load()
    record = again.get(UID)
    assert record is not None
    assert record.state is ClaimState.PREPARE_STARTED
    assert record.devices == (device(),)


def test_remove(prepared: CheckpointStore, directory: Path) -> None:
    assert prepared.remove(UID) is True
    assert listing(directory) == []
    generation = (directory / GENERATION).read_bytes()
    assert prepared.remove(UID) is False
    assert (directory / GENERATION).read_bytes() == generation  # a no-op remove writes nothing
    again = store_at(directory)
    again.load()
    assert again.claims() == {}


def test_gpu_records_have_a_file_each(prepared: CheckpointStore, directory: Path) -> None:
    from drasil.api.checkpoint import GpuRecord

    prepared.set_gpu("GPU-1", GpuRecord(time_slice=2))
    prepared.set_gpu("GPU-2", GpuRecord(time_slice=3))
    assert listing(directory, GPUS) == ["GPU-1.json", "GPU-2.json"]
    prepared.set_gpu("GPU-1", GpuRecord())  # an empty record is forgotten
    assert listing(directory, GPUS) == ["GPU-2.json"]
    again = store_at(directory)
    again.load()
    assert dict(again.gpus()) == {"GPU-2": GpuRecord(time_slice=3)}


def test_completed_without_started_is_an_error(directory: Path) -> None:
    store = store_at(directory)
    store.load()
    with pytest.raises(CheckpointError, match="without being started"):
        store.mark_completed(UID, [device()])


def test_use_before_load_is_an_error(directory: Path) -> None:
    with pytest.raises(CheckpointError, match=r"load\(\)"):
        store_at(directory).mark_started(UID, namespace="n", name="c")


def test_corrupt_file_raises_from_load(prepared: CheckpointStore, directory: Path) -> None:
    path = claim_file(directory)
    path.write_bytes(path.read_bytes().replace(b"train", b"trane"))
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        store_at(directory).load()


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: data.replace(b"train", b"trane"), id="checksum-mismatch"),
        pytest.param(lambda data: data[: len(data) // 2], id="truncated"),
        pytest.param(lambda data: b"\x00" * len(data), id="zeroed"),
    ],
)
def test_corrupt_file_is_quarantined(
    prepared: CheckpointStore, directory: Path, damage: Callable[[bytes], bytes]
) -> None:
    path = claim_file(directory)
    bad = damage(path.read_bytes())
    path.write_bytes(bad)
    store = store_at(directory)
    result = store.load_or_quarantine()
    assert result.outcome is LoadOutcome.QUARANTINED
    assert result.checkpoint.claims == {}
    assert result.quarantined_to == path.with_name(f"{UID}.json.corrupt-{STAMP}")
    assert result.quarantined_to.read_bytes() == bad
    assert result.detail
    assert not path.exists()
    # The plugin keeps serving: the next change writes a fresh, valid file.
    store.mark_started(UID2, namespace="n", name="c")
    again = store_at(directory)
    assert again.load().outcome is LoadOutcome.LOADED
    assert list(again.claims()) == [UID2]


def test_a_corrupt_claim_file_costs_only_that_claim(
    prepared: CheckpointStore, directory: Path
) -> None:
    prepared.mark_started(UID2, namespace="team-b", name="infer", devices=[device("gpu-5")])
    claim_file(directory).write_bytes(b"{not json")
    result = store_at(directory).load_or_quarantine()
    assert result.outcome is LoadOutcome.QUARANTINED
    assert list(result.checkpoint.claims) == [UID2]
    assert result.quarantined == (claim_file(directory).with_name(f"{UID}.json.corrupt-{STAMP}"),)
    assert UID in result.detail


def test_a_file_under_another_name_is_quarantined(
    prepared: CheckpointStore, directory: Path
) -> None:
    claim_file(directory).rename(claim_file(directory, UID2))
    result = store_at(directory).load_or_quarantine()
    assert result.outcome is LoadOutcome.QUARANTINED
    assert "file name" in result.detail
    assert result.checkpoint.claims == {}


def test_newer_version_is_quarantined_not_lost(prepared: CheckpointStore, directory: Path) -> None:
    reseal(claim_file(directory), lambda document: document.update(version=99))
    result = store_at(directory).load_or_quarantine()
    assert result.outcome is LoadOutcome.QUARANTINED
    assert "newer" in result.detail
    assert result.quarantined_to is not None
    assert json.loads(result.quarantined_to.read_text())["version"] == 99


def test_boot_id_change_discards_prepared_state(prepared: CheckpointStore, directory: Path) -> None:
    store = store_at(directory, boot_id="boot-b")
    result = store.load_or_quarantine()
    assert result.outcome is LoadOutcome.BOOT_CHANGED
    assert result.checkpoint.claims == {}
    assert result.checkpoint.boot_id == "boot-b"
    assert list(result.discarded) == [UID]
    assert "boot-a" in result.detail
    # The reset is durable: the next start in this boot finds a clean checkpoint.
    again = store_at(directory, boot_id="boot-b").load()
    assert again.outcome is LoadOutcome.LOADED
    assert again.checkpoint.claims == {}
    assert listing(directory) == []


def test_unknown_fields_survive(prepared: CheckpointStore, directory: Path) -> None:
    reseal(claim_file(directory), lambda document: document["claim"].update(futureField=1))
    store = store_at(directory)
    assert store.load().outcome is LoadOutcome.LOADED
    store.mark_started(UID2, namespace="n", name="c")
    assert json.loads(claim_file(directory).read_bytes())["claim"]["futureField"] == 1


def test_threads_do_not_lose_updates(directory: Path) -> None:
    store = store_at(directory)
    store.load()

    def prepare(worker: int) -> None:
        for i in range(10):
            store.mark_started(f"uid-{worker}-{i}", namespace="n", name="c")

    threads = [threading.Thread(target=prepare, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    again = store_at(directory)
    again.load()
    assert len(again.claims()) == 80


def test_a_key_with_a_separator_stays_in_its_folder(directory: Path) -> None:
    store = store_at(directory)
    store.load()
    store.mark_started("../../escape", namespace="n", name="c")
    assert listing(directory) == ["..%2F..%2Fescape.json"]
    again = store_at(directory)
    again.load()
    assert list(again.claims()) == ["../../escape"]


def test_read_boot_id() -> None:
    boot_id = read_boot_id()
    assert len(boot_id) == 36
    assert boot_id == read_boot_id()


def test_a_boot_id_file_given_is_read_and_a_new_id_there_is_a_new_boot(tmp_path: Path) -> None:
    """What a test rig's simulated reboot relies on (the plugin's --boot-id-file)."""
    boot = tmp_path / "boot_id"
    boot.write_text("boot-a\n")
    use_boot_id_file(boot)
    try:
        assert read_boot_id() == "boot-a"
        store = CheckpointStore(tmp_path / "checkpoint")
        store.load()
        store.mark_started("uid-1", namespace="n", name="c")
        boot.write_text("boot-b\n")
        again = CheckpointStore(tmp_path / "checkpoint")
        again.load()
        assert list(again.claims()) == []  # prepared in another boot: not trusted
    finally:
        use_boot_id_file(BOOT_ID_PATH)
    assert read_boot_id() == BOOT_ID_PATH.read_text().strip()


# --- crashes -------------------------------------------------------------------------------

_CRASHING_WRITER = """
import sys
from datetime import UTC, datetime
from pathlib import Path
from drasil.api.checkpoint import PreparedDevice
from drasil.driver.checkpoint import CheckpointStore

store = CheckpointStore(Path(sys.argv[1]), boot_id_reader=lambda: "boot-a")
store.load()
if sys.argv[3] == "complete":
    device = PreparedDevice(pool_name="node-a", device_name="gpu-7")
    store.mark_completed(sys.argv[2], [device])
else:
    store.remove(sys.argv[2])
"""


def crash(directory: Path, point: str, action: str) -> None:
    env = {**os.environ, CRASH_ENV: point}
    argv = [sys.executable, "-c", _CRASHING_WRITER, str(directory), UID, action]
    assert subprocess.run(argv, env=env, check=False, timeout=60).returncode == CRASH_EXIT_CODE


@pytest.mark.parametrize(
    ("point", "survivor"),
    [
        ("checkpoint-mid-write", "old"),
        ("checkpoint-before-rename", "old"),
        ("checkpoint-after-rename", "new"),
    ],
)
def test_crash_during_write_keeps_a_readable_version(
    directory: Path, point: str, survivor: str
) -> None:
    store = store_at(directory)
    store.load()
    store.mark_started(UID, namespace="team-a", name="train")
    store.mark_started(UID2, namespace="team-b", name="other")
    old, other = claim_file(directory).read_bytes(), claim_file(directory, UID2).read_bytes()
    crash(directory, point, "complete")
    if survivor == "old":
        assert claim_file(directory).read_bytes() == old
    assert claim_file(directory, UID2).read_bytes() == other  # never touched
    again = store_at(directory)
    assert again.load().outcome is LoadOutcome.LOADED  # never corrupt
    record = again.get(UID)
    assert record is not None
    expected = ClaimState.PREPARE_STARTED if survivor == "old" else ClaimState.PREPARE_COMPLETED
    assert record.state is expected
    # load() swept the temp file the crashed writer left behind.
    assert listing(directory) == sorted([f"{UID}.json", f"{UID2}.json"])


@pytest.mark.parametrize(
    ("point", "removed"),
    [
        ("checkpoint-mid-write", False),
        ("checkpoint-before-rename", False),
        ("checkpoint-after-rename", True),  # the tombstone is in place
    ],
)
def test_crash_during_remove_leaves_the_record_or_its_tombstone(
    prepared: CheckpointStore, directory: Path, point: str, removed: bool
) -> None:
    crash(directory, point, "remove")
    state = read_state(directory)
    assert state is not None
    assert (UID not in state.claims) == removed
    again = store_at(directory)
    assert again.load().outcome is LoadOutcome.LOADED
    assert (again.get(UID) is None) == removed
    assert listing(directory) == ([] if removed else [f"{UID}.json"])  # tombstone gone


def test_boot_change_interrupted_half_way_is_finished_by_the_next_load(
    prepared: CheckpointStore, directory: Path
) -> None:
    prepared.mark_started(UID2, namespace="team-b", name="other")
    # As if a load in the new boot removed one file of the old boot, then crashed.
    claim_file(directory).unlink()
    result = store_at(directory, boot_id="boot-b").load()
    assert result.outcome is LoadOutcome.BOOT_CHANGED
    assert list(result.discarded) == [UID2]
    assert listing(directory) == []


def test_encoded_size_stays_small(prepared: CheckpointStore) -> None:
    # One claim's file stays well under a page.
    record = prepared.get(UID)
    assert len(encode_claim_file(UID, record, boot_id="boot-a")) < 1024


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


# --- the directory changed under a running plugin ----------------------------------


def test_a_directory_deleted_while_running_is_written_back_from_memory(
    prepared: CheckpointStore, directory: Path
) -> None:
    shutil.rmtree(directory)

    assert prepared.reload_if_changed()

    assert list(prepared.claims()) == [UID]  # the devices stay reserved
    assert list(store_at(directory).load().checkpoint.claims) == [UID]


def test_a_change_after_the_directory_was_deleted_writes_it_back(
    prepared: CheckpointStore, directory: Path
) -> None:
    shutil.rmtree(directory)

    prepared.mark_started(UID2, namespace="n", name="c")

    assert sorted(store_at(directory).load().checkpoint.claims) == sorted([UID, UID2])


def test_a_file_corrupted_while_running_is_quarantined_and_written_back(
    prepared: CheckpointStore, directory: Path
) -> None:
    path = claim_file(directory)
    path.write_bytes(b"{not json")
    (directory / GENERATION).unlink()  # whoever damaged it also told us so

    assert prepared.reload_if_changed()

    assert list(prepared.claims()) == [UID]
    assert list(store_at(directory).load().checkpoint.claims) == [UID]
    (moved,) = path.parent.glob(f"{UID}.json.corrupt-*")
    assert moved.read_bytes() == b"{not json"


def test_a_change_by_another_instance_is_read(prepared: CheckpointStore, directory: Path) -> None:
    other = store_at(directory)
    other.load()
    other.mark_started(UID2, namespace="n", name="c")
    other.remove(UID)

    assert prepared.reload_if_changed()

    assert list(prepared.claims()) == [UID2]
    assert not prepared.reload_if_changed()  # nothing new since


def test_a_lock_kept_open_still_excludes_and_is_released(tmp_path: Path) -> None:
    lock_path = tmp_path / "checkpoint.lock"
    kept = FileLock(lock_path, timeout=5, keep_open=True)
    for _ in range(3):  # held several times over the one open file
        with kept, pytest.raises(LockTimeoutError):
            FileLock(lock_path, timeout=0.05).acquire()
        with FileLock(lock_path, timeout=0.05) as other:  # released between holds
            assert other.locked
    child = _hold_lock(lock_path)  # and against another process
    try:
        with pytest.raises(LockTimeoutError):
            FileLock(lock_path, timeout=0.2, keep_open=True).acquire()
        with pytest.raises(LockTimeoutError), kept:
            pass
    finally:
        child.kill()
        child.wait()


def test_a_lock_kept_open_follows_its_file_when_it_is_replaced(tmp_path: Path) -> None:
    lock_path = tmp_path / "checkpoint.lock"
    kept = FileLock(lock_path, timeout=5, keep_open=True)
    with kept:
        pass
    lock_path.unlink()  # a careless clean-up; another instance makes the file again
    child = _hold_lock(lock_path)
    try:
        with pytest.raises(LockTimeoutError), FileLock(lock_path, timeout=0.2, keep_open=True):
            pass
        kept.timeout = 0.2
        with pytest.raises(LockTimeoutError), kept:  # the new file, not the one kept open
            pass
    finally:
        child.kill()
        child.wait()
    kept.timeout = 5
    with kept:
        assert kept.locked

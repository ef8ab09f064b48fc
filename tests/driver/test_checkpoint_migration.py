"""A single-file checkpoint.json (earlier drasil) is split into the checkpoint directory at
load, crash-safely: the file goes last, and an interrupted migration is done again."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from drasil.api.checkpoint import (
    Checkpoint,
    ClaimRecord,
    ClaimState,
    GpuRecord,
    PreparedDevice,
    encode_checkpoint,
)
from drasil.driver.checkpoint import CHECKPOINT_DIR, LEGACY_CHECKPOINT_FILE, CheckpointStore
from drasil.driver.checkpointdisk import CLAIMS, GPUS, LoadOutcome, read_state
from drasil.driver.files import CRASH_ENV, CRASH_EXIT_CODE

WHEN = datetime(2026, 3, 1, 12, 30, tzinfo=UTC)


def uid(n: int) -> str:
    return f"00000000-0000-4000-8000-{n:012d}"


def record(n: int) -> ClaimRecord:
    return ClaimRecord(
        namespace="team-a",
        name=f"c{n}",
        state=ClaimState.PREPARE_COMPLETED,
        devices=(PreparedDevice(request_names=("gpu",), pool_name="p", device_name=f"gpu-{n}"),),
        updated_at=WHEN,
    )


LEGACY = Checkpoint(
    boot_id="boot-a",
    claims={uid(n): record(n) for n in range(3)},
    gpus={"GPU-1": GpuRecord(time_slice=2)},
)


def store_at(directory: Path, boot_id: str = "boot-a") -> CheckpointStore:
    return CheckpointStore(directory, boot_id_reader=lambda: boot_id, clock=lambda: WHEN)


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    (tmp_path / LEGACY_CHECKPOINT_FILE).write_bytes(encode_checkpoint(LEGACY))
    return tmp_path / CHECKPOINT_DIR


def test_a_legacy_checkpoint_is_split_into_files_and_removed(directory: Path) -> None:
    result = store_at(directory).load()
    assert result.outcome is LoadOutcome.LOADED
    assert result.checkpoint == LEGACY
    assert read_state(directory) == LEGACY
    assert sorted(os.listdir(directory / CLAIMS)) == [f"{uid(n)}.json" for n in range(3)]
    assert os.listdir(directory / GPUS) == ["GPU-1.json"]
    assert not (directory.parent / LEGACY_CHECKPOINT_FILE).exists()


def test_a_legacy_checkpoint_of_an_earlier_boot_is_discarded(directory: Path) -> None:
    result = store_at(directory, boot_id="boot-b").load()
    assert result.outcome is LoadOutcome.BOOT_CHANGED
    assert sorted(result.discarded) == sorted(LEGACY.claims)
    assert result.checkpoint.claims == {}
    assert os.listdir(directory / CLAIMS) == []
    assert not (directory.parent / LEGACY_CHECKPOINT_FILE).exists()


def test_a_corrupt_legacy_checkpoint_is_quarantined(directory: Path) -> None:
    legacy = directory.parent / LEGACY_CHECKPOINT_FILE
    legacy.write_bytes(b"{not json")
    result = store_at(directory).load_or_quarantine()
    assert result.outcome is LoadOutcome.QUARANTINED
    assert result.quarantined_to == legacy.with_name(
        f"{LEGACY_CHECKPOINT_FILE}.corrupt-20260301T123000.000000Z"
    )
    assert result.checkpoint.claims == {}
    assert not legacy.exists()


_MIGRATING = """
import sys
from pathlib import Path
from drasil.driver.checkpoint import CheckpointStore

CheckpointStore(Path(sys.argv[1]), boot_id_reader=lambda: "boot-a").load()
"""


@pytest.mark.parametrize(
    "point",
    ["checkpoint-mid-write", "checkpoint-after-rename", "checkpoint-legacy-before-remove"],
)
def test_an_interrupted_migration_is_done_again(directory: Path, point: str) -> None:
    env = {**os.environ, CRASH_ENV: point}
    argv = [sys.executable, "-c", _MIGRATING, str(directory)]
    assert subprocess.run(argv, env=env, check=False, timeout=60).returncode == CRASH_EXIT_CODE
    assert (directory.parent / LEGACY_CHECKPOINT_FILE).exists()  # still the truth

    result = store_at(directory).load()

    assert result.outcome is LoadOutcome.LOADED
    assert result.checkpoint == LEGACY
    assert not (directory.parent / LEGACY_CHECKPOINT_FILE).exists()


def test_a_migration_adds_to_what_the_directory_holds(directory: Path) -> None:
    store = store_at(directory)
    store.load()
    store.mark_started(uid(77), namespace="team-a", name="prepared-since")
    # An earlier plugin, serving beside this one, writes its file again.
    stale = LEGACY.model_copy(update={"claims": {uid(0): record(0)}})
    (directory.parent / LEGACY_CHECKPOINT_FILE).write_bytes(encode_checkpoint(stale))

    assert store.reload_if_changed()  # a running instance takes it in at once

    assert sorted(store.claims()) == sorted([*LEGACY.claims, uid(77)])
    assert not (directory.parent / LEGACY_CHECKPOINT_FILE).exists()
    assert store_at(directory).load().checkpoint == store.checkpoint

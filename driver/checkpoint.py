"""The checkpoint store: the plugin's durable record of prepared claims.

The checkpoint is a directory (layout in ``drasil.api.checkpoint``): one file per claim
(``claims/<uid>.json``) and per GPU (``gpus/<uuid>.json``), each written whole with
``write_atomic``, so a change writes one small file whatever the number of claims the
node holds. Every change is on disk before the in-memory copy changes, so memory never
runs ahead of disk. Removing a claim first replaces its file with a tombstone, then
unlinks it: a crash leaves the record or its tombstone, never a torn file, and the
crash points are those of a write. A lock makes the store safe between threads of one
process; between processes (two plugin instances in a rolling update) the caller holds
a ``drasil.driver.files.FileLock`` around prepare and unprepare, which also covers the
store.

``generation`` in the directory tells another instance that something changed: each
change overwrites it with this instance's id and a counter *before* it writes the
record, so an instance that sees its own last value knows nothing else changed, with
one small read and no directory scan.

Crash points (see ``drasil.driver.files``): ``checkpoint-mid-write``,
``checkpoint-before-rename``, ``checkpoint-after-rename`` (every claim and GPU file
write, the tombstone of a removal included), and ``checkpoint-legacy-before-remove``
(a migrated ``checkpoint.json`` about to be removed).

The directory's files (names, reading, the generation file) and the records of what a
load found are ``drasil.driver.checkpointdisk``'s; this module is the store that keeps
memory and disk in step. ``CheckpointStore`` stays one class: loading, re-reading, restoring and
migrating all change the same in-memory records and device index under one lock.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Final

from drasil.api.checkpoint import (
    Checkpoint,
    CheckpointError,
    ClaimRecord,
    ClaimState,
    CorruptCheckpoint,
    GpuRecord,
    PreparedDevice,
    decode_checkpoint,
    encode_claim_file,
    encode_gpu_file,
)
from drasil.driver.checkpointdisk import (
    CLAIMS,
    FILE_MODE,
    GENERATION,
    GPUS,
    Disk,
    GenerationFile,
    LoadFindings,
    LoadResult,
    key_file,
    key_of,
    read_checkpoint_file,
    read_disk,
)
from drasil.driver.files import (
    fsync_directory,
    move_aside,
    remove_file,
    sweep_temp_files,
    write_atomic,
)

__all__ = [
    "BOOT_ID_PATH",
    "CHECKPOINT_DIR",
    "LEGACY_CHECKPOINT_FILE",
    "CheckpointStore",
    "CorruptCheckpoint",
    "read_boot_id",
    "use_boot_id_file",
]

log = logging.getLogger(__name__)

CHECKPOINT_DIR: Final = "checkpoint"
LEGACY_CHECKPOINT_FILE: Final = "checkpoint.json"
"""The single-file checkpoint of earlier drasil, beside the directory; migrated at load."""
BOOT_ID_PATH: Final = Path("/proc/sys/kernel/random/boot_id")
_CRASH_TAG: Final = "checkpoint"


class _BootIdSource:
    """Where this process reads the boot id: one place for the checkpoint and the
    simulated GPUs alike."""

    path: Path = BOOT_ID_PATH


def use_boot_id_file(path: Path) -> None:
    """Read the boot id from ``path`` from now on (the plugin's ``--boot-id-file``):
    a test rig simulates a node reboot by writing a new id there."""
    _BootIdSource.path = path


def read_boot_id() -> str:
    """The id of the current boot (the kernel's unless ``use_boot_id_file`` said
    otherwise); it changes with every reboot."""
    return _BootIdSource.path.read_text(encoding="ascii").strip()


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _device_name(device: PreparedDevice) -> str:
    return device.device_name


class CheckpointStore:
    """Load and change the checkpoint in ``directory``; call ``load`` first."""

    def __init__(
        self,
        directory: Path,
        *,
        boot_id_reader: Callable[[], str] = read_boot_id,
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        self.directory = directory
        self.legacy_path = directory.parent / LEGACY_CHECKPOINT_FILE
        self._claims_dir = directory / CLAIMS
        self._gpus_dir = directory / GPUS
        self._generation = GenerationFile(directory / GENERATION)
        self._boot_id_reader = boot_id_reader
        self._clock = clock
        self._lock = threading.Lock()
        self._boot_id: str | None = None  # None until load
        self._claims: dict[str, ClaimRecord] = {}
        self._gpus: dict[str, GpuRecord] = {}
        self._device_key: Callable[[PreparedDevice], str] = _device_name
        self._holders: dict[str, set[str]] = {}  # device key -> UIDs of claims holding it
        self._instance = secrets.token_hex(8)
        self._changes = 0
        self._seen: bytes | None = None  # the generation we last wrote or read

    # --- reading ----------------------------------------------------------------------

    @property
    def checkpoint(self) -> Checkpoint:
        """A copy of the whole checkpoint as last written."""
        with self._lock:
            return self._snapshot()

    def claims(self) -> Mapping[str, ClaimRecord]:
        """All recorded claims by UID: a read-only copy."""
        with self._lock:
            self._require_loaded()
            return MappingProxyType(dict(self._claims))

    def get(self, claim_uid: str) -> ClaimRecord | None:
        """The record of one claim, or ``None``."""
        self._require_loaded()
        return self._claims.get(claim_uid)

    def gpus(self) -> Mapping[str, GpuRecord]:
        """What prepared claims changed on each GPU, by GPU UUID: a read-only copy."""
        with self._lock:
            self._require_loaded()
            return MappingProxyType(dict(self._gpus))

    def index_devices(self, key: Callable[[PreparedDevice], str]) -> None:
        """Index the recorded claims' devices by ``key`` (default: the device name).

        ``holding`` answers from the index. The Preparer keys devices by their physical
        GPU, so that the claims that could conflict with a new one are found without
        looking at every claim the node holds.
        """
        with self._lock:
            self._device_key = key
            self._reindex()

    def holding(self, keys: Iterable[str]) -> dict[str, ClaimRecord]:
        """The recorded claims with a device whose key is one of ``keys``."""
        with self._lock:
            self._require_loaded()
            uids = set().union(*(self._holders.get(k, ()) for k in keys))
            return {uid: self._claims[uid] for uid in uids if uid in self._claims}

    # --- loading ----------------------------------------------------------------------

    def load(self) -> LoadResult:
        """Read the directory; raises ``CheckpointError`` at the first unusable file."""
        with self._lock:
            return self._load(quarantine=False)

    def load_or_quarantine(self) -> LoadResult:
        """Read the directory; each unusable file is moved aside, the rest is used.

        The plugin keeps serving and turns ``detail`` into an Event; a bad file stays
        at its ``quarantined`` path (``<name>.corrupt-<time>``) for a human to inspect.
        One damaged claim file costs that claim's record, not the node's.
        """
        with self._lock:
            return self._load(quarantine=True)

    def reload_if_changed(self) -> bool:
        """Re-read the directory if another process changed it since we last did.

        Two plugin instances run side by side during a rolling update; each changes
        the checkpoint under the shared FileLock after this check, so neither acts
        on a stale view of the other's claims.
        """
        with self._lock:
            if self._boot_id is None:
                self._load(quarantine=False)
                return True
            if self.legacy_path.exists():  # written by an earlier drasil beside us
                self._migrate_legacy(self._require_loaded(), quarantine=True, found=LoadFindings())
                self._reread()
                return True
            generation = self._read_generation()
            if generation is not None and generation == self._seen:
                return False
            if not (self._claims_dir.is_dir() and self._gpus_dir.is_dir()):
                self._restore()
                return True
            self._reread()
            return True

    # --- changing ---------------------------------------------------------------------

    def mark_started(
        self,
        claim_uid: str,
        *,
        namespace: str,
        name: str,
        devices: Iterable[PreparedDevice] = (),
    ) -> ClaimRecord:
        """Record that prepare of a claim began (before its first side effect)."""
        record = ClaimRecord(
            namespace=namespace,
            name=name,
            state=ClaimState.PREPARE_STARTED,
            devices=tuple(devices),
            updated_at=self._clock(),
        )
        with self._lock:
            self._require_loaded()
            self._put(claim_uid, record)
        return record

    def mark_completed(self, claim_uid: str, devices: Iterable[PreparedDevice]) -> ClaimRecord:
        """Record the devices a finished prepare returned; the claim must be started."""
        with self._lock:
            self._require_loaded()
            started = self._claims.get(claim_uid)
            if started is None:
                raise CheckpointError(f"claim {claim_uid}: completed without being started")
            record = ClaimRecord(
                namespace=started.namespace,
                name=started.name,
                state=ClaimState.PREPARE_COMPLETED,
                devices=tuple(devices),
                updated_at=self._clock(),
            )
            self._put(claim_uid, record)
        return record

    def replace_devices(self, claim_uid: str, devices: Iterable[PreparedDevice]) -> ClaimRecord:
        """Record more about a claim's devices in one write, its state kept (an earlier
        drasil's record completed at start); the claim must be recorded."""
        with self._lock:
            self._require_loaded()
            before = self._claims.get(claim_uid)
            if before is None:
                raise CheckpointError(f"claim {claim_uid}: not recorded")
            record = before.model_copy(
                update={"devices": tuple(devices), "updated_at": self._clock()}
            )
            self._put(claim_uid, record)
        return record

    def set_gpu(self, gpu_uuid: str, record: GpuRecord | None) -> None:
        """Record (or, with None or an empty record, forget) one GPU's changed state."""
        with self._lock:
            self._require_loaded()
            keep = record is not None and record != GpuRecord()
            if keep and record is not None:
                if self._gpus.get(gpu_uuid) != record:
                    self._write_gpu(gpu_uuid, record)
                    self._gpus[gpu_uuid] = record
            elif gpu_uuid in self._gpus:
                self._bump()
                key_file(self._gpus_dir, gpu_uuid).unlink(missing_ok=True)
                del self._gpus[gpu_uuid]

    def remove(self, claim_uid: str) -> bool:
        """Forget a claim; returns whether it was recorded (no write when it was not)."""
        with self._lock:
            self._require_loaded()
            before = self._claims.get(claim_uid)
            if before is None:
                return False
            # The tombstone is the removal: from here the claim counts as absent. The
            # unlink only tidies; a crash before it leaves the tombstone to load.
            self._write_claim(claim_uid, None)
            del self._claims[claim_uid]
            self._unindex(claim_uid, before)
            key_file(self._claims_dir, claim_uid).unlink(missing_ok=True)
        return True

    # --- internals --------------------------------------------------------------------

    def _where(self) -> dict[str, str]:
        return {"path": str(self.directory)}

    def _require_loaded(self) -> str:
        if self._boot_id is None:
            raise CheckpointError(f"{self.directory}: load() the checkpoint before using it")
        return self._boot_id

    def _snapshot(self) -> Checkpoint:
        return Checkpoint(
            boot_id=self._require_loaded(), claims=dict(self._claims), gpus=dict(self._gpus)
        )

    def _put(self, claim_uid: str, record: ClaimRecord) -> None:
        self._write_claim(claim_uid, record)
        before = self._claims.get(claim_uid)
        self._claims[claim_uid] = record
        if before is not None:
            self._unindex(claim_uid, before)
        self._add_holder(claim_uid, record)

    def _write_claim(self, claim_uid: str, record: ClaimRecord | None) -> None:
        self._bump()
        self._store_claim(claim_uid, record, self._require_loaded())

    def _write_gpu(self, gpu_uuid: str, record: GpuRecord) -> None:
        self._bump()
        self._store_gpu(gpu_uuid, record, self._require_loaded())

    def _store_claim(self, claim_uid: str, record: ClaimRecord | None, boot_id: str) -> None:
        path = key_file(self._claims_dir, claim_uid)
        self._write(path, encode_claim_file(claim_uid, record, boot_id=boot_id))

    def _store_gpu(self, gpu_uuid: str, record: GpuRecord, boot_id: str) -> None:
        path = key_file(self._gpus_dir, gpu_uuid)
        self._write(path, encode_gpu_file(gpu_uuid, record, boot_id=boot_id))

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        # No fsync: what must survive is a plugin crash, which keeps the page cache.
        # A power loss or kernel crash is a reboot, and a new boot id discards the
        # prepared state anyway (a torn file is quarantined). fsync would cost two
        # disk flushes on every prepare for nothing.
        write_atomic(path, data, mode=FILE_MODE, crash_tag=_CRASH_TAG, durable=False)

    def _bump(self) -> None:
        """Tell other instances that something changes, before it does."""
        self._changes += 1
        generation = f"{self._instance}-{self._changes:016x}".encode("ascii")  # fixed width
        try:
            self._generation.write(generation)
        except FileNotFoundError:
            self._restore()
            return
        self._seen = generation

    def _read_generation(self) -> bytes | None:
        return self._generation.read()

    def _make_dirs(self) -> bool:
        """Create the directory tree; returns whether the checkpoint directory existed."""
        existed = self.directory.is_dir()
        for folder in (self._claims_dir, self._gpus_dir):
            if not folder.is_dir():
                folder.mkdir(parents=True, exist_ok=True, mode=0o700)
                fsync_directory(folder.parent)
        if not existed:
            fsync_directory(self.directory.parent)
        return existed

    def _restore(self) -> None:
        """Write everything in memory back into a recreated directory.

        The directory was deleted under us (a careless clean-up): memory mirrors what
        was on disk, so write it back rather than forget claims whose devices are
        still in use.
        """
        log.error("checkpoint directory vanished; rewritten from memory", extra=self._where())
        self._make_dirs()
        self._bump()
        # Written over whatever is left, never deleting: a part of the tree that
        # survived may hold records another instance wrote.
        self._write_records(self._claims, self._gpus, self._require_loaded())

    def _write_records(
        self, claims: Mapping[str, ClaimRecord], gpus: Mapping[str, GpuRecord], boot_id: str
    ) -> None:
        for uid, record in claims.items():
            self._store_claim(uid, record, boot_id)
        for uuid, gpu in gpus.items():
            self._store_gpu(uuid, gpu, boot_id)

    def _load(self, *, quarantine: bool) -> LoadResult:
        boot_id = self._boot_id_reader()
        existed = self._make_dirs()
        found = LoadFindings()
        self._check_generation(quarantine=quarantine, found=found)
        migrated = self._migrate_legacy(boot_id, quarantine=quarantine, found=found)
        # A crash between a temp write and its rename leaves a temp file; the caller
        # holds the FileLock at load, so no live writer owns one.
        for folder in (self._claims_dir, self._gpus_dir):
            sweep_temp_files(folder, prefix="")
        sweep_temp_files(self.directory.parent, prefix=f"{LEGACY_CHECKPOINT_FILE}.")
        disk = read_disk(self.directory)
        for path, err in disk.unreadable:
            if not quarantine:
                raise type(err)(f"{path}: {err}") from err
            found.quarantine(self._quarantine(path), f"{path.name}: {err}")
        for path in disk.tombstones:  # removals a crash interrupted: finish them
            path.unlink(missing_ok=True)
        claims, gpus = self._current_boot(disk, boot_id, found)
        self._boot_id, self._claims, self._gpus = boot_id, claims, gpus
        self._reindex()
        self._seen = self._read_generation()
        if self._seen is None:
            self._bump()
        return found.result(self._snapshot(), missing=not existed and not migrated, boot_id=boot_id)

    def _check_generation(self, *, quarantine: bool, found: LoadFindings) -> None:
        """A ``generation`` that is not a regular file (a directory, a FIFO) is moved
        aside like a corrupt file: every change writes it, so it would stop them all."""
        try:
            self._read_generation()
        except CheckpointError as err:
            path = self._generation.path
            if not quarantine:
                raise type(err)(f"{path}: {err}") from err
            found.quarantine(self._quarantine(path), f"{path.name}: {err}")

    def _current_boot(
        self, disk: Disk, boot_id: str, found: LoadFindings
    ) -> tuple[dict[str, ClaimRecord], dict[str, GpuRecord]]:
        """The records of this boot; those of an earlier one are removed from disk
        (each on its own, so a crash half-way leaves the rest to the next load)."""
        claims: dict[str, ClaimRecord] = {}
        for uid, claim in disk.claims.items():
            assert claim.record is not None  # tombstones are not in disk.claims
            if claim.boot_id == boot_id:
                claims[uid] = claim.record
            else:
                found.discard(uid, claim.record, claim.boot_id)
                key_file(self._claims_dir, uid).unlink(missing_ok=True)
        gpus: dict[str, GpuRecord] = {}
        for uuid, gpu in disk.gpus.items():
            if gpu.boot_id == boot_id:
                gpus[uuid] = gpu.record
            else:
                found.previous_boot = found.previous_boot or gpu.boot_id
                key_file(self._gpus_dir, uuid).unlink(missing_ok=True)
        return claims, gpus

    def _migrate_legacy(self, boot_id: str, *, quarantine: bool, found: LoadFindings) -> bool:
        """Split a single-file checkpoint (earlier drasil) into the directory.

        Its records are written into the directory, over those of the same keys, and
        only then is the file removed, so a migration a crash interrupted is simply
        done again. Records the directory holds besides are kept: an earlier plugin
        serving beside this one (a rolling update) may write the file again, and
        what this instance prepared meanwhile must not be lost; an entry kept too many
        is removed by the stale-claim pass. Returns whether there was a file.
        """
        try:
            legacy = decode_checkpoint(read_checkpoint_file(self.legacy_path))
        except FileNotFoundError:
            return False
        except CheckpointError as err:
            if not quarantine:
                raise type(err)(f"{self.legacy_path}: {err}") from err
            found.quarantine(self._quarantine(self.legacy_path), f"{self.legacy_path.name}: {err}")
            return True
        keep = legacy.boot_id == boot_id
        if not keep:
            for uid, record in legacy.claims.items():
                found.discard(uid, record, legacy.boot_id)
        self._bump()
        if keep:
            self._write_records(legacy.claims, legacy.gpus, boot_id)
        remove_file(self.legacy_path, crash_tag=f"{_CRASH_TAG}-legacy")
        log.info("checkpoint.json migrated into the checkpoint directory", extra=self._where())
        return True

    def _reread(self) -> None:
        """Take what another instance wrote; a file damaged under us is moved aside and
        our record of it written back (its devices stay reserved)."""
        disk = read_disk(self.directory)
        restored: list[str] = []
        for path, err in disk.unreadable:
            moved = self._quarantine(path)
            log.error(
                "checkpoint file corrupted while running; quarantined",
                extra={"path": str(path), "error": str(err), "moved_to": str(moved)},
            )
            restored.append(key_of(path))
        claims = {uid: c.record for uid, c in disk.claims.items() if c.record is not None}
        gpus = {uuid: g.record for uuid, g in disk.gpus.items()}
        boot_id = self._require_loaded()
        for key in restored:
            if key in self._claims and key not in claims:
                claims[key] = self._claims[key]
                self._store_claim(key, claims[key], boot_id)
            if key in self._gpus and key not in gpus:
                gpus[key] = self._gpus[key]
                self._store_gpu(key, gpus[key], boot_id)
        self._claims, self._gpus = claims, gpus
        self._reindex()
        self._seen = self._read_generation()
        if self._seen is None or restored:
            self._bump()

    def _quarantine(self, path: Path) -> Path:
        """Move ``path`` aside for a person (``files.move_aside``), at the store's time."""
        return move_aside(path, now=self._clock())

    def _reindex(self) -> None:
        self._holders = {}
        for uid, record in self._claims.items():
            self._add_holder(uid, record)

    def _add_holder(self, uid: str, record: ClaimRecord) -> None:
        for device in record.devices:
            self._holders.setdefault(self._device_key(device), set()).add(uid)

    def _unindex(self, uid: str, record: ClaimRecord) -> None:
        for device in record.devices:
            self._holders.get(self._device_key(device), set()).discard(uid)

"""The checkpoint store: the plugin's durable record of prepared claims.

Every mutation rewrites the whole file with ``write_atomic`` before the in-memory copy
changes, so memory never runs ahead of disk. Only the record that changed is encoded:
the store keeps every record's bytes from the write that made it
(``drasil.api.checkpoint.assemble_checkpoint``), so what a write costs beyond the rename
is copying and hashing bytes, not serializing every claim the node holds. A lock makes the store
safe between threads of one process; between processes (two plugin instances in a
rolling update) the caller holds a ``drasil.driver.files.FileLock`` around prepare
and unprepare, which also covers the store.

Crash points (see ``drasil.driver.files``): ``checkpoint-mid-write``,
``checkpoint-before-rename``, ``checkpoint-after-rename``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
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
    assemble_checkpoint,
    decode_checkpoint,
    encode_entry,
)
from drasil.driver.files import fsync_directory, sweep_temp_files, write_atomic

__all__ = [
    "BOOT_ID_PATH",
    "CHECKPOINT_FILE",
    "CheckpointStore",
    "CorruptCheckpoint",
    "LoadOutcome",
    "LoadResult",
    "read_boot_id",
]

log = logging.getLogger(__name__)

CHECKPOINT_FILE: Final = "checkpoint.json"
BOOT_ID_PATH: Final = Path("/proc/sys/kernel/random/boot_id")
_CRASH_TAG: Final = "checkpoint"


def read_boot_id() -> str:
    """The kernel's id of the current boot; it changes with every reboot."""
    return BOOT_ID_PATH.read_text(encoding="ascii").strip()


def _utcnow() -> datetime:
    return datetime.now(UTC)


class LoadOutcome(StrEnum):
    """What ``load`` found on disk."""

    LOADED = "Loaded"
    MISSING = "Missing"
    BOOT_CHANGED = "BootChanged"
    QUARANTINED = "Quarantined"


@dataclass(frozen=True)
class LoadResult:
    """The checkpoint in force after ``load`` and why it looks the way it does.

    ``discarded`` holds the claims of a checkpoint from an earlier boot: their CDI
    specs lived in tmpfs and are gone, but other state they left may need cleaning.
    ``quarantined_to`` and ``detail`` explain a corrupt file, for the Event.
    """

    checkpoint: Checkpoint
    outcome: LoadOutcome
    discarded: Mapping[str, ClaimRecord] = field(default_factory=dict)
    quarantined_to: Path | None = None
    detail: str = ""


def _device_name(device: PreparedDevice) -> str:
    return device.device_name


def _signature(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns)


class CheckpointStore:
    """Load and mutate the checkpoint at ``path``; call ``load`` first."""

    def __init__(
        self,
        path: Path,
        *,
        boot_id_reader: Callable[[], str] = read_boot_id,
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        self.path = path
        self._boot_id_reader = boot_id_reader
        self._clock = clock
        self._lock = threading.Lock()
        self._current: Checkpoint | None = None
        self._encoded: dict[str, bytes] = {}  # each claim of _current as stored
        self._device_key: Callable[[PreparedDevice], str] = _device_name
        self._holders: dict[str, set[str]] = {}  # device key -> UIDs of claims holding it
        self._seen: tuple[int, int] | None = None  # (inode, mtime_ns) of the file we know

    @property
    def checkpoint(self) -> Checkpoint:
        """The checkpoint as last written (treat as read-only)."""
        return self._loaded()

    def claims(self) -> Mapping[str, ClaimRecord]:
        """All recorded claims by UID, read-only."""
        return MappingProxyType(self._loaded().claims)

    def get(self, claim_uid: str) -> ClaimRecord | None:
        """The record of one claim, or ``None``."""
        return self._loaded().claims.get(claim_uid)

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
        claims = self._loaded().claims
        with self._lock:
            uids = set().union(*(self._holders.get(k, ()) for k in keys))
        return {uid: claims[uid] for uid in uids if uid in claims}

    def load(self) -> LoadResult:
        """Read the file; raises ``CheckpointError`` when it cannot be used."""
        with self._lock:
            return self._load()

    def load_or_quarantine(self) -> LoadResult:
        """Read the file; an unusable one is moved aside and an empty checkpoint used.

        The plugin keeps serving on a fresh checkpoint and turns ``detail`` into an
        Event; the bad file stays at ``quarantined_to`` for a human to inspect.
        """
        with self._lock:
            try:
                return self._load()
            except CheckpointError as err:
                moved = self._quarantine()
                self._use(self._empty())
                return LoadResult(
                    self._loaded(), LoadOutcome.QUARANTINED, quarantined_to=moved, detail=str(err)
                )

    def reload_if_changed(self) -> bool:
        """Re-read the file if another process replaced it since we last read or wrote it.

        Two plugin instances run side by side during a rolling update; each mutates
        under the shared FileLock after this check, so neither overwrites the other's
        claims. Every write renames a new file into place, so the inode tells.
        """
        with self._lock:
            current, signature = self._current, _signature(self.path)
            if current is not None and signature == self._seen:
                return False
            if current is None:
                self._load()
                return True
            if signature is None:
                # Deleted under us (a careless clean-up): memory mirrors what was on
                # disk, so write it back rather than forget claims whose devices are
                # still in use.
                log.error("checkpoint file vanished; rewritten from memory", extra=self._where())
                self._save(current)
                return True
            try:
                self._load()
            except CheckpointError as err:
                moved = self._quarantine()
                log.error(
                    "checkpoint corrupted while running; quarantined and rewritten from memory",
                    extra={**self._where(), "error": str(err), "moved_to": str(moved)},
                )
                self._save(current)
            return True

    def _where(self) -> dict[str, str]:
        return {"path": str(self.path)}

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
            self._put(claim_uid, record)
        return record

    def mark_completed(self, claim_uid: str, devices: Iterable[PreparedDevice]) -> ClaimRecord:
        """Record the devices a finished prepare returned; the claim must be started."""
        with self._lock:
            started = self._loaded().claims.get(claim_uid)
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

    def gpus(self) -> Mapping[str, GpuRecord]:
        """What prepared claims changed on each GPU, by GPU UUID, read-only."""
        return MappingProxyType(self._loaded().gpus)

    def set_gpu(self, gpu_uuid: str, record: GpuRecord | None) -> None:
        """Record (or, with None or an empty record, forget) one GPU's changed state."""
        with self._lock:
            current = self._loaded()
            gpus = {uuid: rec for uuid, rec in current.gpus.items() if uuid != gpu_uuid}
            if record is not None and record != GpuRecord():
                gpus[gpu_uuid] = record
            if gpus != current.gpus:
                self._save(current.model_copy(update={"gpus": gpus}))

    def remove(self, claim_uid: str) -> bool:
        """Forget a claim; returns whether it was recorded (no write when it was not)."""
        with self._lock:
            current = self._loaded()
            if claim_uid not in current.claims:
                return False
            claims = {uid: rec for uid, rec in current.claims.items() if uid != claim_uid}
            encoded = {uid: data for uid, data in self._encoded.items() if uid != claim_uid}
            self._save(current.model_copy(update={"claims": claims}), encoded, changed=claim_uid)
        return True

    def _load(self) -> LoadResult:
        boot_id = self._boot_id_reader()
        # A crash between the temp write and the rename leaves a temp file; the caller
        # holds the FileLock at load, so no live writer owns one.
        sweep_temp_files(self.path.parent, prefix=f"{self.path.name}.")
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            self._use(self._empty(boot_id))
            return LoadResult(self._loaded(), LoadOutcome.MISSING)
        stored = decode_checkpoint(data)
        if stored.boot_id != boot_id:
            # Rebooted: CDI specs in tmpfs are gone and kubelet prepares again. Persist
            # the reset so a crash before the next mutation does not repeat it.
            self._save(self._empty(boot_id))
            return LoadResult(
                self._loaded(),
                LoadOutcome.BOOT_CHANGED,
                discarded=stored.claims,
                detail=f"boot id changed from {stored.boot_id} to {boot_id}",
            )
        self._use(stored)
        self._seen = _signature(self.path)
        return LoadResult(stored, LoadOutcome.LOADED)

    def _quarantine(self) -> Path:
        stamp = self._clock().astimezone(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        self.path.rename(target)
        fsync_directory(self.path.parent)
        return target

    def _put(self, claim_uid: str, record: ClaimRecord) -> None:
        current = self._loaded()
        claims = {**current.claims, claim_uid: record}
        encoded = {**self._encoded, claim_uid: encode_entry(claim_uid, record)}
        self._save(current.model_copy(update={"claims": claims}), encoded, changed=claim_uid)

    def _use(self, checkpoint: Checkpoint) -> None:
        """Make ``checkpoint`` (as read from disk, or empty) the one in memory."""
        self._current = checkpoint
        self._encoded = {uid: encode_entry(uid, rec) for uid, rec in checkpoint.claims.items()}
        self._reindex()

    def _reindex(self) -> None:
        self._holders = {}
        claims = self._current.claims if self._current is not None else {}
        for uid, record in claims.items():
            self._add_holder(uid, record)

    def _add_holder(self, uid: str, record: ClaimRecord) -> None:
        for device in record.devices:
            self._holders.setdefault(self._device_key(device), set()).add(uid)

    def _update_index(
        self, previous: Checkpoint | None, current: Checkpoint, uid: str | None
    ) -> None:
        """Index what changed from ``previous`` to ``current``: the claim ``uid`` (a
        store write changes one), or everything when the claims were replaced."""
        if previous is not None and previous.claims is current.claims:
            return
        if previous is None or uid is None:
            self._reindex()
            return
        if (before := previous.claims.get(uid)) is not None:
            for device in before.devices:
                self._holders.get(self._device_key(device), set()).discard(uid)
        if (after := current.claims.get(uid)) is not None:
            self._add_holder(uid, after)

    def _save(
        self,
        checkpoint: Checkpoint,
        encoded: dict[str, bytes] | None = None,
        *,
        changed: str | None = None,
    ) -> None:
        """Write ``checkpoint``; ``encoded`` holds its claims' bytes when they changed
        (None: they are those of the checkpoint in memory), ``changed`` the one UID
        whose record changed, if only one did."""
        if encoded is None:
            same = self._current is not None and checkpoint.claims is self._current.claims
            encoded = (
                self._encoded
                if same
                else {uid: encode_entry(uid, rec) for uid, rec in checkpoint.claims.items()}
            )
        # No fsync: what must survive is a plugin crash, which keeps the page cache.
        # A power loss or kernel crash is a reboot, and a new boot id discards the
        # prepared state anyway (a torn file is quarantined). fsync would cost two
        # disk flushes on every prepare for nothing.
        write_atomic(
            self.path,
            assemble_checkpoint(checkpoint, encoded),
            mode=0o600,
            crash_tag=_CRASH_TAG,
            durable=False,
        )
        previous, self._current, self._encoded = self._current, checkpoint, encoded
        self._update_index(previous, checkpoint, changed)
        self._seen = _signature(self.path)

    def _empty(self, boot_id: str | None = None) -> Checkpoint:
        return Checkpoint(boot_id=boot_id if boot_id is not None else self._boot_id_reader())

    def _loaded(self) -> Checkpoint:
        if self._current is None:
            raise CheckpointError(f"{self.path}: load() the checkpoint before using it")
        return self._current

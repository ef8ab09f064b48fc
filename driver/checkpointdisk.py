"""The checkpoint on disk: its files' names, reading and decoding them, the
``generation`` file, and what a load found there.

``drasil.driver.checkpoint.CheckpointStore`` reads the directory through ``read_disk``
(every claim and GPU file decoded and checked against its name, the unreadable ones
and the tombstones set apart) and writes the files this module names (``key_file``:
the key quoted, so a separator in a claim UID or GPU UUID cannot put its file anywhere
but in its folder). ``GenerationFile`` keeps the ``generation`` file open for the read
and write every change makes. ``read_state`` reads the directory for tests and people,
changing nothing. ``LoadResult`` (built by ``LoadFindings``) tells the plugin what a
load found besides the current records: an earlier boot's claims, quarantined files.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Final, TypeVar
from urllib.parse import quote, unquote

from drasil.api.checkpoint import (
    Checkpoint,
    CheckpointError,
    ClaimFile,
    ClaimRecord,
    CorruptCheckpoint,
    GpuFile,
    decode_claim_file,
    decode_gpu_file,
)
from drasil.driver import files

_F = TypeVar("_F", ClaimFile, GpuFile)

CLAIMS: Final = "claims"
GPUS: Final = "gpus"
GENERATION: Final = "generation"
_SUFFIX: Final = ".json"
FILE_MODE: Final = 0o600


class LoadOutcome(StrEnum):
    """What ``load`` found on disk."""

    LOADED = "Loaded"
    MISSING = "Missing"
    BOOT_CHANGED = "BootChanged"
    QUARANTINED = "Quarantined"


@dataclass(frozen=True)
class LoadResult:
    """The checkpoint in force after ``load`` and why it looks the way it does.

    ``discarded`` holds the claims of an earlier boot: their CDI specs lived in tmpfs
    and are gone, but other state they left may need cleaning. ``quarantined`` lists
    the unreadable files moved aside (``quarantined_to`` is the first) and ``detail``
    says why, for the Event; the other claims are loaded.
    """

    checkpoint: Checkpoint
    outcome: LoadOutcome
    discarded: Mapping[str, ClaimRecord] = field(default_factory=dict)
    quarantined: tuple[Path, ...] = ()
    detail: str = ""

    @property
    def quarantined_to(self) -> Path | None:
        return self.quarantined[0] if self.quarantined else None


@dataclass
class Disk:
    """What the directory holds, file by file."""

    claims: dict[str, ClaimFile] = field(default_factory=dict)
    gpus: dict[str, GpuFile] = field(default_factory=dict)
    tombstones: list[Path] = field(default_factory=list)
    unreadable: list[tuple[Path, CheckpointError]] = field(default_factory=list)


def open_checkpoint_file(path: Path, flags: int, mode: int = FILE_MODE) -> int:
    """Open the regular file at ``path`` (``drasil.driver.files.open_regular``);
    anything else is ``CorruptCheckpoint``, so that it is quarantined like a corrupt
    file, nothing at all ``FileNotFoundError`` (without ``O_CREAT``)."""
    try:
        return files.open_regular(path, flags, mode)
    except files.NotRegularFile as err:
        raise CorruptCheckpoint(str(err)) from err


def read_checkpoint_file(path: Path) -> bytes:
    """The content of the regular file at ``path`` (see ``open_checkpoint_file``)."""
    try:
        return files.read_regular(path)
    except files.NotRegularFile as err:
        raise CorruptCheckpoint(str(err)) from err


def _files(folder: Path) -> Iterator[Path]:
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.name.endswith(_SUFFIX):
            yield Path(entry.path)


def _decoded(
    folder: Path,
    decode: Callable[[bytes], _F],
    key: Callable[[_F], str],
    unreadable: list[tuple[Path, CheckpointError]],
) -> Iterator[tuple[Path, _F]]:
    """The folder's files decoded and checked against their names; the others
    (entries that are not regular files included) are added to ``unreadable``."""
    for path in _files(folder):
        try:
            item = decode(read_checkpoint_file(path))
            _check_name(path, key(item))
        except FileNotFoundError:  # removed between the listing and the read
            continue
        except CheckpointError as err:
            unreadable.append((path, err))
            continue
        yield path, item


def read_disk(directory: Path) -> Disk:
    disk = Disk()
    for path, claim in _decoded(
        directory / CLAIMS, decode_claim_file, lambda c: c.uid, disk.unreadable
    ):
        if claim.record is None:
            disk.tombstones.append(path)
        else:
            disk.claims[claim.uid] = claim
    for _, gpu in _decoded(directory / GPUS, decode_gpu_file, lambda g: g.uuid, disk.unreadable):
        disk.gpus[gpu.uuid] = gpu
    return disk


def _check_name(path: Path, key: str) -> None:
    if path.name != _file_name(key):
        raise CorruptCheckpoint(f"{key!r} does not match the file name")


def read_state(directory: Path) -> Checkpoint | None:
    """What the checkpoint directory holds, read without changing anything.

    For tests and people: no sweep, no quarantine, no migration; ``None`` when the
    directory does not exist; ``CheckpointError`` names the first unreadable file.
    ``boot_id`` is that of a file found ("" for none).
    """
    if not directory.is_dir():
        return None
    disk = read_disk(directory)
    if disk.unreadable:
        path, err = disk.unreadable[0]
        raise type(err)(f"{path}: {err}")
    boots = [c.boot_id for c in disk.claims.values()] + [g.boot_id for g in disk.gpus.values()]
    return Checkpoint(
        boot_id=boots[0] if boots else "",
        claims={uid: c.record for uid, c in disk.claims.items() if c.record is not None},
        gpus={uuid: g.record for uuid, g in disk.gpus.items()},
    )


def _file_name(key: str) -> str:
    # Claim UIDs and GPU UUIDs come from the API server and NVML; quoting keeps a
    # separator in one from putting its file anywhere but in its folder.
    return f"{quote(key, safe='')}{_SUFFIX}"


def key_of(path: Path) -> str:
    return unquote(path.name.removesuffix(_SUFFIX))


def key_file(folder: Path, key: str) -> Path:
    return folder / _file_name(key)


class GenerationFile:
    """The ``generation`` file, kept open: read and written on every state-lock
    acquisition and change, without a path lookup each time.

    A file that lost its name (deleted, or its directory removed) is opened again by
    name; that fails with ``FileNotFoundError`` when the directory is gone, and with
    ``CorruptCheckpoint`` when the name is not a regular file (``open_checkpoint_file``).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def read(self) -> bytes | None:
        """The value, or ``None`` when there is no such file."""
        fd = self._open(create=False)
        return None if fd is None else os.pread(fd, 64, 0)

    def write(self, value: bytes) -> None:
        """Overwrite the value in place (fixed width, so no truncation is needed)."""
        fd = self._open(create=True)
        assert fd is not None
        os.pwrite(fd, value, 0)

    def _open(self, *, create: bool) -> int | None:
        if self._fd is not None:
            if os.fstat(self._fd).st_nlink > 0:
                return self._fd
            self.close()
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        try:
            self._fd = open_checkpoint_file(self.path, flags, FILE_MODE)
        except FileNotFoundError:
            if create:
                raise
            return None
        return self._fd

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self.close()


@dataclass
class LoadFindings:
    """What a load came across besides the current records, for its ``LoadResult``."""

    discarded: dict[str, ClaimRecord] = field(default_factory=dict)
    previous_boot: str = ""
    quarantined: list[Path] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    def discard(self, uid: str, record: ClaimRecord, boot_id: str) -> None:
        self.discarded[uid] = record
        self.previous_boot = self.previous_boot or boot_id

    def quarantine(self, moved: Path, detail: str) -> None:
        self.quarantined.append(moved)
        self.details.append(detail)

    def result(self, checkpoint: Checkpoint, *, missing: bool, boot_id: str) -> LoadResult:
        if self.quarantined:
            outcome = LoadOutcome.QUARANTINED
            detail = "; ".join(self.details)
        elif self.previous_boot:
            # Rebooted: CDI specs in tmpfs are gone and kubelet prepares again.
            outcome = LoadOutcome.BOOT_CHANGED
            detail = f"boot id changed from {self.previous_boot} to {boot_id}"
        else:
            outcome = LoadOutcome.MISSING if missing else LoadOutcome.LOADED
            detail = ""
        return LoadResult(
            checkpoint,
            outcome,
            discarded=self.discarded,
            quarantined=tuple(self.quarantined),
            detail=detail,
        )

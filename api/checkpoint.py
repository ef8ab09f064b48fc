"""The kubelet plugin's checkpoint: which claims it prepared, as stored on disk.

A directory in the plugin state dir, one small file per claim and per GPU, so that
a change writes one file whatever the number of claims held (``drasil.driver.checkpoint``)::

    checkpoint/claims/<claimUID>.json
        {"version": 1, "bootId": "...", "uid": "<claimUID>",
         "claim": {"namespace": "...", "name": "...",
                   "state": "PrepareStarted" | "PrepareCompleted",
                   "devices": [{"requestNames": [...], "poolName": "...",
                                "deviceName": "...", "cdiDeviceIds": [...],
                                "shareId": "...", "mig": {...}, "staticMig": {...},
                                "partition": {...}, "vfio": {...},
                                "sharing": "MPS"}],
                   "updatedAt": "<RFC 3339>"},
         "checksum": "<sha256 hex>"}
    checkpoint/gpus/<GPU UUID>.json
        {"version": 1, "bootId": "...", "uuid": "<GPU UUID>",
         "gpu": {"mps": {...}, "timeSlice": 3, "previousTimeSlice": 0,
                 "computePartition": "CPX", "previousComputePartition": "SPX"},
         "checksum": "..."}
    checkpoint/gpus/pci%3A<bdf>.json
        {..., "uuid": "pci:<bdf>", "gpu": {"nativeDriver": "nvidia"}, ...}

A claim file whose ``claim`` is ``null`` is a tombstone: the claim is being removed and
counts as absent. Each file carries the boot id, so files of an earlier boot are told
apart one by one.

Earlier drasil kept the checkpoint in one document, ``checkpoint.json``, still read (to migrate
it into the directory)::

    {"version": 1, "bootId": "...", "checksum": "<sha256 hex>",
     "claims": {"<claimUID>": {<the claim record above>}},
     "gpus": {"<GPU UUID>": {<the GPU record above>}}}

``checksum`` is the SHA-256 of the canonical JSON (sorted keys, no whitespace, ASCII)
of the document without ``checksum``; it is checked on the raw parsed document, before
schema validation, so it covers fields this version does not know. A file is that
canonical JSON with ``checksum`` appended as the last key.

Compatibility policy:

- Unknown fields are tolerated and preserved. A plugin that is rolled back keeps the
  fields a newer plugin added to the document and to every claim record it does not
  rewrite; a record it rewrites is rebuilt from what it knows, because the unknown
  fields described the old record. So additive changes need no new ``version``.
- A change an older reader must not misread bumps ``version`` and adds a migration
  from the previous version to ``MIGRATIONS``. Documents are migrated on read and
  written in ``CHECKPOINT_VERSION``.
- A document newer than ``CHECKPOINT_VERSION`` cannot be read safely:
  ``UnsupportedCheckpointVersionError``. The same policy holds for the files of the
  directory with ``RECORD_VERSION``; they have no migrations yet.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, TypeVar

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

CHECKPOINT_VERSION: Final = 1
"""The single-file checkpoint's version (the earlier layout, still read to migrate)."""

RECORD_VERSION: Final = 1
"""The version of one file of the checkpoint directory (a claim's or a GPU's)."""

# The api layer may not import drasil.driver (pyproject.toml), so not drasil.driver.objects:
# a checkpoint document as read from the file and migrated in place.
Document = dict[str, Any]
Migration = Callable[[Document], Document]
"""Turns a document of version N into one of version N + 1 (without ``checksum``)."""

MIGRATIONS: Final[Mapping[int, Migration]] = {}
"""Migrations keyed by the version they read. Version 1 is the first on-disk format."""


_M = TypeVar("_M", bound=BaseModel)


class CheckpointError(ValueError):
    """A checkpoint document that cannot be used."""


class CorruptCheckpoint(CheckpointError):
    """Not JSON, a wrong checksum, or content that does not fit the schema."""


class UnsupportedCheckpointVersionError(CheckpointError):
    """Written by a newer drasil (or a version with no migration path)."""


class ClaimState(StrEnum):
    """How far prepare got; a ``PrepareStarted`` claim may have partial side effects."""

    PREPARE_STARTED = "PrepareStarted"
    PREPARE_COMPLETED = "PrepareCompleted"


class _Document(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="allow",
        # Records are shared between the plugin's threads; nobody edits one in place,
        # the store replaces it (and writes the file) instead.
        frozen=True,
    )


class MigState(StrEnum):
    """How far the MIG instance of a dynamic MIG device got (``--mig-mode dynamic``)."""

    CREATING = "Creating"  # written before NVML is asked; ids may be unknown
    CREATED = "Created"  # GPU and compute instance exist with the ids recorded


class MigRecord(_Document):
    """The MIG instance prepare cut for one device, recorded before and after creation.

    The placement (parent GPU, profile, start) identifies the instance even when a
    crash came before its ids were recorded: nothing else may hold that placement
    while this record exists.
    """

    parent_uuid: str
    profile: str
    profile_id: int
    placement_start: int
    placement_size: int
    state: MigState
    gpu_instance_id: int | None = Field(default=None, exclude_if=lambda value: value is None)
    compute_instance_id: int | None = Field(default=None, exclude_if=lambda value: value is None)
    uuid: str | None = Field(default=None, exclude_if=lambda value: value is None)


class StaticMigRecord(_Document):
    """The MIG instance a static MIG device is (``--mig-mode static``): the operator
    made it, so drasil never destroys it.

    Recorded so that after a change to ``--mig-mode dynamic`` the plugin keeps the
    instance while the claim holds it (the reconcile at start spares it) and refuses
    dynamic placements that overlap it. Added after ``version`` 1 was fixed: a reader
    that does not know it keeps it and ignores it, which is what it did before.
    """

    parent_uuid: str
    profile_id: int
    placement_start: int
    placement_size: int
    gpu_instance_id: int
    compute_instance_id: int
    uuid: str


class PartitionRecord(_Document):
    """The compute partition mode a prepared device needs its GPU in (AMD's dynamic
    partitions): while any claim records one, the GPU stays in that mode."""

    parent_uuid: str
    parent_bus_id: str
    mode: str
    index: int
    start: int
    size: int


class VfioRecord(_Document):
    """A GPU a prepared claim holds bound to vfio-pci for a virtual machine: its PCI
    function and its IOMMU group, whose every function is bound to vfio-pci with it."""

    bus_id: str
    iommu_group: int


class PreparedDevice(_Document):
    """One device of a prepared claim: what NodePrepareResources returned for it."""

    request_names: tuple[str, ...] = ()
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...] = ()
    share_id: str | None = Field(default=None, exclude_if=lambda value: value is None)
    # Admin-access results may share any device (docs/design.md#claims-and-configs).
    admin_access: bool = Field(default=False, exclude_if=lambda value: not value)
    mig: MigRecord | None = Field(default=None, exclude_if=lambda value: value is None)
    # Never a ``mig`` record: an earlier reader destroys the instance a ``mig`` names.
    static_mig: StaticMigRecord | None = Field(default=None, exclude_if=lambda value: value is None)
    partition: PartitionRecord | None = Field(default=None, exclude_if=lambda value: value is None)
    vfio: VfioRecord | None = Field(default=None, exclude_if=lambda value: value is None)
    # How a shared or time-sliced GPU is used ("MPS", "TimeSlicing/Long"): claims on
    # one GPU must agree, and the last one to go restores the GPU.
    sharing: str | None = Field(default=None, exclude_if=lambda value: value is None)


class ClaimRecord(_Document):
    """A claim the plugin has started or finished preparing."""

    namespace: str
    name: str
    state: ClaimState
    devices: tuple[PreparedDevice, ...] = ()
    updated_at: AwareDatetime


class MpsDaemonRecord(_Document):
    """The MPS control daemon the plugin runs for a shared GPU (``start_time`` is the
    process's start in clock ticks since boot, so a reused pid is not taken for it)."""

    pid: int
    start_time: int
    pipe_dir: str
    log_dir: str
    # The daemon's tmpfs, its /dev/shm and its clients' (absent in checkpoints written
    # before it existed).
    shm_dir: str | None = Field(default=None, exclude_if=lambda value: value is None)
    # The limits the daemon holds for every client (the largest share's), so a daemon
    # started again after a crash holds them too.
    memory_mib: int | None = Field(default=None, exclude_if=lambda value: value is None)
    thread_percentage: int | None = Field(default=None, exclude_if=lambda value: value is None)
    # Started with -multiuser-server for its claim's config (mpsConfig.multiUser), so
    # that one started again serves every user too.
    multi_user: bool = Field(default=False, exclude_if=lambda value: not value)


class GpuRecord(_Document):
    """What prepared claims changed on one GPU, to be undone when the last one goes."""

    mps: MpsDaemonRecord | None = Field(default=None, exclude_if=lambda value: value is None)
    time_slice: int | None = Field(default=None, exclude_if=lambda value: value is None)
    previous_time_slice: int | None = Field(default=None, exclude_if=lambda value: value is None)
    # NVML compute modes: EXCLUSIVE_PROCESS (3) while an MPS daemon runs on the GPU,
    # and the mode the GPU had before, put back after the daemon stops.
    compute_mode: int | None = Field(default=None, exclude_if=lambda value: value is None)
    previous_compute_mode: int | None = Field(default=None, exclude_if=lambda value: value is None)
    # AMD's compute partition mode (SPX, CPX, ...) that prepared claims switched the GPU
    # to, and the mode it had before the first of them (put back after the last).
    compute_partition: str | None = Field(default=None, exclude_if=lambda value: value is None)
    previous_compute_partition: str | None = Field(
        default=None, exclude_if=lambda value: value is None
    )
    # Kept under the key ``pci:<bdf>`` of a PCI function drasil bound to vfio-pci: the
    # driver it had before ("" for none), to bind it back to once no claim holds it.
    native_driver: str | None = Field(default=None, exclude_if=lambda value: value is None)


class Checkpoint(_Document):
    """The whole checkpoint, keyed by claim UID; ``gpus`` by GPU UUID."""

    version: int = CHECKPOINT_VERSION
    boot_id: str
    claims: dict[str, ClaimRecord] = Field(default_factory=dict)
    gpus: dict[str, GpuRecord] = Field(default_factory=dict, exclude_if=lambda value: not value)


def checksum(document: Mapping[str, Any]) -> str:
    """SHA-256 hex of the canonical JSON of ``document`` minus its ``checksum`` field."""
    rest = {key: value for key, value in document.items() if key != "checksum"}
    return hashlib.sha256(_canonical(rest)).hexdigest()


def _canonical(document: Mapping[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode(
        "ascii"
    )


def encode_checkpoint(checkpoint: Checkpoint) -> bytes:
    """The bytes of a single-file checkpoint (the earlier layout, read to migrate it)."""
    document = checkpoint.model_dump(mode="json")
    document["version"] = CHECKPOINT_VERSION
    return _seal(document)


def _seal(document: Document) -> bytes:
    """Canonical JSON of ``document`` with the checksum appended as the last key."""
    document.pop("checksum", None)
    canonical = _canonical(document)
    # Splicing the checksum in, rather than serializing twice; the result is still
    # deterministic JSON, and its checksum is that of the canonical document.
    digest = hashlib.sha256(canonical).hexdigest()
    return canonical[:-1] + f',"checksum":"{digest}"}}'.encode("ascii")


# --- the checkpoint directory: one file per claim and per GPU ------------------------


@dataclass(frozen=True)
class ClaimFile:
    """One claim's file; ``record`` is None in a tombstone (the claim is being removed)."""

    uid: str
    boot_id: str
    record: ClaimRecord | None


@dataclass(frozen=True)
class GpuFile:
    """One GPU's file: what prepared claims changed on it."""

    uuid: str
    boot_id: str
    record: GpuRecord


def encode_claim_file(uid: str, record: ClaimRecord | None, *, boot_id: str) -> bytes:
    """The bytes of ``claims/<uid>.json``; ``None`` encodes a tombstone."""
    claim = record.model_dump(mode="json") if record is not None else None
    return _seal({"version": RECORD_VERSION, "bootId": boot_id, "uid": uid, "claim": claim})


def encode_gpu_file(uuid: str, record: GpuRecord, *, boot_id: str) -> bytes:
    """The bytes of ``gpus/<uuid>.json``."""
    gpu = record.model_dump(mode="json")
    return _seal({"version": RECORD_VERSION, "bootId": boot_id, "uuid": uuid, "gpu": gpu})


def decode_claim_file(data: bytes) -> ClaimFile:
    """Parse a claim file: checksum, version, then the schema."""
    document = _open_record(data)
    uid = _string(document, "uid")
    claim = document.get("claim")
    record = None if claim is None else _validate(ClaimRecord, claim, "claim")
    return ClaimFile(uid=uid, boot_id=_string(document, "bootId"), record=record)


def decode_gpu_file(data: bytes) -> GpuFile:
    """Parse a GPU file: checksum, version, then the schema."""
    document = _open_record(data)
    record = _validate(GpuRecord, document.get("gpu"), "gpu")
    return GpuFile(
        uuid=_string(document, "uuid"), boot_id=_string(document, "bootId"), record=record
    )


def _summed(data: bytes) -> Document:
    """The stored object without its checksum, which must match the rest."""
    document = _parse_object(data)
    expected = document.pop("checksum", None)
    if not isinstance(expected, str):
        raise CorruptCheckpoint("checksum: missing or not a string")
    if expected != checksum(document):
        raise CorruptCheckpoint("checksum: does not match the content")
    return document


def _open_record(data: bytes) -> Document:
    document = _summed(data)
    version = document.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CorruptCheckpoint(f"version: {version!r} is not an integer")
    if version > RECORD_VERSION:
        raise UnsupportedCheckpointVersionError(
            f"version: {version} is newer than this drasil reads ({RECORD_VERSION})"
        )
    if version < RECORD_VERSION:
        raise UnsupportedCheckpointVersionError(f"version: no migration from {version}")
    return document


def _string(document: Document, key: str) -> str:
    value = document.get(key)
    if not isinstance(value, str) or not value:
        raise CorruptCheckpoint(f"{key}: {value!r} is not a non-empty string")
    return value


def _validate(model: type[_M], value: object, where: str) -> _M:
    try:
        return model.model_validate(value)
    except ValidationError as err:
        raise CorruptCheckpoint(f"schema: {where}.{_first_error(err)}") from err


def decode_checkpoint(
    data: bytes, *, migrations: Mapping[int, Migration] = MIGRATIONS
) -> Checkpoint:
    """Parse stored bytes: verify the checksum, migrate to the current version, validate."""
    document = migrate(_summed(data), migrations=migrations)
    try:
        return Checkpoint.model_validate(document)
    except ValidationError as err:
        raise CorruptCheckpoint(f"schema: {_first_error(err)}") from err


def migrate(document: Document, *, migrations: Mapping[int, Migration]) -> Document:
    """Apply migrations until ``document`` has ``CHECKPOINT_VERSION``."""
    version = document.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CorruptCheckpoint(f"version: {version!r} is not an integer")
    while version < CHECKPOINT_VERSION:
        step = migrations.get(version)
        if step is None:
            raise UnsupportedCheckpointVersionError(f"version: no migration from {version}")
        document = step(document)
        version += 1
        document["version"] = version
    if version > CHECKPOINT_VERSION:
        raise UnsupportedCheckpointVersionError(
            f"version: {version} is newer than this drasil reads ({CHECKPOINT_VERSION})"
        )
    return document


def _parse_object(data: bytes) -> Document:
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptCheckpoint(f"not JSON: {err}") from err
    except RecursionError:  # our checkpoints nest five levels; this one is damaged
        raise CorruptCheckpoint("nested too deeply to be a checkpoint") from None
    if not isinstance(document, dict):
        raise CorruptCheckpoint(f"not a JSON object but {type(document).__name__}")
    return document


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    location = ".".join(str(part) for part in first["loc"])
    return f"{location}: {first['msg']} ({err.error_count()} error(s))"

"""The checkpoint document: encoding, checksum, compatibility, migrations."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from drasil.api.checkpoint import (
    CHECKPOINT_VERSION,
    MIGRATIONS,
    Checkpoint,
    ClaimRecord,
    ClaimState,
    CorruptCheckpoint,
    PreparedDevice,
    StaticMigRecord,
    UnsupportedCheckpointVersionError,
    checksum,
    decode_checkpoint,
    encode_checkpoint,
)

UID = "0b7c3f2e-8d1a-4c55-9e0f-1a2b3c4d5e6f"
WHEN = datetime(2026, 3, 1, 12, 30, tzinfo=UTC)


def sample() -> Checkpoint:
    device = PreparedDevice(
        request_names=["gpu"],
        pool_name="node-a",
        device_name="gpu-0",
        cdi_device_ids=[f"k8s.gpu.drasil.dev/claim={UID}-gpu-0"],
    )
    shared = device.model_copy(update={"device_name": "gpu-1", "share_id": "s-1"})
    record = ClaimRecord(
        namespace="team-a",
        name="train",
        state=ClaimState.PREPARE_COMPLETED,
        devices=[device, shared],
        updated_at=WHEN,
    )
    return Checkpoint(boot_id="boot-a", claims={UID: record})


def sealed(document: dict[str, Any]) -> bytes:
    """Bytes of ``document`` with a correct checksum (for hand-written documents)."""
    document = {k: v for k, v in document.items() if k != "checksum"}
    return json.dumps({**document, "checksum": checksum(document)}).encode()


def test_round_trip() -> None:
    assert decode_checkpoint(encode_checkpoint(sample())) == sample()


def test_wire_shape() -> None:
    document = json.loads(encode_checkpoint(sample()))
    assert set(document) == {"version", "bootId", "claims", "checksum"}
    assert document["version"] == 1
    claim = document["claims"][UID]
    assert claim["state"] == "PrepareCompleted"
    assert claim["updatedAt"] == "2026-03-01T12:30:00Z"
    first, second = claim["devices"]
    assert first == {
        "requestNames": ["gpu"],
        "poolName": "node-a",
        "deviceName": "gpu-0",
        "cdiDeviceIds": [f"k8s.gpu.drasil.dev/claim={UID}-gpu-0"],
    }  # no shareId key when there is none
    assert second["shareId"] == "s-1"
    assert document["checksum"] == checksum(document)


def test_encoding_is_deterministic() -> None:
    assert encode_checkpoint(sample()) == encode_checkpoint(sample())
    record = sample().claims[UID]
    forward = Checkpoint(boot_id="b", claims={"a": record, "b": record})
    backward = Checkpoint(boot_id="b", claims={"b": record, "a": record})
    assert encode_checkpoint(forward) == encode_checkpoint(backward)


def test_checksum_mismatch() -> None:
    document = json.loads(encode_checkpoint(sample()))
    document["claims"][UID]["name"] = "tampered"
    with pytest.raises(CorruptCheckpoint, match="checksum: does not match"):
        decode_checkpoint(json.dumps(document).encode())


def test_single_flipped_byte_is_caught() -> None:
    data = bytearray(encode_checkpoint(sample()))
    data[data.index(b"gpu-0")] ^= 0x01
    with pytest.raises(CorruptCheckpoint):
        decode_checkpoint(bytes(data))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not JSON"),
        (b'{"version": 1, "bootId"', "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"version": 1, "bootId": "b", "claims": {}}', "checksum: missing"),
    ],
)
def test_unparsable(data: bytes, message: str) -> None:
    with pytest.raises(CorruptCheckpoint, match=message):
        decode_checkpoint(data)


def test_schema_violation_with_a_good_checksum() -> None:
    document = json.loads(encode_checkpoint(sample()))
    document["claims"][UID]["state"] = "Prepared?"
    with pytest.raises(CorruptCheckpoint, match=rf"schema: claims\.{UID}\.state"):
        decode_checkpoint(sealed(document))


def test_unknown_fields_are_read_and_preserved() -> None:
    document = json.loads(encode_checkpoint(sample()))
    document["nodeName"] = "node-a"
    document["claims"][UID]["sharing"] = {"strategy": "MPS"}
    document["claims"][UID]["devices"][0]["health"] = None
    checkpoint = decode_checkpoint(sealed(document))
    assert checkpoint.claims[UID].devices[0].device_name == "gpu-0"
    again = json.loads(encode_checkpoint(checkpoint))
    assert again["nodeName"] == "node-a"
    assert again["claims"][UID]["sharing"] == {"strategy": "MPS"}
    assert again["claims"][UID]["devices"][0]["health"] is None


def test_newer_version_is_refused() -> None:
    document = json.loads(encode_checkpoint(sample())) | {"version": CHECKPOINT_VERSION + 1}
    with pytest.raises(UnsupportedCheckpointVersionError, match="newer"):
        decode_checkpoint(sealed(document))


@pytest.mark.parametrize("version", [None, "1", 1.0, True])
def test_version_must_be_an_integer(version: object) -> None:
    document = json.loads(encode_checkpoint(sample())) | {"version": version}
    with pytest.raises(CorruptCheckpoint, match="version"):
        decode_checkpoint(sealed(document))


def test_every_older_version_has_a_migration() -> None:
    # Version 1 is the first on-disk format; a bump must register its migration.
    assert all(v in MIGRATIONS for v in range(1, CHECKPOINT_VERSION))


def _from_v0(document: dict[str, Any]) -> dict[str, Any]:
    """A made-up v0 format (a list of prepared claims) to exercise the mechanism."""
    claims = {
        c["uid"]: {
            "namespace": c["namespace"],
            "name": c["name"],
            "state": "PrepareCompleted",
            "devices": [],
            "updatedAt": "2026-01-01T00:00:00Z",
        }
        for c in document.pop("prepared")
    }
    return {**document, "bootId": document.pop("boot"), "claims": claims}


def test_older_document_is_migrated_on_read() -> None:
    v0 = {"version": 0, "boot": "b", "prepared": [{"uid": UID, "namespace": "n", "name": "c"}]}
    checkpoint = decode_checkpoint(sealed(v0), migrations={0: _from_v0})
    assert checkpoint.version == CHECKPOINT_VERSION
    assert checkpoint.boot_id == "b"
    assert checkpoint.claims[UID].state is ClaimState.PREPARE_COMPLETED
    assert json.loads(encode_checkpoint(checkpoint))["version"] == CHECKPOINT_VERSION


def test_older_document_without_migration_is_refused() -> None:
    with pytest.raises(UnsupportedCheckpointVersionError, match="no migration from 0"):
        decode_checkpoint(sealed({"version": 0, "boot": "b"}))


def test_records_are_immutable() -> None:
    record = sample().claims[UID]
    with pytest.raises(ValidationError, match="frozen"):
        record.name = "other"  # type: ignore[misc]
    assert isinstance(record.devices, tuple)
    assert isinstance(record.devices[0].cdi_device_ids, tuple)


def static_mig_sample() -> Checkpoint:
    site = StaticMigRecord(
        parent_uuid="GPU-1",
        profile_id=9,
        placement_start=4,
        placement_size=4,
        gpu_instance_id=2,
        compute_instance_id=0,
        uuid="MIG-2",
    )
    record = sample().claims[UID]
    device = record.devices[0].model_copy(
        update={"device_name": "gpu-0-mig-3g40gb-2-0", "static_mig": site}
    )
    return Checkpoint(
        boot_id="boot-a", claims={UID: record.model_copy(update={"devices": (device,)})}
    )


def test_a_static_mig_record_is_additive() -> None:
    """``staticMig`` is an optional field of version 1: an earlier reader keeps it as an
    unknown field (and never takes it for a ``mig`` record, whose instance it would
    destroy), and a record without it reads as before."""
    document = json.loads(encode_checkpoint(static_mig_sample()))
    assert document["version"] == 1
    (device,) = document["claims"][UID]["devices"]
    assert "mig" not in device
    assert device["staticMig"] == {
        "parentUuid": "GPU-1",
        "profileId": 9,
        "placementStart": 4,
        "placementSize": 4,
        "gpuInstanceId": 2,
        "computeInstanceId": 0,
        "uuid": "MIG-2",
    }
    assert decode_checkpoint(encode_checkpoint(static_mig_sample())) == static_mig_sample()
    assert decode_checkpoint(encode_checkpoint(sample())).claims[UID].devices[0].static_mig is None

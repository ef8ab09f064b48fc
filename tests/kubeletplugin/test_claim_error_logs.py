"""How a claim's failure is logged: an expected one (the claim's, or a fault the code
names, such as a name no claim can have) as one warning line naming the claim; only an
unexpected one (a bug) with its traceback, which operators read as a crash."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubelet_client import (
    DEADLINE,
    KubeNames,
    MemoryClaims,
    claim_json,
    make_preparer,
    result,
    serving,
)

from drasil.api.kubelet.dra.v1 import dra_pb2 as v1
from drasil.api.kubelet.dra.v1 import dra_pb2_grpc as v1_grpc
from drasil.driver.apierrors import ApiUnavailable
from drasil.kubeletplugin.dra import prepare
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.dra.service import ClaimWork, DRAPluginV1
from drasil.kubeletplugin.metrics import PluginMetrics

UID_GOOD = "0b7c3f2e-8d1a-4c55-9e0f-1a2b3c4d5e6f"
UID_BAD = "1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f9"


@contextmanager
def plugin(tmp_path: Path, reader: Any) -> Iterator[tuple[Preparer, Any]]:
    preparer = make_preparer(tmp_path, reader)
    work = ClaimWork(preparer, PluginMetrics())

    def add(server: grpc.Server) -> None:
        v1_grpc.add_DRAPluginServicer_to_server(DRAPluginV1(work), server)

    with serving(add) as (_, channel):
        yield preparer, v1_grpc.DRAPluginStub(channel)


def prepare_one(stub: Any, namespace: str, name: str, uid: str) -> str:
    claims = [v1.Claim(namespace=namespace, name=name, uid=uid)]
    response = stub.NodePrepareResources(
        v1.NodePrepareResourcesRequest(claims=claims), timeout=DEADLINE
    )
    error: str = response.claims[uid].error
    return error


def unprepare_one(stub: Any, namespace: str, name: str, uid: str) -> str:
    claims = [v1.Claim(namespace=namespace, name=name, uid=uid)]
    response = stub.NodeUnprepareResources(
        v1.NodeUnprepareResourcesRequest(claims=claims), timeout=DEADLINE
    )
    error: str = response.claims[uid].error
    return error


def failures(caplog: pytest.LogCaptureFixture, message: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == prepare.__name__ and r.msg == message]


def reader() -> MemoryClaims:
    return MemoryClaims(claim_json(UID_GOOD, result("gpu-1"), name="good", namespace="ml"))


def test_a_name_no_claim_can_have_is_one_warning_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    claims = reader()
    with plugin(tmp_path, claims) as (preparer, stub):
        preparer.claims = KubeNames(claims)
        with caplog.at_level(logging.DEBUG, logger=prepare.__name__):
            error = prepare_one(stub, "ml", "good?watch=true", UID_BAD)

    assert "is not a valid name" in error
    (record,) = failures(caplog, "prepare failed")
    assert record.levelno == logging.WARNING
    assert record.exc_info is None
    assert record.__dict__["claim"] == "ml/good?watch=true"
    assert record.__dict__["claimUID"] == UID_BAD
    assert record.__dict__["error"] == error


def test_an_api_server_away_is_one_warning_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims = reader()

    def away(*_: Any, **__: Any) -> Any:
        raise ApiUnavailable("connection refused")

    monkeypatch.setattr(claims, "get_claim", away)
    with plugin(tmp_path, claims) as (_, stub), caplog.at_level(logging.DEBUG):
        prepare_one(stub, "ml", "good", UID_GOOD)

    (record,) = failures(caplog, "prepare failed")
    assert record.levelno == logging.WARNING
    assert record.exc_info is None


def test_a_claim_not_found_is_one_warning_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with plugin(tmp_path, reader()) as (_, stub), caplog.at_level(logging.DEBUG):
        error = prepare_one(stub, "ml", "gone", UID_BAD)

    assert "not found" in error
    (record,) = failures(caplog, "prepare failed")
    assert record.levelno == logging.WARNING
    assert record.exc_info is None


def test_an_unexpected_prepare_fault_keeps_its_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def bug(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(prepare, "plan_prepare", bug)
    with plugin(tmp_path, reader()) as (_, stub), caplog.at_level(logging.DEBUG):
        error = prepare_one(stub, "ml", "good", UID_GOOD)

    assert "failed unexpectedly (RuntimeError: a bug)" in error
    (record,) = failures(caplog, "prepare failed")
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None
    assert record.exc_info[0] is RuntimeError
    assert record.__dict__["claimUID"] == UID_GOOD


@pytest.mark.parametrize("uid", ["../evil", "a" * 4000])
def test_an_unpreparable_uid_is_one_warning_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, uid: str
) -> None:
    with plugin(tmp_path, reader()) as (_, stub), caplog.at_level(logging.DEBUG):
        error = unprepare_one(stub, "ml", "evil", uid)
        prepared = prepare_one(stub, "ml", "evil", uid)

    assert error.startswith("unprepare of ResourceClaim ml/evil: ")
    assert "claimUID" in error
    if len(uid) > 128:  # refused as input, not as a file name the kernel turned down
        assert "4000 characters" in error
        assert "at most 128" in error
        assert "File name too long" not in error + prepared
    (record,) = failures(caplog, "unprepare failed")
    assert record.levelno == logging.WARNING
    assert record.exc_info is None  # no traceback
    assert record.__dict__["claimUID"] == uid
    assert all(r.exc_info is None for r in caplog.records)


def test_an_unexpected_unprepare_fault_keeps_its_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def bug(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(prepare, "delete_claim_spec", bug)
    with plugin(tmp_path, reader()) as (_, stub), caplog.at_level(logging.DEBUG):
        unprepare_one(stub, "ml", "good", UID_GOOD)

    (record,) = failures(caplog, "unprepare failed")
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None
    assert record.exc_info[0] is RuntimeError

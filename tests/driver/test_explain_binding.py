"""Explanations of allocated claims whose devices wait for binding conditions."""

from __future__ import annotations

from typing import Any

from drasil.driver.explain.binding import binding_waits

DRIVER = "gpu.drasil.dev"
OK, FAILED = "drasil.dev/Attached", "drasil.dev/AttachFailed"
T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z


def claim(conditions: list[dict[str, Any]] | None, *, timestamp: bool = True) -> dict[str, Any]:
    result = {"driver": DRIVER, "pool": "rack-a", "device": "fab-0", "request": "gpu",
              "bindingConditions": [OK], "bindingFailureConditions": [FAILED]}  # fmt: skip
    allocation: dict[str, Any] = {"devices": {"results": [result]}}
    if timestamp:
        allocation["allocationTimestamp"] = "2023-11-14T22:13:20Z"
    status: dict[str, Any] = {"allocation": allocation}
    if conditions is not None:
        entry = {"driver": DRIVER, "pool": "rack-a", "device": "fab-0", "conditions": conditions}
        status["devices"] = [entry]
    return {"metadata": {"namespace": "ml", "name": "c"}, "status": status}


def cond(kind: str, status: str, **extra: str) -> dict[str, Any]:
    return {"type": kind, "status": status, **extra}


def test_waiting_counts_from_the_allocation() -> None:
    assert binding_waits(claim(None), driver=DRIVER, now=T0 + 12) == [
        "waiting for attach of rack-a/fab-0 (12 s)"
    ]


def test_without_allocation_time_the_oldest_condition_counts() -> None:
    pending = [cond(OK, "False", lastTransitionTime="2023-11-14T22:13:25Z")]

    assert binding_waits(claim(pending, timestamp=False), driver=DRIVER, now=T0 + 12) == [
        "waiting for attach of rack-a/fab-0 (7 s)"
    ]
    assert binding_waits(claim(None, timestamp=False), driver=DRIVER, now=T0) == [
        "waiting for attach of rack-a/fab-0"
    ]


def test_a_failure_condition_is_shown_with_its_reason() -> None:
    failed = [cond(OK, "False"), cond(FAILED, "True", reason="AttachFailed", message="no link")]

    assert binding_waits(claim(failed), driver=DRIVER, now=T0) == [
        "attach of rack-a/fab-0 failed: AttachFailed: no link"
    ]


def test_an_attached_device_or_another_driver_says_nothing() -> None:
    assert binding_waits(claim([cond(OK, "True")]), driver=DRIVER, now=T0) == []
    assert binding_waits(claim(None), driver="other.example.com", now=T0) == []

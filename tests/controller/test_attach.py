"""The simulated fabric and the status.devices entries of attachable devices."""

from __future__ import annotations

from typing import Any

from drasil.api.devicepool import SimulatedFabric
from drasil.controller.attach import (
    Attach,
    AttachState,
    allocated_at,
    allocated_node,
    simulate,
)
from drasil.controller.devicestatus import desired_entries, entry_key, needs_apply

DRIVER = "gpu.drasil.dev"
OK, FAILED = "drasil.dev/Attached", "drasil.dev/AttachFailed"


def result(device: str = "fab-0") -> dict[str, Any]:
    return {
        "request": "gpu",
        "driver": DRIVER,
        "pool": "rack-a",
        "device": device,
        "bindingConditions": [OK],
        "bindingFailureConditions": [FAILED],
    }


def fabric(seconds: int = 10, fail: tuple[str, ...] = ()) -> SimulatedFabric:
    return SimulatedFabric.model_validate({"attachSeconds": seconds, "failDevices": list(fail)})


def entry(*conditions: tuple[str, str]) -> dict[str, Any]:
    return {"conditions": [{"type": t, "status": s} for t, s in conditions]}


def test_attach_is_pending_until_the_delay_from_allocation_is_over() -> None:
    pending = simulate(result(), None, fabric=fabric(10), started=100.0, now=105.0)
    done = simulate(result(), None, fabric=fabric(10), started=100.0, now=110.0)

    assert pending == Attach(AttachState.PENDING, due=110.0)
    assert done.state is AttachState.ATTACHED


def test_without_fabric_settings_the_attach_succeeds_at_once() -> None:
    assert simulate(result(), None, fabric=None, started=1.0, now=1.0).state is AttachState.ATTACHED


def test_fail_devices_fail_after_the_delay() -> None:
    bad = fabric(2, fail=("fab-0",))

    assert simulate(result(), None, fabric=bad, started=0, now=1).state is AttachState.PENDING
    assert simulate(result(), None, fabric=bad, started=0, now=2).state is AttachState.FAILED
    assert (
        simulate(result("fab-1"), None, fabric=bad, started=0, now=2).state is AttachState.ATTACHED
    )


def test_an_outcome_in_the_claim_stays_whatever_the_fabric_says_now() -> None:
    attached = entry((OK, "True"))
    failed = entry((OK, "False"), (FAILED, "True"))
    bad = fabric(100, fail=("fab-0",))

    assert simulate(result(), attached, fabric=bad, started=0, now=0).state is AttachState.ATTACHED
    assert simulate(result(), failed, fabric=None, started=0, now=0).state is AttachState.FAILED


def test_allocation_time_and_node_come_from_the_allocation() -> None:
    claim = {
        "status": {
            "allocation": {
                "allocationTimestamp": "1970-01-01T00:01:40Z",
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": ["n1"]}
                            ]
                        }
                    ]
                },
            }
        }
    }

    assert allocated_at(claim) == 100.0
    assert allocated_node(claim) == "n1"
    assert allocated_at({}) is None
    assert allocated_node({}) == ""


def _claim(devices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"allocation": {"devices": {"results": [result()]}}}
    if devices is not None:
        status["devices"] = devices
    return {"metadata": {"namespace": "ml", "name": "c"}, "status": status}


def _states(entries: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [(c["type"], c["status"], c["reason"]) for c in entries[0]["conditions"]]


def test_entries_follow_the_attach() -> None:
    key = entry_key(result())
    pools = {"rack-a"}

    def entries(state: AttachState) -> list[dict[str, Any]]:
        attaches = {key: Attach(state, node="n1")}
        return desired_entries(_claim(), driver=DRIVER, pools=pools, now="T", attaches=attaches)

    assert _states(entries(AttachState.PENDING)) == [
        ("Ready", "False", "Attaching"),
        (OK, "False", "Attaching"),
    ]
    assert _states(entries(AttachState.ATTACHED)) == [
        ("Ready", "True", "DevicePoolDevice"),
        (OK, "True", "Attached"),
    ]
    failed = entries(AttachState.FAILED)
    assert _states(failed) == [
        ("Ready", "False", "AttachFailed"),
        (OK, "False", "AttachFailed"),
        (FAILED, "True", "AttachFailed"),
    ]
    assert "to node n1" in failed[0]["conditions"][2]["message"]


def test_a_pending_entry_is_written_once_and_again_when_attached() -> None:
    key, pools = entry_key(result()), {"rack-a"}
    pending = {key: Attach(AttachState.PENDING)}
    written = desired_entries(_claim(), driver=DRIVER, pools=pools, now="T1", attaches=pending)
    current = _claim(written)

    again = desired_entries(current, driver=DRIVER, pools=pools, now="T2", attaches=pending)
    assert not needs_apply(current, again, driver=DRIVER, pools=pools)
    attached = {key: Attach(AttachState.ATTACHED)}
    done = desired_entries(current, driver=DRIVER, pools=pools, now="T3", attaches=attached)
    assert needs_apply(current, done, driver=DRIVER, pools=pools)
    assert {c["lastTransitionTime"] for c in done[0]["conditions"]} == {"T3"}

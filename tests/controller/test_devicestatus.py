"""Our entries of a claim's status.devices for allocated DevicePool devices."""

from __future__ import annotations

from typing import Any

from drasil.controller.devicestatus import desired_entries, needs_apply

DRIVER = "gpu.drasil.dev"
POOLS = {"rack-a"}


def claim(
    results: list[dict[str, Any]], devices: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    status: dict[str, Any] = {"allocation": {"devices": {"results": results}}}
    if devices is not None:
        status["devices"] = devices
    return {"metadata": {"namespace": "ml", "name": "c"}, "status": status}


def result(device: str, pool: str = "rack-a", driver: str = DRIVER, **extra: Any) -> dict[str, Any]:
    return {"request": "gpu", "driver": driver, "pool": pool, "device": device, **extra}


def test_entries_for_devicepool_results_only() -> None:
    c = claim([result("remote-0"), result("gpu-0", pool="node-1"), result("x", driver="other")])

    entries = desired_entries(c, driver=DRIVER, pools=POOLS, now="T")

    assert entries == [
        {
            "driver": DRIVER,
            "pool": "rack-a",
            "device": "remote-0",
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "DevicePoolDevice",
                    "message": "device remote-0 of DevicePool rack-a",
                    "lastTransitionTime": "T",
                }
            ],
            "data": {"devicePool": "rack-a"},
        }
    ]


def test_share_id_is_part_of_the_key() -> None:
    entries = desired_entries(
        claim([result("remote-0", shareID="s1")]), driver=DRIVER, pools=POOLS, now="T"
    )

    assert entries[0]["shareID"] == "s1"


def test_an_applied_status_needs_no_new_apply_and_keeps_its_time() -> None:
    c = claim([result("remote-0")])
    applied = desired_entries(c, driver=DRIVER, pools=POOLS, now="T1")
    others = {"driver": "other", "pool": "p", "device": "d"}
    current = claim([result("remote-0")], devices=[*applied, others])

    again = desired_entries(current, driver=DRIVER, pools=POOLS, now="T2")

    assert again == applied
    assert not needs_apply(current, again, driver=DRIVER, pools=POOLS)


def test_missing_or_stale_entries_need_an_apply() -> None:
    c = claim([result("remote-0")])
    wanted = desired_entries(c, driver=DRIVER, pools=POOLS, now="T")

    assert needs_apply(c, wanted, driver=DRIVER, pools=POOLS)
    stale = claim([], devices=[{"driver": DRIVER, "pool": "rack-a", "device": "remote-9"}])
    assert needs_apply(stale, [], driver=DRIVER, pools=POOLS)
    not_ready = claim(
        [result("remote-0")], devices=[{"driver": DRIVER, "pool": "rack-a", "device": "remote-0"}]
    )
    assert needs_apply(not_ready, wanted, driver=DRIVER, pools=POOLS)
    assert not needs_apply(claim([]), [], driver=DRIVER, pools=POOLS)

"""The churn's pure parts (e2e.harness.churn): its claims, the double-booking check on a
checkpoint, the ledger's verdict; and bench.churn's table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.churn import table
from e2e.harness.churn import (
    LEDGER_ENV,
    Kind,
    Ledger,
    held_twice,
    loaded_driver,
    standard_kinds,
    unserved_retry,
)


def _device(name: str, **extra: Any) -> dict[str, Any]:
    return {"poolName": "node", "deviceName": name, **extra}


def _mig(start: int, size: int) -> dict[str, Any]:
    mig = {"parentUuid": "GPU-a", "placementStart": start, "placementSize": size}
    return _device(f"gpu-0-mig-{start}", mig=mig)


def test_a_kind_asks_for_its_gpus_its_profile_and_its_memory() -> None:
    kinds = standard_kinds(gpu_class="g", mig_class="m", shared_class="s")
    assert sorted(kinds) == ["gpu", "mig", "pair", "share"]
    (mig,) = kinds["mig"].requests()
    expression = mig["exactly"]["selectors"][0]["cel"]["expression"]
    assert ".minor in [0, 1]" in expression
    assert '.profile == "1g.10gb"' in expression
    (share,) = kinds["share"].requests()
    assert share["exactly"]["capacity"] == {"requests": {"memory": "10Gi"}}
    assert kinds["pair"].pods == 2
    assert not kinds["share"].exclusive
    minors = [m for k in kinds.values() for m in k.minors]
    assert sorted(minors) == list(range(8))  # each kind on GPUs of its own


def test_held_twice_finds_one_device_or_overlapping_slices_in_two_claims() -> None:
    claims = {
        "a": {"devices": [_device("gpu-1"), _mig(0, 2)]},
        "b": {"devices": [_device("gpu-1"), _mig(1, 1)]},
        "c": {"devices": [_device("gpu-2", shareId="s1"), _device("gpu-3", adminAccess=True)]},
        "d": {"devices": [_device("gpu-2", shareId="s2"), _device("gpu-3"), _mig(2, 1)]},
    }
    assert held_twice(claims) == ["MIG slice 1 of GPU-a: a and b", "node/gpu-1: a and b"]


def test_the_ledger_lists_every_problem_and_only_those() -> None:
    ledger = Ledger(pods_started=3, waits=[1.0, 2.0, 9.0], prepare_retries=4)
    ledger.leaks = {"CDI specs": [], "MIG instances": []}
    assert ledger.problems() == []  # retries are kubelet doing its job
    ledger.pods_failed.append("p: phase Pending")
    ledger.leaks["CDI specs"].append("k8s.x-claim_u.json")
    assert ledger.problems() == [
        "did not start: p: phase Pending",
        "left without a claim: CDI specs: ['k8s.x-claim_u.json']",
    ]
    summary = ledger.summary()
    assert "waits" not in summary
    assert (summary["longest_wait_s"], summary["p50_wait_s"]) == (9.0, 2.0)


def test_the_bench_table_has_the_totals_then_a_row_per_phase() -> None:
    ledger = Ledger(
        pods_started=5,
        waits=[1.0],
        started_by_phase={"steady": 4, "node reboot": 1},
        longest_wait_by_phase={"steady": 1.0, "node reboot": 7.5},
        leaks={"CDI specs": ["k8s.x-claim_1.json"], "MPS daemons": []},
    )
    rows = table({"test_churn_through_every_disruption": ledger.summary()}).splitlines()
    assert rows[2].startswith("| churn_through_every_disruption | 5 | 0 | 0 | 0 | 0 | 0 |")
    assert rows[2].endswith("| 1 |")  # one thing left without a claim
    assert rows[-2:] == [
        "| churn_through_every_disruption | steady | 4 | 1.0 |",
        "| churn_through_every_disruption | node reboot | 1 | 7.5 |",
    ]


def test_kind_defaults_are_one_exclusive_pod() -> None:
    kind = Kind("x", "c", (0,))
    assert (kind.pods, kind.exclusive, kind.profile, kind.memory) == (1, True, None, None)


def test_a_probe_that_loaded_the_driver_gives_its_version_else_none() -> None:
    loaded = '{"cuInit": 0, "nvmlInit": 0, "driverVersion": "590.44.01", "libcuda": "/x"}'
    assert loaded_driver(loaded) == "590.44.01"
    assert loaded_driver('{"error": "dlopen libcuda.so.1: not found"}') is None
    assert loaded_driver('{"cuInit": 100, "nvmlInit": 0, "driverVersion": "1"}') is None
    assert loaded_driver("sh: gpu-probe: not found") is None
    assert loaded_driver("") is None


def test_a_ledger_is_kept_only_where_the_bench_asks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = Ledger(pods_started=3, waits=[1.0, 2.0])
    monkeypatch.delenv(LEDGER_ENV, raising=False)
    ledger.keep("test_x", seconds=10)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path))
    ledger.keep("test_x", seconds=10)
    kept = json.loads((tmp_path / "test_x.json").read_text())
    assert (kept["seconds"], kept["pods_started"], kept["longest_wait_s"]) == (10, 3, 2.0)


def test_a_retry_is_unserved_only_when_kubelet_had_no_plugin_to_call() -> None:
    assert unserved_retry(
        "prepare dynamic resources: DRA driver gpu.upgrade.drasil.dev is not registered"
    )
    assert unserved_retry(
        'NodePrepareResources: rpc error: code = Unavailable desc = connection error: desc = "'
        'transport: Error while dialing: dial unix /x/dra.sock: connect: connection refused"'
    )
    assert not unserved_retry(
        "NodePrepareResources: claim default/c: MIG placement 0+4 of gpu-0 is held by claim d"
    )

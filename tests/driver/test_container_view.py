"""What a container sees: whatever claims, requests and devices kubelet hands it, every
variable has one value, and each device's own settings are readable for that device.

kubelet gives a container the CDI devices of every claim (or only the named request
of a claim) in its ``resources.claims``; the runtime applies the edits of each device
and, once, the spec-wide edits of each spec they come from, and keeps the last value
of a variable set twice. These tests build the specs of many claims on one node with
the real plan and spec code and check every way of combining them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

from test_claimplan import NODE, POOL, config, result

from drasil.driver.cdi.claimspecs import build_claim_spec
from drasil.driver.cdi.spec import CdiSpec
from drasil.driver.claims.plan import ClaimRef, NodePool, plan_prepare
from drasil.driver.nvidia.driveredits import control_edits
from drasil.driver.simulated.nvml import simulated_library

DRIVER = "gpu.drasil.dev"
UIDS = [f"{i:08x}-0000-4000-8000-000000000000" for i in range(8)]


def _spec(uid: str, results: list[dict[str, Any]], configs: Iterable[dict[str, Any]]) -> CdiSpec:
    claim = {
        "metadata": {"namespace": "ml", "name": f"c-{uid[:8]}", "uid": uid},
        "status": {"allocation": {"devices": {"results": results, "config": list(configs)}}},
    }
    node = NodePool(
        driver=DRIVER,
        pool=NODE,
        devices=POOL.devices,
        common_edits=control_edits(
            simulated_library("h100-80gb:2", node_name=NODE).control_device_nodes()
        ),
    )
    plan = plan_prepare(claim, ref=ClaimRef("ml", claim["metadata"]["name"], uid), node=node)
    return build_claim_spec(plan.spec, driver=DRIVER)


def _specs() -> list[CdiSpec]:
    """Claims as users write them: one device each with every sharing setting a whole
    GPU or MIG device takes, two requests with different settings, and admin access
    beside a holder. (MPS is for shares of a consumable GPU only: tests/kubeletplugin/
    test_shares.py.)"""
    sliced = config("TimeSlicing", requests=("a",), timeSlicing={"interval": "Long"})
    exclusive = config("Exclusive", requests=("b",))
    return [
        _spec(
            UIDS[0],
            [result("gpu-0", request="a"), result("gpu-1", request="b")],
            [sliced, exclusive],
        ),
        _spec(
            UIDS[1], [result("mig-0")], [config("TimeSlicing", timeSlicing={"interval": "Short"})]
        ),
        _spec(UIDS[2], [result("gpu-0", adminAccess=True)], [config("TimeSlicing")]),
        _spec(UIDS[3], [result("gpu-1", adminAccess=True)], []),
    ]


def _edits_reaching(picked: Iterable[tuple[CdiSpec, Mapping[str, Any]]]) -> list[list[str]]:
    chosen = list(picked)
    specs = {id(spec): spec for spec, _ in chosen}.values()
    return [
        *(device["containerEdits"].get("env", []) for _, device in chosen),
        *((spec.get("containerEdits") or {}).get("env", []) for spec in specs),
    ]


def _container_env(picked: Iterable[tuple[CdiSpec, Mapping[str, Any]]]) -> dict[str, set[str]]:
    values: dict[str, set[str]] = {}
    for edits in _edits_reaching(picked):
        for item in edits:
            name, _, value = item.partition("=")
            values.setdefault(name, set()).add(value)
    return values


def test_no_variable_takes_two_values_in_any_container() -> None:
    devices = [(spec, device) for spec in _specs() for device in spec["devices"]]
    for size in range(1, len(devices) + 1):
        for picked in itertools.combinations(devices, size):
            clashes = {n: v for n, v in _container_env(picked).items() if len(v) > 1}
            assert clashes == {}, [d["name"] for _, d in picked]


def test_each_device_of_a_container_is_named_with_its_own_settings() -> None:
    two_requests = _specs()[0]
    env = {
        n: v.pop()
        for n, v in _container_env((two_requests, d) for d in two_requests["devices"]).items()
    }
    assert env["DRASIL_DEVICE_GPU_0_SHARING_STRATEGY"] == "TimeSlicing"
    assert env["DRASIL_DEVICE_GPU_0_TIMESLICE_INTERVAL"] == "Long"
    assert env["DRASIL_DEVICE_GPU_1_SHARING_STRATEGY"] == "Exclusive"
    assert "DRASIL_DEVICE_GPU_1_TIMESLICE_INTERVAL" not in env
    assert [n for n in env if "_MPS_" in n or n.startswith("CUDA_MPS")] == []
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_a_container_naming_one_request_hears_only_of_its_device() -> None:
    two_requests = _specs()[0]
    first = two_requests["devices"][0]
    env = _container_env([(two_requests, first)])
    assert {n for n in env if n.startswith("DRASIL_DEVICE_GPU_1")} == set()
    assert "DRASIL_DEVICE_GPU_0" in env


def test_admin_access_says_so_beside_the_holders_settings() -> None:
    specs = _specs()
    holder, admin = specs[0], specs[2]
    env = _container_env([(holder, holder["devices"][0]), (admin, admin["devices"][0])])
    assert env["DRASIL_DEVICE_GPU_0_ADMIN_ACCESS"] == {"true"}
    assert env["DRASIL_DEVICE_GPU_0_SHARING_STRATEGY"] == {"TimeSlicing"}

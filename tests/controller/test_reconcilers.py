"""The reconcilers apart: due queues, pools marked due, a failed attach waiting for
its taint, and a tick that touches only what is due."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from kubernetes import client

from drasil.controller.controller import Controller
from drasil.controller.metrics import ControllerMetrics
from drasil.controller.options import parse_options
from drasil.controller.reconcilers.devicestatus import TAINT_WAIT
from drasil.controller.reconcilers.due import DueQueue
from drasil.controller.reconcilers.explanations import node_fit
from drasil.driver.explain.claims import node_scope
from drasil.driver.kubeapi import KubeApi

DRIVER = "gpu.drasil.dev"
OK, FAILED = "drasil.dev/Attached", "drasil.dev/AttachFailed"


def test_a_due_queue_hands_out_each_key_once_when_due() -> None:
    due: DueQueue[str] = DueQueue()
    due.mark("a", 5.0)
    due.mark("b", 1.0)
    due.mark("a", 2.0)  # earlier wins
    due.mark("b", 9.0)  # later is ignored

    assert not due.any_due(0.5)
    assert due.pop_due(1.5) == ["b"]
    assert due.pop_due(1.5) == []
    assert due.pop_due(3.0) == ["a"]
    assert len(due) == 0


def test_a_forgotten_key_is_never_handed_out() -> None:
    due: DueQueue[str] = DueQueue()
    due.mark("a", 1.0)
    due.forget("a")
    due.mark("b", 1.0)

    assert due.pop_due(2.0) == ["b"]
    due.mark("a", 3.0)
    assert due.pop_due(4.0) == ["a"]


def _controller() -> Controller:
    configuration = client.Configuration()
    configuration.host = "https://127.0.0.1:6443"
    options = parse_options(["--kubeconfig=/dev/null"], env={})
    return Controller(
        api=KubeApi(client.ApiClient(configuration)), options=options, metrics=ControllerMetrics()
    )


def _pool(**spec: Any) -> dict[str, Any]:
    device = {"name": "fab-0", "bindsToNode": True, "bindingConditions": [OK]}
    device["bindingFailureConditions"] = [FAILED]
    return {
        "apiVersion": "drasil.dev/v1alpha1",
        "kind": "DevicePool",
        "metadata": {"name": "fabric", "uid": "uid-pool", "generation": 1},
        "spec": {"allNodes": True, "devices": [device], **spec},
    }


def _claim() -> dict[str, Any]:
    result: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": "fabric"}
    result["device"] = "fab-0"
    result |= {"bindingConditions": [OK], "bindingFailureConditions": [FAILED]}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "job", "namespace": "ml", "uid": "uid-job"},
        "status": {
            "allocation": {
                "devices": {"results": [result]},
                "allocationTimestamp": "2026-01-01T00:00:00Z",
            }
        },
    }


class Recorder:
    """What the reconcilers asked of the API: pool reconciles, status applies."""

    def __init__(self, controller: Controller, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, Any]] = []
        sync = controller.pools.sync

        def reconcile(obj: Any, *, attach_failed: Any = ()) -> str:
            self.calls.append(("publish", sorted(attach_failed)))
            return "published"

        def apply(namespace: str, name: str, entries: Any, *, manager: str) -> None:
            conditions = {c["type"]: c["status"] for c in entries[0]["conditions"]}
            self.calls.append(("status", conditions))

        monkeypatch.setattr(sync, "reconcile", reconcile)
        monkeypatch.setattr(controller.api, "apply_claim_device_status", apply)


def test_a_failed_attach_is_written_after_its_pool_carries_the_taint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    controller = _controller()
    calls = Recorder(controller, monkeypatch).calls
    fabric = {"simulatedFabric": {"attachSeconds": 0, "failDevices": ["fab-0"]}}
    asyncio.run(controller.on_pool({"type": "ADDED", "object": _pool(**fabric)}))
    assert calls == [("publish", [])]

    asyncio.run(controller.on_claim({"type": "ADDED", "object": _claim()}))
    assert calls == [("publish", [])]  # held back: the taint is not published yet
    asyncio.run(controller.tick(time.monotonic()))

    failed = {"Ready": "False", OK: "False", FAILED: "True"}
    assert calls[:2] == [("publish", []), ("publish", ["fab-0"])]
    assert calls[2:]
    assert all(call == ("status", failed) for call in calls[2:])


def test_a_failure_is_written_anyway_when_the_taint_cannot_be_published(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    controller = _controller()
    Recorder(controller, monkeypatch)
    written: list[Any] = []
    monkeypatch.setattr(
        controller.api, "apply_claim_device_status", lambda *a, **_: written.append(a)
    )
    monkeypatch.setattr(controller.pools, "taint_published", lambda pool, device: False)
    fabric = {"simulatedFabric": {"failDevices": ["fab-0"]}}
    asyncio.run(controller.on_pool({"type": "ADDED", "object": _pool(**fabric)}))
    asyncio.run(controller.on_claim({"type": "ADDED", "object": _claim()}))
    assert written == []

    later = time.time() + TAINT_WAIT + 1
    monkeypatch.setattr("drasil.controller.reconcilers.devicestatus.time.time", lambda: later)
    controller.device_status.due.mark(("ml", "job"), 0.0)
    asyncio.run(controller.tick(time.monotonic()))
    assert written  # (once per look: the pool's first publish looks at its claims too)


def test_a_deleted_slice_marks_its_pool_due(monkeypatch: pytest.MonkeyPatch) -> None:
    controller = _controller()
    calls = Recorder(controller, monkeypatch).calls
    asyncio.run(controller.on_pool({"type": "ADDED", "object": _pool()}))
    ours = {"metadata": {"name": "fabric-0", "labels": {"drasil.dev/devicepool": "fabric"}}}

    asyncio.run(controller.on_slice({"type": "DELETED", "object": ours}))
    assert len(calls) == 1  # marked, not published inline
    asyncio.run(controller.tick(time.monotonic()))
    assert len(calls) == 2


class Counting(dict[Any, Any]):
    """The view's claims, counting every walk over them."""

    def __init__(self, items: dict[Any, Any], walked: list[int]) -> None:
        super().__init__(items)
        self.walked = walked

    def values(self) -> Any:
        self.walked.append(1)
        return super().values()

    def items(self) -> Any:
        self.walked.append(1)
        return super().items()

    def __iter__(self) -> Any:
        self.walked.append(1)
        return super().__iter__()


def test_an_idle_tick_touches_no_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    controller = _controller()
    Recorder(controller, monkeypatch)
    allocated = _claim()
    allocated["status"]["allocation"]["devices"]["results"][0]["pool"] = "node-a"
    for i in range(50):
        obj = {**allocated, "metadata": {"name": f"c{i}", "namespace": "ml", "uid": f"u{i}"}}
        asyncio.run(controller.on_claim({"type": "ADDED", "object": obj}))
    walked: list[int] = []
    monkeypatch.setattr(controller.view, "claim", lambda key: walked.append(1))
    monkeypatch.setattr(controller.view, "_claims", Counting(controller.view._claims, walked))

    asyncio.run(controller.tick(time.monotonic()))

    assert walked == []
    assert controller.view.unallocated_claims() == []


def test_the_tick_gives_freed_memory_back_every_trim_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    controller = _controller()
    trims: list[float] = []

    def release() -> bool:
        trims.append(time.monotonic())
        return True

    monkeypatch.setattr("drasil.controller.controller.release_free_memory", release)
    monkeypatch.setattr("drasil.controller.controller.TRIM_PERIOD", 0.0)

    async def three_ticks() -> None:
        stop = asyncio.Event()
        ticks = 0

        async def tick(now: float) -> None:
            nonlocal ticks
            ticks += 1
            if ticks == 3:
                stop.set()

        monkeypatch.setattr(controller, "tick", tick)
        await controller.run(stop, period=0.01)

    asyncio.run(three_ticks())

    assert len(trims) == 3


def _node(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "labels": {"zone": name[-1]},
            "managedFields": [{"manager": "kubelet"}],
        },
        "spec": {"podCIDR": "10.0.0.0/24", **spec},
        "status": {"images": [{"names": ["busybox"]}], "capacity": {"cpu": "8"}},
    }


def test_nodes_are_kept_as_what_node_fit_reads() -> None:
    taints = [{"key": "gpu", "value": "broken", "effect": "NoSchedule"}]
    nodes = [_node("node-a"), _node("node-b", taints=taints), _node("node-c", unschedulable=True)]
    pod = {"spec": {"nodeSelector": {"zone": "a"}, "tolerations": []}}
    plain: dict[str, Any] = {"spec": {}}

    kept = [node_fit(n) for n in nodes]

    assert kept[0] == {"metadata": {"name": "node-a", "labels": {"zone": "a"}}, "spec": {}}
    assert kept[1]["spec"] == {"taints": taints}
    assert kept[2]["spec"] == {"unschedulable": True}
    for pods in ([pod], [plain]):
        assert node_scope(kept, pods) == node_scope(nodes, pods)

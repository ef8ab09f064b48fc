"""A round of pending-claim explanations reads the fleet once, not once per claim."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_explain_events import CLASS, DRIVER, _controller

from drasil.controller.events import UNSATISFIABLE
from drasil.driver.explain.claims import prepare_fleet

PENDING = 6


def _gpu_slice() -> dict[str, Any]:
    devices = [{"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}}} for i in range(2)]
    pool = {"name": "node-a", "generation": 1, "resourceSliceCount": 1}
    return {
        "metadata": {"name": "node-a-gpus"},
        "spec": {"driver": DRIVER, "pool": pool, "nodeName": "node-a", "devices": devices},
    }


def _claim(name: str, holds: tuple[str, ...] = ()) -> dict[str, Any]:
    request = {"name": "gpu", "exactly": {"deviceClassName": DRIVER, "count": 1}}
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [request]}},
    }
    if holds:
        results = [
            {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": d} for d in holds
        ]
        obj["status"] = {"allocation": {"devices": {"results": results}}}
    return obj


UNSCHEDULABLE = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}


def _pod(name: str, claim: str, *, answered: bool = True) -> dict[str, Any]:
    """A Pod waiting for ``claim``: kube-scheduler has tried it (``answered``) or it
    is only queued."""
    return {
        "metadata": {"name": name, "namespace": "ml", "uid": f"uid-pod-{name}"},
        "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": claim}]},
        "status": {"phase": "Pending", "conditions": [UNSCHEDULABLE] if answered else []},
    }


def test_one_round_explains_every_due_claim_from_one_fleet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    controller = _controller()
    controller.view.put_slice(_gpu_slice())
    controller.view.put_class(CLASS)
    controller.view.put_claim(_claim("train", holds=("gpu-0", "gpu-1")))
    claims = {f"job-{i}": _claim(f"job-{i}") for i in range(PENDING)}
    for name, obj in claims.items():
        controller.view.put_claim(obj)
        controller.view.put_pod(_pod(f"pod-{name}", name))
    posted: list[dict[str, Any]] = []
    monkeypatch.setattr(controller.api, "get_claim", lambda namespace, name, **_: claims[name])
    monkeypatch.setattr(
        controller.api, "get_pod", lambda namespace, name: _pod(name, name.removeprefix("pod-"))
    )
    monkeypatch.setattr(controller.api, "list_nodes", lambda: None)
    monkeypatch.setattr(controller.api, "post_event", lambda **event: posted.append(event) or True)
    built: list[int] = []

    def counting_prepare(**kwargs: Any) -> Any:
        built.append(1)
        return prepare_fleet(**kwargs)

    monkeypatch.setattr(
        "drasil.controller.reconcilers.explanations.prepare_fleet", counting_prepare
    )
    explain_after = controller.explanations.pending.explain_after

    asyncio.run(controller.tick(0.0))  # the clocks start
    asyncio.run(controller.tick(explain_after))

    assert len(built) == 1
    on_claims = [e for e in posted if e["involved"]["kind"] == "ResourceClaim"]
    assert sorted(e["involved"]["name"] for e in on_claims) == sorted(claims)
    assert {e["reason"] for e in posted} == {UNSATISFIABLE}
    assert all(e["message"].endswith("both allocated to ml/train") for e in on_claims), on_claims


def test_the_device_views_and_nodes_go_once_no_claim_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    controller = _controller()
    controller.view.put_slice(
        {**_gpu_slice(), "metadata": {"name": "s", "uid": "u", "resourceVersion": "1"}}
    )
    controller.view.put_class(CLASS)
    controller.view.put_claim(_claim("job"))
    controller.view.put_pod(_pod("pod-job", "job"))
    monkeypatch.setattr(controller.api, "get_claim", lambda namespace, name, **_: _claim(name))
    monkeypatch.setattr(controller.api, "get_pod", lambda namespace, name: _pod(name, "job"))
    monkeypatch.setattr(controller.api, "list_nodes", lambda: [])
    monkeypatch.setattr(controller.api, "post_event", lambda **event: None)
    explanations = controller.explanations
    explain_after = explanations.pending.explain_after

    asyncio.run(controller.tick(0.0))
    asyncio.run(controller.tick(explain_after))
    assert len(explanations.cel_cache) == 1
    assert explanations.nodes(now=explain_after) == []

    controller.view.put_claim(_claim("job", holds=("gpu-0",)))  # allocated: nothing waits
    asyncio.run(controller.tick(explain_after + 1))

    assert len(explanations.cel_cache) == 0
    monkeypatch.setattr(controller.api, "list_nodes", lambda: None)
    assert explanations.nodes(now=explain_after + 1) is None  # listed again, not kept


def test_a_claim_whose_pod_is_only_queued_is_explained_at_stall_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Pod kube-scheduler has not looked at yet (no PodScheduled condition) is behind
    others in its queue: its claim is not explained at --explain-after, only at
    --stall-after (a scheduler that never comes); once the scheduler has tried the Pod,
    at once, the claim having waited --explain-after."""
    controller = _controller()
    controller.view.put_slice(_gpu_slice())
    controller.view.put_class(CLASS)
    controller.view.put_claim(_claim("train", holds=("gpu-0", "gpu-1")))
    controller.view.put_claim(_claim("queued"))
    controller.view.put_pod(_pod("pod-queued", "queued", answered=False))
    controller.view.put_claim(_claim("tried"))
    controller.view.put_pod(_pod("pod-tried", "tried", answered=False))
    monkeypatch.setattr(controller.api, "get_claim", lambda namespace, name, **_: _claim(name))
    monkeypatch.setattr(controller.api, "get_pod", lambda namespace, name: None)
    monkeypatch.setattr(controller.api, "list_nodes", lambda: None)
    posted: list[dict[str, Any]] = []
    monkeypatch.setattr(controller.api, "post_event", lambda **event: posted.append(event) or True)
    explanations = controller.explanations
    explain_after = explanations.pending.explain_after
    stall_after = explanations.stalls.stall_after
    assert stall_after > explain_after + 1

    def explained() -> list[str]:
        return sorted(e["involved"]["name"] for e in posted if e["involved"]["kind"] != "Pod")

    asyncio.run(controller.tick(0.0))
    asyncio.run(controller.tick(explain_after))
    assert explained() == []
    assert len(explanations.cel_cache) == 0  # no round ran: the device views not built

    controller.view.put_pod(_pod("pod-tried", "tried"))  # kube-scheduler: Unschedulable
    asyncio.run(controller.tick(explain_after + 1))
    assert explained() == ["tried"]

    asyncio.run(controller.tick(stall_after))
    assert explained() == ["queued", "tried"]

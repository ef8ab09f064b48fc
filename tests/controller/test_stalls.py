"""A pending claim the explanations find satisfiable: reported once, counted, timed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_explain_events import CLASS, _controller
from test_explain_rounds import _claim, _gpu_slice, _pod

from drasil.controller.events import SCHEDULER_NOT_RETRIED
from drasil.controller.options import OptionsError, parse_options
from drasil.controller.stalls import SchedulerStalls


def test_an_episode_is_reported_once_after_stall_after() -> None:
    stalls = SchedulerStalls(stall_after=60)

    assert stalls.satisfiable("a", now=100, wall=1000) is None
    assert stalls.satisfiable("a", now=159, wall=1059) is None
    episode = stalls.satisfiable("a", now=160, wall=1060)
    assert episode is not None
    assert (episode.since, episode.since_wall) == (100, 1000)
    assert stalls.satisfiable("a", now=200, wall=1100) is None  # once per episode
    assert stalls.stalled(now=200) == 1


def test_an_unsatisfiable_explanation_ends_the_episode() -> None:
    stalls = SchedulerStalls(stall_after=60)
    stalls.satisfiable("a", now=0, wall=0)
    stalls.unsatisfiable("a")

    assert stalls.satisfiable("a", now=61, wall=61) is None  # its clock starts again
    assert stalls.stalled(now=100) == 0
    assert stalls.satisfiable("a", now=121, wall=121) is not None


def test_a_claim_that_stops_waiting_gives_its_satisfiable_wait() -> None:
    stalls = SchedulerStalls(stall_after=60)
    stalls.satisfiable("a", now=10, wall=10)
    stalls.satisfiable("b", now=20, wall=20)

    assert stalls.ended_except({"b"}, now=100) == [90]
    assert stalls.ended("b", now=110) == 90
    assert stalls.ended("never-satisfiable", now=110) is None
    assert len(stalls) == 0


def test_stall_after_must_be_positive() -> None:
    assert parse_options(["--stall-after=5"], env={}).stall_after == 5
    assert parse_options([], env={"STALL_AFTER": "90"}).stall_after == 90
    with pytest.raises(OptionsError, match="--stall-after: 0 is not positive"):
        parse_options(["--stall-after=0"], env={})


def _metric(controller: Any, name: str) -> float:
    value = controller.explanations.metrics.registry.get_sample_value(name)
    return 0.0 if value is None else float(value)


def test_a_satisfiable_pending_claim_gets_one_event_on_claim_and_pod(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Free GPUs, a waiting Pod, a claim still unallocated: after --stall-after the
    claim and the Pod are told the wait is not capacity; once allocated, its wait is
    observed."""
    controller = _controller()
    controller.explanations.stalls.stall_after = 0.0  # the first explanation is late
    controller.view.put_slice(_gpu_slice())
    controller.view.put_class(CLASS)
    claim = _claim("job")
    controller.view.put_claim(claim)
    controller.view.put_pod(_pod("pod-job", "job"))
    posted: list[dict[str, Any]] = []
    monkeypatch.setattr(controller.api, "get_claim", lambda namespace, name, **_: claim)
    monkeypatch.setattr(controller.api, "get_pod", lambda namespace, name: _pod(name, "job"))
    monkeypatch.setattr(controller.api, "list_nodes", lambda: None)
    monkeypatch.setattr(controller.api, "post_event", lambda **event: posted.append(event) or True)
    explain_after = controller.explanations.pending.explain_after

    asyncio.run(controller.tick(0.0))
    asyncio.run(controller.tick(explain_after))
    asyncio.run(controller.tick(explain_after + 1))

    assert sorted((e["involved"]["kind"], e["reason"]) for e in posted) == [
        ("Pod", SCHEDULER_NOT_RETRIED),
        ("ResourceClaim", SCHEDULER_NOT_RETRIED),
    ]
    message = next(e["message"] for e in posted if e["involved"]["kind"] == "ResourceClaim")
    assert message.startswith("satisfiable since 20"), message
    assert "kube-scheduler has not retried its Pod" in message
    assert _metric(controller, "drasil_controller_scheduler_stalls_total") == 1
    assert _metric(controller, "drasil_controller_stalled_claims") == 1

    allocated = _claim("job", holds=("gpu-0",))
    controller.view.put_claim(allocated)
    asyncio.run(controller.tick(explain_after + 2))

    assert _metric(controller, "drasil_controller_satisfiable_wait_seconds_count") == 1
    assert _metric(controller, "drasil_controller_stalled_claims") == 0

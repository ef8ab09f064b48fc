"""One Event per distinct message per object: the memory behind EventRecorder."""

from __future__ import annotations

import re
from typing import cast

from drasil.controller.events import (
    EXPLANATION_INCOMPLETE,
    UNSATISFIABLE,
    EventMemory,
    EventRecorder,
    ObjectRef,
    RepostBudget,
    event_name,
)
from drasil.controller.metrics import ControllerMetrics
from drasil.driver.kubeapi import KubeApi


def test_each_message_is_claimed_once_per_object_and_reason() -> None:
    memory = EventMemory()

    assert memory.claim("uid-1", "InvalidDeviceConfig", "a")
    assert not memory.claim("uid-1", "InvalidDeviceConfig", "a")
    assert memory.claim("uid-1", "InvalidDeviceConfig", "b")
    assert memory.claim("uid-1", "Unsatisfiable", "a")
    assert memory.claim("uid-2", "InvalidDeviceConfig", "a")


def test_a_problem_that_went_away_and_came_back_is_news() -> None:
    memory = EventMemory()
    memory.claim("uid-1", "Unsatisfiable", "a")
    memory.claim("uid-1", "Unsatisfiable", "b")

    memory.keep_only("uid-1", "Unsatisfiable", ["b"])

    assert memory.claim("uid-1", "Unsatisfiable", "a")
    assert not memory.claim("uid-1", "Unsatisfiable", "b")


def test_unclaim_and_forget() -> None:
    memory = EventMemory()
    memory.claim("uid-1", "r", "a")
    memory.unclaim("uid-1", "r", "a")
    assert memory.claim("uid-1", "r", "a")

    memory.forget("uid-1")
    assert len(memory) == 0
    assert memory.claim("uid-1", "r", "a")


def test_object_ref_from_json() -> None:
    ref = ObjectRef.of(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"namespace": "ml", "name": "c", "uid": "u"},
        }
    )

    assert str(ref) == "ResourceClaim ml/c"
    assert ref.involved() == {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "namespace": "ml",
        "name": "c",
        "uid": "u",
    }


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _recorder(per_minute: int, clock: _Clock) -> EventRecorder:
    # budget_allows never calls the API: no server is needed for these rules.
    return EventRecorder(
        cast(KubeApi, object()), ControllerMetrics(), RepostBudget(per_minute, clock)
    )


def test_the_repost_budget_refills_evenly_up_to_its_size() -> None:
    clock = _Clock()
    budget = RepostBudget(2, clock)
    assert budget.take()
    assert budget.take()
    assert not budget.take()
    clock.now = 30.0  # half a minute: one token back
    assert budget.take()
    assert not budget.take()
    clock.now = 3600.0  # never more than its size
    assert budget.take()
    assert budget.take()
    assert not budget.take()


def test_a_first_event_never_waits_for_the_budget_a_changed_text_does() -> None:
    clock = _Clock()
    recorder = _recorder(1, clock)
    memory = recorder.memory
    claim = ObjectRef("resource.k8s.io/v1", "ResourceClaim", "ns", "c", "uid-1")
    other = ObjectRef("resource.k8s.io/v1", "ResourceClaim", "ns", "d", "uid-2")
    for ref in (claim, other):
        assert recorder.budget_allows(ref, reason=UNSATISFIABLE, message="no GPU free")
        memory.claim(ref.uid, UNSATISFIABLE, "no GPU free")
    # The same text again costs nothing (warn will not post it anyway).
    assert recorder.budget_allows(claim, reason=UNSATISFIABLE, message="no GPU free")
    # A flapping GPU changes both texts: one token, so one waits for a re-check.
    assert recorder.budget_allows(claim, reason=UNSATISFIABLE, message="gpu-3 tainted")
    memory.keep_only(claim.uid, UNSATISFIABLE, ["gpu-3 tainted"])
    memory.claim(claim.uid, UNSATISFIABLE, "gpu-3 tainted")
    assert not recorder.budget_allows(other, reason=UNSATISFIABLE, message="gpu-3 tainted")
    # A different reason about the same object is a first Event again.
    assert recorder.budget_allows(other, reason=EXPLANATION_INCOMPLETE, message="cut short")
    clock.now = 60.0
    assert recorder.budget_allows(other, reason=UNSATISFIABLE, message="gpu-3 tainted")


def test_forgetting_an_object_makes_its_next_event_a_first_one() -> None:
    clock = _Clock()
    recorder = _recorder(1, clock)
    ref = ObjectRef("resource.k8s.io/v1", "ResourceClaim", "ns", "c", "uid-1")
    recorder.memory.claim(ref.uid, UNSATISFIABLE, "a")
    assert recorder.budget.take()  # spend the only token
    assert not recorder.budget_allows(ref, reason=UNSATISFIABLE, message="b")
    recorder.memory.forget(ref.uid)
    assert recorder.budget_allows(ref, reason=UNSATISFIABLE, message="b")


def test_an_events_name_is_the_same_whoever_posts_it_and_a_valid_subdomain() -> None:
    ref = ObjectRef("resource.k8s.io/v1", "ResourceClaim", "ns", "c", "uid-1")
    name = event_name(ref, UNSATISFIABLE, "no GPU free")
    assert name == event_name(ref, UNSATISFIABLE, "no GPU free")
    assert re.fullmatch(r"c\.[0-9a-f]{32}", name)
    others = {
        event_name(ref, UNSATISFIABLE, "gpu-3 tainted"),
        event_name(ref, EXPLANATION_INCOMPLETE, "no GPU free"),
        event_name(ObjectRef("v1", "Pod", "ns", "c", "uid-2"), UNSATISFIABLE, "no GPU free"),
    }
    assert name not in others
    assert len(others) == 3
    long = ObjectRef("v1", "Pod", "ns", "a" * 252 + "-", "uid-3")
    long_name = event_name(long, UNSATISFIABLE, "x")
    assert len(long_name) <= 253
    assert re.fullmatch(r"a+\.[0-9a-f]{32}", long_name)


class _OncePerName:
    """post_event as the API server answers it: a name already there is a 409."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def post_event(self, **event: str) -> bool:
        if event["name"] in self.names:
            return False
        self.names.append(event["name"])
        return True


def test_a_new_leader_posts_the_standing_problems_under_the_names_already_there() -> None:
    api = _OncePerName()
    ref = ObjectRef("resource.k8s.io/v1", "ResourceClaim", "ns", "c", "uid-1")
    first, second = (EventRecorder(cast(KubeApi, api), ControllerMetrics()) for _ in range(2))
    assert first.warn(ref, reason=UNSATISFIABLE, message="no GPU free")
    # A roll: the new process has no memory, and its post is the same Event.
    assert not second.warn(ref, reason=UNSATISFIABLE, message="no GPU free")
    assert second.warn(ref, reason=UNSATISFIABLE, message="gpu-3 tainted")
    assert len(api.names) == 2

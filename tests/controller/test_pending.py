"""When a pending claim is due for an explanation."""

from __future__ import annotations

from drasil.controller.pending import PendingClaims

ANSWERED_A = {"a": True}
BOTH = {"a": True, "b": True}


def test_due_after_explain_after_then_every_recheck() -> None:
    pending = PendingClaims(explain_after=10, recheck=30)

    assert pending.update(ANSWERED_A, now=100) == []
    assert pending.update(ANSWERED_A, now=109.9) == []
    assert pending.update(ANSWERED_A, now=110) == ["a"]
    pending.explained("a", now=110)
    assert pending.update(ANSWERED_A, now=139) == []
    assert pending.update(ANSWERED_A, now=140) == ["a"]


def test_the_clock_restarts_when_a_claim_stops_waiting() -> None:
    pending = PendingClaims(explain_after=10, recheck=30)
    pending.update(BOTH, now=0)
    pending.explained("a", now=10)

    assert pending.update({"b": True}, now=5) == []
    assert len(pending) == 1
    assert pending.update(BOTH, now=12) == ["b"]
    assert pending.update(BOTH, now=22) == ["a", "b"]


def test_forget() -> None:
    pending = PendingClaims(explain_after=1, recheck=1)
    pending.update(ANSWERED_A, now=0)

    pending.forget("a")

    assert pending.update(ANSWERED_A, now=0.5) == []


def test_a_claim_whose_pods_are_only_queued_waits_queued_after() -> None:
    """No word from kube-scheduler on any of its Pods: the claim is behind others in
    the scheduler's queue and is explained at queued_after, not explain_after; once
    the scheduler answers a Pod, at explain_after from when it started waiting."""
    pending = PendingClaims(explain_after=10, recheck=30, queued_after=60)

    assert pending.update({"a": False, "b": False}, now=0) == []
    assert pending.update({"a": False, "b": False}, now=30) == []
    assert pending.update({"a": True, "b": False}, now=31) == ["a"]
    assert pending.update({"a": True, "b": False}, now=59.9) == ["a"]
    assert pending.update({"a": True, "b": False}, now=60) == ["a", "b"]


def test_queued_after_is_never_sooner_than_explain_after() -> None:
    pending = PendingClaims(explain_after=10, recheck=30, queued_after=5)

    assert pending.update({"a": False}, now=0) == []
    assert pending.update({"a": False}, now=9) == []
    assert pending.update({"a": False}, now=10) == ["a"]

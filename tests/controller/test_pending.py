"""When a pending claim is due for an explanation."""

from __future__ import annotations

from drasil.controller.pending import PendingClaims


def test_due_after_explain_after_then_every_recheck() -> None:
    pending = PendingClaims(explain_after=10, recheck=30)

    assert pending.update(["a"], now=100) == []
    assert pending.update(["a"], now=109.9) == []
    assert pending.update(["a"], now=110) == ["a"]
    pending.explained("a", now=110)
    assert pending.update(["a"], now=139) == []
    assert pending.update(["a"], now=140) == ["a"]


def test_the_clock_restarts_when_a_claim_stops_waiting() -> None:
    pending = PendingClaims(explain_after=10, recheck=30)
    pending.update(["a", "b"], now=0)
    pending.explained("a", now=10)

    assert pending.update(["b"], now=5) == []
    assert len(pending) == 1
    assert pending.update(["a", "b"], now=12) == ["b"]
    assert pending.update(["a", "b"], now=22) == ["a", "b"]


def test_forget() -> None:
    pending = PendingClaims(explain_after=1, recheck=1)
    pending.update(["a"], now=0)

    pending.forget("a")

    assert pending.update(["a"], now=0.5) == []

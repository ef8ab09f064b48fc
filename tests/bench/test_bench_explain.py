"""A smoke of ``make bench``'s explain figures: the same code on 40 devices, one round.

``bench.explain.run`` itself checks that drasil's explanation counts the same matches as
plain celpy; the times are not checked (a benchmark, not a timed test).
"""

from __future__ import annotations

import sys

import pytest

from bench import explain


def test_the_explain_benchmark_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(explain, "ROUNDS", 1)
    limit = sys.getrecursionlimit()
    result = explain.run(devices=40)
    # celpy lowers the recursion limit when it starts; the benchmark never lets it, so
    # tests after this one still read deeply nested objects.
    assert sys.getrecursionlimit() >= limit
    assert result["devices"] == 40
    assert result["nodes"] > 1  # devices of several simulated nodes and profiles
    assert result["drasil"]["matches"] == result["celpy"]["naive"]["matches"]
    assert sum(result["drasil"]["matches"]) > 0
    assert result["speedup"]["explain_cold_vs_naive_celpy"] > 0

"""A smoke of ``make bench``'s driver-files figures, without a cluster: the in-process
Preparer on a fake driver root (the times are not checked)."""

from __future__ import annotations

import pytest

from bench import prepare


def test_the_driver_files_benchmark_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepare, "SCALING_ROUNDS", 5)
    monkeypatch.setattr(prepare, "DRIVER_FILES_ROUNDS", 1)
    result = prepare.driver_files_cost()
    assert result["mounts"] > 10
    assert result["with"]["spec_bytes"] > result["without"]["spec_bytes"]
    assert result["with"]["pair_p50_ms"] > 0

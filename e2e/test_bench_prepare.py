"""A smoke of ``make bench``'s prepare figures: the same code, a few rounds of each.

Both drivers beside each other with the chart's plugin identity, the gRPC floor, the
Preparer's profile and the printed table: what ``bench.prepare`` needs to keep working.
The figures themselves are not checked (a benchmark, not a timed test).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from bench import prepare
from e2e.harness.kube import Kube


def test_the_prepare_benchmark_runs(
    kube: Kube, plugin_kubeconfig: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepare, "CLAIMS", 4)
    monkeypatch.setattr(prepare, "LATENCY_ROUNDS", 5)
    monkeypatch.setattr(prepare, "THROUGHPUT_SECONDS", 0.2)
    monkeypatch.setattr(prepare, "ROUNDS", 1)
    monkeypatch.setattr(prepare, "PROFILE_PAIRS", 5)
    monkeypatch.setattr(prepare, "PROFILE_PATH", tmp_path / "profile.txt")
    root = Path(tempfile.mkdtemp(prefix="drasil-bench-"))  # socket paths must stay short
    try:
        with prepare.bench_node(kube):
            result = prepare.measure(kube, plugin_kubeconfig, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    for label in ("drasil", "reference"):
        figures = result["drivers"][label]
        assert figures["latency"]["pair_p50_ms"] > 0
        assert set(figures["throughput_claims_per_s"]) == {"1", "8", "32"}
        assert figures["rss_mib"] > 0
    assert result["grpc_floor"]["latency"]["pair_p50_ms"] > 0
    assert "through the Preparer" in (tmp_path / "profile.txt").read_text()

    result["ratios_drasil_to_reference"] = prepare.ratios(
        result["drivers"]["drasil"], result["drivers"]["reference"]
    )
    result["prepared_scaling"] = {}
    result["machine"] = {"loadavg_before": [0.0], "loadavg_after": [0.0]}
    table = prepare.table(result)
    assert "pair p50 (ms)" in table
    assert "gRPC floor" in table

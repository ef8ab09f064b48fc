"""`python -m tools.cluster down|status|env` without --run-dir act only on runs of their
own checkout: several checkouts share one cache, and one must never stop another's
cluster. Runs here are made-up run directories in a cache of the test's own, with no
process behind them, so nothing needs a cluster."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from e2e.harness import paths
from e2e.harness.cluster import rundir
from tools.cluster import main

OTHER = "/elsewhere/another-checkout"


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DRASIL_CACHE_DIR", str(tmp_path / "cache"))
    paths.runs_dir().mkdir(parents=True)
    return tmp_path / "cache"


def make_run(name: str, *, checkout: str | None, age: float, state: str = "up") -> Path:
    run = paths.runs_dir() / name
    run.mkdir()
    data = {"created": time.time() - age, "state": state}
    if checkout is not None:
        data["checkout"] = checkout
    (run / rundir.STATE_FILE).write_text(json.dumps(data))
    return run


def state_of(run: Path) -> str:
    return str(json.loads((run / rundir.STATE_FILE).read_text())["state"])


def test_latest_is_the_newest_run_of_this_checkout() -> None:
    make_run("a", checkout=str(paths.CHECKOUT), age=300)
    own = make_run("b", checkout=str(paths.CHECKOUT), age=200)
    make_run("c", checkout=OTHER, age=100)  # newer, but another checkout's
    make_run("d", checkout=None, age=50)  # from before runs recorded their checkout
    assert rundir.latest() == own
    assert rundir.latest(Path(OTHER)) == paths.runs_dir() / "c"


def test_without_a_run_of_this_checkout_nothing_is_touched(
    capsys: pytest.CaptureFixture[str],
) -> None:
    other = make_run("c", checkout=OTHER, age=100)
    for command in ("down", "status", "env"):
        assert main([command]) == 1
        err = capsys.readouterr().err
        assert "--run-dir" in err, err
        assert str(other) in err, err
        assert OTHER in err, err
    assert state_of(other) == "up"


def test_down_stops_this_checkouts_run_and_no_other(capsys: pytest.CaptureFixture[str]) -> None:
    own = make_run("b", checkout=str(paths.CHECKOUT), age=200)
    other = make_run("c", checkout=OTHER, age=100)
    assert main(["env"]) == 0
    assert str(own / "admin.kubeconfig") in capsys.readouterr().out
    assert main(["down"]) == 0
    assert (state_of(own), state_of(other)) == ("down", "up")
    # --run-dir still reaches any run.
    assert main(["down", "--run-dir", str(other)]) == 0
    assert state_of(other) == "down"


def test_no_runs_at_all_says_how_to_start_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status"]) == 1
    assert "python -m tools.cluster up" in capsys.readouterr().err

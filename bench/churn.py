"""``make bench-churn``: the disruptions of e2e/test_churn.py at length, and the ledger.

The same test as in ``make test`` (one churn of Pods with whole GPUs, dynamic MIG
placements, MPS shares and a claim of two Pods, through kubelet restarted while
prepares are in flight, the plugin killed every 5 s, the API server restarted, the
NVIDIA driver upgraded under the node and the node rebooted), run with the load going
``--seconds`` (default 300) after each disruption instead of 10; and
e2e/test_upgrade.py (``helm upgrade`` from the pinned release and ``helm rollback``
while the same kinds of Pods come and go: the plugin handed over twice). Each writes
its ledger; this collects them into bench/results/churn.json and prints the tables
docs/upgrading.md keeps.

``python -m bench.churn [--seconds 300] [-k test_upgrade]``: with ``-k`` only the tests
selected run, and their ledgers replace theirs in the results file (the others kept).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from e2e.harness.churn import LEDGER_ENV, START_TIMEOUT_ENV
from e2e.harness.cluster.nodeconfig import KUBELET_SYNC_ENV

CHECKOUT = Path(__file__).resolve().parent.parent
RESULTS = CHECKOUT / "bench" / "results" / "churn.json"
# The churn through every disruption, and the chart's upgrade and rollback under load
# (the plugin handed over twice: the DaemonSet's surge).
TESTS = ("e2e/test_churn.py", "e2e/test_upgrade.py")
DISRUPTIONS = 5
COLUMNS = (
    ("Pods started", "pods_started"),
    ("did not start", "pods_failed"),
    ("wrong devices", "wrong_devices"),
    ("driver not loaded", "driver_failures"),
    ("held twice", "double_booked"),
    ("prepare retries", "prepare_retries"),
    ("p50 wait s", "p50_wait_s"),
    ("p95 wait s", "p95_wait_s"),
    ("longest wait s", "longest_wait_s"),
)


def run(seconds: float, select: str | None, ledgers: Path) -> int:
    """pytest on the churn tests with the load's length and where ledgers go."""
    env = {
        # kubelet's own pod sync period, as on a node (the tests shorten it; see
        # e2e/harness/cluster/nodeconfig.py): the waits measured are those users meet.
        KUBELET_SYNC_ENV: "1m",
        START_TIMEOUT_ENV: "300",
        **os.environ,
        "DRASIL_CHURN_SECONDS": str(seconds),
        LEDGER_ENV: str(ledgers),
    }
    # The churn test holds five disruptions: each runs `seconds` of load plus a few
    # minutes of its own, past make test's per-test timeout.
    timeout = int(DISRUPTIONS * (seconds + 300) + 600)
    argv = [sys.executable, "-m", "pytest", *TESTS, "-q", "-p", "no:cacheprovider"]
    argv.append(f"--timeout={timeout}")
    if select:
        argv += ["-k", select]
    return subprocess.run(argv, cwd=CHECKOUT, env=env, check=False).returncode


def collect(ledgers: Path) -> dict[str, Any]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(ledgers.glob("*.json"))}


def _cell(value: Any) -> str:
    return str(len(value)) if isinstance(value, list) else str(value)


def _leaked(ledger: dict[str, Any]) -> str:
    return str(sum(len(v) for v in ledger.get("leaks", {}).values()))


def table(results: dict[str, Any]) -> str:
    """Markdown: the totals of each churn, then its phases (the Pods created while
    each disruption was under way or after it, and the longest of their waits)."""
    head = ["churn", *(name for name, _ in COLUMNS), "left without a claim"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for test, ledger in results.items():
        cells = [test.removeprefix("test_"), *(_cell(ledger[key]) for _, key in COLUMNS)]
        rows.append("| " + " | ".join([*cells, _leaked(ledger)]) + " |")
    rows += ["", "| churn | phase | Pods created in it that started | longest wait s |"]
    rows.append("|---|---|---|---|")
    for test, ledger in results.items():
        started = ledger.get("started_by_phase", {})
        for phase, longest in ledger["longest_wait_by_phase"].items():
            name = test.removeprefix("test_")
            rows.append(f"| {name} | {phase} | {started.get(phase, '-')} | {longest} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.churn", description=__doc__)
    parser.add_argument("--seconds", type=float, default=300.0, help="load after each disruption")
    parser.add_argument("-k", dest="select", help="only the tests pytest -k selects")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON written")
    args = parser.parse_args(argv)
    when = datetime.now(UTC).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix="drasil-churn-") as tmp:
        code = run(args.seconds, args.select, Path(tmp))
        results = {test: {"when": when, **ledger} for test, ledger in collect(Path(tmp)).items()}
    if args.select and args.out.exists():
        # A selected run replaces the ledgers it made and keeps the others (each says
        # when it was made).
        results = {**json.loads(args.out.read_text()).get("disruptions", {}), **results}
    doc = {
        "when": when,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "seconds_after_each_disruption": args.seconds,
        "kubelet_sync_frequency": os.environ.get(KUBELET_SYNC_ENV, "1m"),
        "pod_start_timeout_s": float(os.environ.get(START_TIMEOUT_ENV, "300")),
        "pytest_exit_code": code,
        "disruptions": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(results))
    print(f"written to {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())

"""``make bench-churn``: the disruptions of e2e/test_churn.py at length, and their ledger.

The same tests as in ``make test`` (kubelet restarted while prepares are in flight, the
plugin killed every 5 s, the API server restarted, the node rebooted, each beside a
churn of Pods with whole GPUs, dynamic MIG placements, MPS shares and a claim of two
Pods), run with the load going ``--seconds`` (default 300) after each disruption
instead of 20. Each test writes its ledger; this collects them into
bench/results/churn.json and prints the table docs/upgrading.md keeps.

``python -m bench.churn [--seconds 300] [-k reboot]``
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

CHECKOUT = Path(__file__).resolve().parent.parent
RESULTS = CHECKOUT / "bench" / "results" / "churn.json"
TEST = "e2e/test_churn.py"
COLUMNS = (
    ("Pods started", "pods_started"),
    ("did not start", "pods_failed"),
    ("wrong devices", "wrong_devices"),
    ("held twice", "double_booked"),
    ("prepare retries", "prepare_retries"),
    ("p50 wait s", "p50_wait_s"),
    ("p95 wait s", "p95_wait_s"),
    ("longest wait s", "longest_wait_s"),
)


def run(seconds: float, select: str | None, ledgers: Path) -> int:
    """pytest on the churn tests with the load's length and where ledgers go."""
    env = {**os.environ, "DRASIL_CHURN_SECONDS": str(seconds), "DRASIL_CHURN_LEDGER": str(ledgers)}
    argv = [sys.executable, "-m", "pytest", TEST, "-q", "-p", "no:cacheprovider"]
    if select:
        argv += ["-k", select]
    return subprocess.run(argv, cwd=CHECKOUT, env=env, check=False).returncode


def collect(ledgers: Path) -> dict[str, Any]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(ledgers.glob("*.json"))}


def _cell(value: Any) -> str:
    return str(len(value)) if isinstance(value, list) else str(value)


def table(results: dict[str, Any]) -> str:
    """Markdown: one row per disruption, and the longest wait in its own phase."""
    head = ["disruption", *(name for name, _ in COLUMNS), "longest wait in the disruption s"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for test, ledger in results.items():
        phases = {k: v for k, v in ledger["longest_wait_by_phase"].items() if k != "steady"}
        during = ", ".join(f"{k}: {v}" for k, v in phases.items()) or "-"
        cells = [test.removeprefix("test_"), *(_cell(ledger[key]) for _, key in COLUMNS), during]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.churn", description=__doc__)
    parser.add_argument("--seconds", type=float, default=300.0, help="load after each disruption")
    parser.add_argument("-k", dest="select", help="only the tests pytest -k selects")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON written")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="drasil-churn-") as tmp:
        code = run(args.seconds, args.select, Path(tmp))
        results = collect(Path(tmp))
    doc = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "seconds_after_each_disruption": args.seconds,
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

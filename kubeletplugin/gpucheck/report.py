"""The check's result: one line per step (ok / FAIL / skipped), the same as JSON."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

OK: Final = "ok"
FAIL: Final = "FAIL"
SKIPPED: Final = "skipped"
STATUSES: Final = (OK, FAIL, SKIPPED)


@dataclass(frozen=True)
class Step:
    """One step: its name, how it ended, a one-line summary and the details (one
    mismatch or fact a line)."""

    name: str
    status: str
    summary: str = ""
    details: tuple[str, ...] = ()
    data: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        """``<name>: ok|FAIL|skipped[: <summary>]``, e.g. ``dynamic MIG: skipped: MIG
        mode off``."""
        head = f"{self.name + ':':<26} {self.status}"
        return f"{head}: {self.summary}" if self.summary else head


def ok(name: str, summary: str = "", *details: str, **data: Any) -> Step:
    return Step(name, OK, summary, tuple(details), dict(data))


def fail(name: str, summary: str, *details: str, **data: Any) -> Step:
    return Step(name, FAIL, summary, tuple(details), dict(data))


def skipped(name: str, reason: str, **data: Any) -> Step:
    return Step(name, SKIPPED, reason, (), dict(data))


def judged(name: str, summary: str, problems: Sequence[str], **data: Any) -> Step:
    """``ok`` without problems, else ``FAIL`` naming each."""
    if problems:
        return fail(name, f"{summary}: {len(problems)} mismatch(es)", *problems, **data)
    return ok(name, summary, **data)


def with_details(step: Step, *more: str) -> Step:
    """``step`` with lines added below its own (notes that decide nothing)."""
    return replace(step, details=(*step.details, *more))


class Report:
    """The steps in the order they ran; a step that raised becomes a FAIL."""

    def __init__(self) -> None:
        self.steps: list[Step] = []

    def add(self, step: Step) -> Step:
        self.steps.append(step)
        return step

    @contextmanager
    def guard(self, name: str) -> Iterator[None]:
        """Run a step's code; an exception is that step's FAIL, not the check's end
        (a broken step must not hide the steps after it)."""
        try:
            yield
        except Exception as err:
            self.add(fail(name, f"{type(err).__name__}: {err}"))

    @property
    def failed(self) -> bool:
        return any(s.status == FAIL for s in self.steps)

    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def text(self) -> str:
        lines: list[str] = []
        for step in self.steps:
            lines.append(step.line())
            lines.extend(f"{'':<27}{d}" for d in step.details)
        counts = {s: sum(1 for x in self.steps if x.status == s) for s in STATUSES}
        verdict = "FAILED" if self.failed else "passed"
        lines.append(
            f"gpu-check {verdict}: {counts[OK]} ok, {counts[FAIL]} failed, "
            f"{counts[SKIPPED]} skipped"
        )
        return "\n".join(lines) + "\n"

    def as_json(self) -> dict[str, Any]:
        return {
            "passed": not self.failed,
            "steps": [
                {
                    "name": s.name,
                    "status": s.status,
                    "summary": s.summary,
                    "details": list(s.details),
                    "data": s.data,
                }
                for s in self.steps
            ],
        }

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.as_json(), indent=2, default=str) + "\n")

"""Structured logging for the daemons and the CLI.

``--log-format json|text`` and klog-like ``-v`` levels (docs/design.md#conventions).
Context such as the claim's namespace/name/uid travels in ``extra={"claim": ...}``
and appears as fields in both formats, so one grep finds every line of one claim.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Literal

LogFormat = Literal["json", "text"]
LOG_FORMATS: tuple[LogFormat, ...] = ("json", "text")

# Attributes every LogRecord has; anything else was passed through ``extra``.
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    """One JSON object per line, the shape log pipelines expect."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(_fields(record))
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, sort_keys=False)


class TextFormatter(logging.Formatter):
    """Human-readable lines with ``key=value`` context after the message."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        extra = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        line = f"{stamp} {record.levelname[0]} {record.name}: {record.getMessage()}"
        if extra:
            line = f"{line} {extra}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


def level_for_verbosity(verbosity: int) -> int:
    """klog style: 0 is INFO, 4 and more adds DEBUG; negative values quiet it down."""
    if verbosity >= 4:
        return logging.DEBUG
    if verbosity < 0:
        return logging.WARNING
    return logging.INFO


def setup_logging(*, log_format: LogFormat = "text", verbosity: int = 0) -> None:
    """Configure the root logger once for a process."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level_for_verbosity(verbosity))

"""What the bundle's launcher puts in place before it imports drasil (stdlib only).

drasil declares Python 3.11+; the bundle also runs on 3.10 (Ubuntu 22.04's python3).
``install()`` fills in the 3.11 names the check's import closure uses: ``enum.StrEnum``,
``datetime.UTC``.
"""

from __future__ import annotations

import datetime
import enum
from typing import Any


class _StrEnum(str, enum.Enum):  # noqa: UP042  (enum.StrEnum is what 3.10 lacks)
    """``enum.StrEnum`` of 3.11: members are strings, ``str()`` is the value."""

    def __str__(self) -> str:
        return str(self.value)

    @staticmethod
    def _generate_next_value_(name: str, start: int, count: int, last_values: list[Any]) -> str:
        return name.lower()


def _py310() -> None:
    if not hasattr(enum, "StrEnum"):
        enum.StrEnum = _StrEnum  # type: ignore[misc,assignment]
    if not hasattr(datetime, "UTC"):
        datetime.UTC = datetime.timezone.utc  # noqa: UP017


def install() -> None:
    _py310()

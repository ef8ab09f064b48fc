"""Kubernetes resource quantities: the subset drasil reads and writes.

Capacities are published as Quantity strings (``80Gi``) and opaque configs accept
them (``mps.defaultPinnedDeviceMemoryLimit``). Parsing is exact (integers and
``Decimal``), never float, so ``1Mi`` compares equal to ``1048576``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
_PATTERN = re.compile(
    r"^([+-]?[0-9]+(?:\.[0-9]*)?|[+-]?\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)


class QuantityError(ValueError):
    """A string that is not a Kubernetes quantity."""


def parse_quantity(text: str) -> Decimal:
    """Return the value of a quantity such as ``40Gi``, ``1.5G``, ``500m`` or ``1e3``."""
    match = _PATTERN.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise QuantityError(f"{text!r} is not a quantity (examples: 1024, 512Mi, 40Gi, 1.5G, 500m)")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation as err:  # pragma: no cover - the pattern already checked
        raise QuantityError(f"{text!r} is not a quantity") from err
    suffix = match.group(2) or ""
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * _DECIMAL[suffix]
    return number * (Decimal(10) ** int(suffix[1:]))


def format_bytes(value: int) -> str:
    """Format a byte count with the largest binary suffix that divides it exactly."""
    if value < 0:
        raise ValueError(f"byte count must not be negative, got {value}")
    for suffix, factor in reversed(_BINARY.items()):
        if value and value % factor == 0:
            return f"{value // factor}{suffix}"
    return str(value)

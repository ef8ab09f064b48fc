"""Kubernetes resource quantities: the subset drasil reads and writes.

Capacities are published as Quantity strings (``80Gi``) and opaque configs accept
them (``mps.defaultPinnedDeviceMemoryLimit``). Parsing is exact (integers and
``Decimal``), never float, so ``1Mi`` compares equal to ``1048576``.

Quantities come from users, so their size is bounded before any arithmetic
(``drasil.api.limits``): at most ``MAX_QUANTITY_CHARS`` characters, and a magnitude
within ``QUANTITY_EXPONENTS``, read off the text. The arithmetic then runs in a local
Decimal context that raises instead of rounding, overflowing or underflowing.
"""

from __future__ import annotations

import re
from decimal import (
    Clamped,
    Context,
    Decimal,
    DecimalException,
    DivisionByZero,
    Inexact,
    InvalidOperation,
    Overflow,
    Rounded,
    Subnormal,
    Underflow,
    localcontext,
)
from typing import Final

from drasil.api.limits import MAX_QUANTITY_CHARS, QUANTITY_EXPONENTS

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

# Within the limits every result is exact: at most 64 digits times 2**60 (19 digits),
# its leading digit from 1e-64 to 1e63. Any rounding, overflow or underflow is a bug
# and raises (every signal is trapped) instead of passing silently.
_EXACT: Final = Context(
    prec=100,
    Emax=200,
    Emin=-200,
    traps=[
        Clamped,
        DivisionByZero,
        Inexact,
        InvalidOperation,
        Overflow,
        Rounded,
        Subnormal,
        Underflow,
    ],
)

_EXAMPLES: Final = "examples: 1024, 512Mi, 40Gi, 1.5G, 500m"


class QuantityError(ValueError):
    """A string that is not a Kubernetes quantity, or one beyond drasil's limits."""


class QuantityRangeError(QuantityError):
    """A well-formed quantity whose magnitude is outside ``QUANTITY_EXPONENTS``.

    ``too_large`` tells which side: above the largest or below the smallest magnitude.
    """

    def __init__(self, text: str, *, too_large: bool) -> None:
        self.text = text
        self.too_large = too_large
        first, stop = QUANTITY_EXPONENTS.start, QUANTITY_EXPONENTS.stop
        bound = f"below 1e{stop}" if too_large else f"at least 1e{first}, or zero"
        super().__init__(f"{text!r} is out of range: a quantity's magnitude must be {bound}")


def _leading_exponent(number: Decimal, suffix: str) -> int:
    """The power of ten of the value's leading digit, from the text alone."""
    if suffix in _BINARY:  # 2**10k lies between 10**3k and 10**(3k+1); checked again after
        return number.adjusted() + len(str(_BINARY[suffix])) - 1
    if suffix in _DECIMAL:
        return number.adjusted() + _DECIMAL[suffix].adjusted()
    return number.adjusted() + int(suffix[1:])  # at most 62 digits: cheap


def parse_quantity(text: str) -> Decimal:
    """Return the value of a quantity such as ``40Gi``, ``1.5G``, ``500m`` or ``1e3``.

    Raises ``QuantityError`` for anything else, including strings longer than
    ``MAX_QUANTITY_CHARS``, and ``QuantityRangeError`` for a magnitude outside
    ``QUANTITY_EXPONENTS``; never anything else, whatever ``text`` is.
    """
    if not isinstance(text, str):
        kind = type(text).__name__  # never repr(): an int may be too long to write
        raise QuantityError(f"a {kind} is not a quantity: a quantity is a string ({_EXAMPLES})")
    if len(text) > MAX_QUANTITY_CHARS:
        raise QuantityError(
            f"{text[:20]!r}... is too long for a quantity: "
            f"at most {MAX_QUANTITY_CHARS} characters ({_EXAMPLES})"
        )
    match = _PATTERN.match(text.strip())
    if match is None:
        raise QuantityError(f"{text!r} is not a quantity ({_EXAMPLES})")
    number = Decimal(match.group(1))  # at most 64 characters: exact and cheap
    suffix = match.group(2) or ""
    if number.is_zero():
        if _leading_exponent(Decimal(1), suffix) not in QUANTITY_EXPONENTS:
            return number  # zero, in a unit too large or small to compute
    else:
        leading = _leading_exponent(number, suffix)
        if leading not in QUANTITY_EXPONENTS:
            raise QuantityRangeError(text, too_large=leading > 0)
    try:
        with localcontext(_EXACT):
            if suffix in _BINARY:
                value = number * _BINARY[suffix]
            elif suffix in _DECIMAL:
                value = number * _DECIMAL[suffix]
            else:
                value = number * (Decimal(10) ** int(suffix[1:]))
    except DecimalException as err:  # pragma: no cover - the limits keep it exact
        raise QuantityError(f"{text!r} cannot be computed exactly: {err!r}") from None
    if value.adjusted() >= QUANTITY_EXPONENTS.stop:  # 9.9e63Ei: the binary estimate is rough
        raise QuantityRangeError(text, too_large=True)
    return value


def format_bytes(value: int) -> str:
    """Format a byte count with the largest binary suffix that divides it exactly."""
    if value < 0:
        raise ValueError(f"byte count must not be negative, got {value}")
    for suffix, factor in reversed(_BINARY.items()):
        if value and value % factor == 0:
            return f"{value // factor}{suffix}"
    return str(value)

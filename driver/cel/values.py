"""CEL values of the DRA selector environment, and how CEL compares them.

Plain CEL values are Python's own (``bool``, ``int``, ``float``, ``str``, ``bytes``,
``None``, ``list``, ``dict``); ``UInt`` marks CEL's ``uint``. The Kubernetes types
mirror ``k8s.io/apiserver/pkg/cel``: ``Quantity`` (``kubernetes.Quantity``, exact,
held as a ``Decimal``) and ``Semver`` (``kubernetes.Semver``, parsed and ordered like
``github.com/blang/semver/v4``). ``CelOptional`` is ``optional_type``.

Equality and ordering follow cel-go's runtime, which kube-scheduler runs: equality is
heterogeneous (values of different types are unequal, numbers compare across int,
uint and double), except that a ``Semver`` on the left of ``==`` only accepts another
``Semver`` (upstream's ``Semver.Equal`` returns "no such overload"), so comparing a
version attribute with a string is an error there and here. Errors carry cel-go's
wording, because users read them next to the scheduler's.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Context, Decimal, localcontext
from typing import Any

from drasil.api.quantity import QuantityError, parse_quantity

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1

# Quantities are exact: enough digits that no sum of two parsed quantities rounds.
EXACT = Context(prec=200)


class CelError(Exception):
    """A CEL evaluation error; the message is what the user sees."""


class CelDeadlineExceeded(Exception):
    """The caller's time budget ran out mid-evaluation; not the expression's error."""


RUNTIME_COST_LIMIT = 1_000_000
"""Per evaluation, as the API server configures DRA selectors (resource.k8s.io/v1)."""
COST_KEY = "@cost"
"""The activation entry of an evaluation's ``CostMeter``; ``@`` is no CEL identifier."""
_DEADLINE_EVERY = 1024  # iterations between two clock reads


class CostMeter:
    """What one evaluation has spent: comprehension iterations, and the caller's clock.

    Only comprehensions can make an evaluation's work outgrow its text (nested
    ``all``/``exists`` over maps multiply), so only their iterations are charged, one
    each. Past ``limit`` the evaluation fails as upstream's does; past ``deadline``
    (a ``time.monotonic()`` value) it stops with ``CelDeadlineExceeded``.
    """

    __slots__ = ("deadline", "limit", "spent")

    def __init__(self, *, limit: int = RUNTIME_COST_LIMIT, deadline: float | None = None):
        self.spent = 0
        self.limit = limit
        self.deadline = deadline

    def charge(self) -> None:
        self.spent += 1
        if self.spent > self.limit:
            raise CelError("operation cancelled: actual cost limit exceeded")
        if (
            self.deadline is not None
            and self.spent % _DEADLINE_EVERY == 0
            and time.monotonic() > self.deadline
        ):
            raise CelDeadlineExceeded


class UInt(int):
    """A CEL ``uint`` (Python has one int type; CEL keeps them apart in arithmetic)."""

    __slots__ = ()


def no_overload(operation: str, *args: Any) -> CelError:
    """cel-go's "no such overload" error, naming the operand types."""
    types = ", ".join(type_name(a) for a in args)
    return CelError(f"no such overload: {operation}({types})")


def check_int(value: int) -> int:
    """``value`` if it fits CEL's int64, else cel-go's overflow error."""
    if INT64_MIN <= value <= INT64_MAX:
        return value
    raise CelError("integer overflow")


def check_uint(value: int) -> UInt:
    """``value`` as a ``UInt`` if it fits CEL's uint64, else cel-go's overflow error."""
    if 0 <= value <= UINT64_MAX:
        return UInt(value)
    raise CelError("unsigned integer overflow")


# k8s.io/apimachinery's resource.ParseQuantity checks this shape first, then the
# number and the suffix; its three errors tell users which part is wrong.
_K8S_QUANTITY_SHAPE = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
_QUANTITY_FORMAT_ERROR = (
    "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
)
_DECIMAL_NUMBER = re.compile(r"^[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)$")


@dataclass(frozen=True, slots=True)
class Quantity:
    """A ``kubernetes.Quantity``: the exact value of ``80Gi``, ``1.5G``, ``500m``."""

    value: Decimal

    @classmethod
    def parse(cls, text: str) -> Quantity:
        """Parse like ``resource.ParseQuantity``, with its error messages."""
        shape = _K8S_QUANTITY_SHAPE.match(text)
        if shape is None:
            raise CelError(_QUANTITY_FORMAT_ERROR)
        try:
            # parse_quantity multiplies by the suffix; keep every digit of it.
            with localcontext(EXACT):
                return cls(parse_quantity(text))
        except QuantityError:
            if _DECIMAL_NUMBER.match(shape.group(1)) is None:
                raise CelError("unable to parse quantity's numeric part") from None
            raise CelError("unable to parse quantity's suffix") from None

    def compare(self, other: Quantity) -> int:
        return (self.value > other.value) - (self.value < other.value)

    def add(self, other: Decimal | int) -> Quantity:
        with localcontext(EXACT):
            return Quantity(self.value + other)

    def is_integer(self) -> bool:
        """``AsInt64`` succeeds: integral and within int64."""
        value = self.value
        return value == value.to_integral_value() and INT64_MIN <= value <= INT64_MAX

    def __str__(self) -> str:
        return format(self.value.normalize(), "f")


# blang/semver's Parse, checked part by part so errors name the offending part.
_NUMERIC = re.compile(r"^[0-9]+$")
_ALPHANUMERIC = re.compile(r"^[0-9A-Za-z-]+$")

PrereleasePart = int | str


@dataclass(frozen=True, slots=True)
class Semver:
    """A ``kubernetes.Semver`` (``semver.Version`` of blang/semver v4)."""

    major: int
    minor: int
    patch: int
    pre: tuple[PrereleasePart, ...] = ()
    build: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str, *, normalize: bool = False) -> Semver:
        """``semver.Parse``; with ``normalize``, upstream's ``normalizeAndParse`` first."""
        if normalize:
            text = _normalize_semver(text)
        if not text:
            raise CelError("Version string empty")
        parts = text.split(".", 2)
        if len(parts) != 3:
            raise CelError("No Major.Minor.Patch elements found")
        major = _version_number(parts[0], "major", "Major")
        minor = _version_number(parts[1], "minor", "Minor")
        patch_text, pre, build = _split_patch(parts[2])
        patch = _version_number(patch_text, "patch", "Patch")
        return cls(major, minor, patch, _prerelease(pre), _build(build))

    def compare(self, other: Semver) -> int:
        """``Version.Compare``: build metadata never counts."""
        mine = (self.major, self.minor, self.patch)
        theirs = (other.major, other.minor, other.patch)
        if mine != theirs:
            return 1 if mine > theirs else -1
        return _compare_prerelease(self.pre, other.pre)

    def __str__(self) -> str:
        text = f"{self.major}.{self.minor}.{self.patch}"
        if self.pre:
            text += "-" + ".".join(str(p) for p in self.pre)
        if self.build:
            text += "+" + ".".join(self.build)
        return text


def _version_number(text: str, lower: str, title: str) -> int:
    if _NUMERIC.match(text) is None:
        if not text:
            raise CelError(f'strconv.ParseUint: parsing "": invalid syntax ({lower} number)')
        raise CelError(f"Invalid character(s) found in {lower} number {text!r}")
    if len(text) > 1 and text.startswith("0"):
        raise CelError(f"{title} number must not contain leading zeroes {text!r}")
    return int(text)


def _split_patch(text: str) -> tuple[str, str | None, str | None]:
    """``1-rc.1+build.5`` → (``1``, ``rc.1``, ``build.5``); build starts at the first +."""
    build: str | None = None
    if "+" in text:
        text, build = text.split("+", 1)
    pre: str | None = None
    if "-" in text:
        text, pre = text.split("-", 1)
    return text, pre, build


def _prerelease(text: str | None) -> tuple[PrereleasePart, ...]:
    if text is None:
        return ()
    parts: list[PrereleasePart] = []
    for part in text.split("."):
        if not part:
            raise CelError("Prerelease is empty")
        if _NUMERIC.match(part):
            if len(part) > 1 and part.startswith("0"):
                raise CelError(
                    f"Numeric PreRelease version must not contain leading zeroes {part!r}"
                )
            parts.append(int(part))
        elif _ALPHANUMERIC.match(part):
            parts.append(part)
        else:
            raise CelError(f"Invalid character(s) found in prerelease {part!r}")
    return tuple(parts)


def _build(text: str | None) -> tuple[str, ...]:
    if text is None:
        return ()
    parts = text.split(".")
    for part in parts:
        if not part:
            raise CelError("Build meta data is empty")
        if _ALPHANUMERIC.match(part) is None:
            raise CelError(f"Invalid character(s) found in build meta data {part!r}")
    return tuple(parts)


def _compare_prerelease(
    mine: tuple[PrereleasePart, ...], theirs: tuple[PrereleasePart, ...]
) -> int:
    # A release sorts after all of its prereleases.
    if not mine or not theirs:
        return (not mine) - (not theirs)
    for a, b in zip(mine, theirs, strict=False):
        if a == b:
            continue
        if isinstance(a, int) != isinstance(b, int):
            # Numeric identifiers sort before alphanumeric ones.
            return -1 if isinstance(a, int) else 1
        return 1 if a > b else -1  # type: ignore[operator]
    return (len(mine) > len(theirs)) - (len(mine) < len(theirs))


def _normalize_semver(text: str) -> str:
    """Upstream's ``normalizeAndParse``: drop a leading v, pad to x.y.z, drop leading 0s."""
    text = text.removeprefix("v")
    parts = text.split(".", 2)
    for i, part in enumerate(parts):
        if len(part) > 1:
            stripped = part.lstrip("0")
            if not stripped or not stripped[0].isdigit():
                stripped = "0" + stripped
            parts[i] = stripped
    if len(parts) < 3:
        if any(c in parts[-1] for c in "+-"):
            raise CelError("short version cannot contain PreRelease/Build meta data")
        parts += ["0"] * (3 - len(parts))
    return ".".join(parts)


@dataclass(frozen=True, slots=True)
class CelOptional:
    """An ``optional_type`` value: ``optional.of(x)`` or ``optional.none()``."""

    value: Any = None
    present: bool = False


NONE = CelOptional()


def type_name(value: Any) -> str:
    """The CEL name of a value's type, as cel-go prints it in errors."""
    kind = type(value)
    if kind is UInt:
        return "uint"
    return _TYPE_NAMES.get(kind) or _type_name_by_base(value)


_TYPE_NAMES: dict[type, str] = {
    bool: "bool",
    int: "int",
    float: "double",
    str: "string",
    bytes: "bytes",
    type(None): "null_type",
    list: "list",
    tuple: "list",
    dict: "map",
    Quantity: "kubernetes.Quantity",
    Semver: "kubernetes.Semver",
    CelOptional: "optional_type",
}


def _type_name_by_base(value: Any) -> str:
    if isinstance(value, Mapping):
        return "map"
    return type(value).__name__


def is_number(value: Any) -> bool:
    kind = type(value)
    return kind is int or kind is float or kind is UInt


def cel_equal(left: Any, right: Any) -> bool:
    """``left == right`` as cel-go evaluates it (see the module docstring)."""
    if left is None or right is None:
        return left is right
    kind = type(left)
    if kind is Semver:
        if type(right) is not Semver:
            raise no_overload("_==_", left, right)
        return bool(left.compare(right) == 0)
    if kind is bool or type(right) is bool:
        return kind is type(right) and left is right
    if is_number(left):
        return is_number(right) and left == right
    return _composite_equal(left, right)


def _composite_equal(left: Any, right: Any) -> bool:
    if isinstance(left, list | tuple):
        return isinstance(right, list | tuple) and _lists_equal(left, right)
    if isinstance(left, Mapping):
        return isinstance(right, Mapping) and _maps_equal(left, right)
    return type(left) is type(right) and bool(left == right)


def _lists_equal(left: list[Any] | tuple[Any, ...], right: list[Any] | tuple[Any, ...]) -> bool:
    return len(left) == len(right) and all(
        cel_equal(a, b) for a, b in zip(left, right, strict=True)
    )


def _maps_equal(left: Mapping[Any, Any], right: Mapping[Any, Any]) -> bool:
    if len(left) != len(right):
        return False
    return all(key in right and cel_equal(value, right[key]) for key, value in left.items())


def cel_order(name: str, order: Callable[[Any, Any], bool], left: Any, right: Any) -> bool:
    """``left < right`` (or another ordering ``name``) as cel-go evaluates it.

    Numbers order across int, uint and double (NaN is unordered, so every comparison
    with it is false); strings, bytes and bools within their type. Quantities and
    versions have no ordering operators upstream: users call ``compareTo``.
    """
    if is_number(left) and is_number(right):
        return order(left, right)
    kind = type(left)
    if kind is type(right) and kind in (str, bytes, bool):
        return order(left, right)
    raise no_overload(name, left, right)

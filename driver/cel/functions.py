"""The function library of the DRA selector environment.

The library is what kube-scheduler compiles selectors with (Kubernetes' base CEL
environment plus the DRA additions): the standard functions and conversions, the
strings extension (``lowerAscii``, ``split``, ``indexOf``, …), Kubernetes' regex
(``find``, ``findAll``), lists (``isSorted``, ``sum``, ``min``, ``max``, ``indexOf``)
and quantity libraries, the semver library, the sets extension and optional values.
Regexes are RE2, as in Go (``google-re2`` comes with cel-python).

Each entry names the argument counts it accepts, so a call with the wrong number of
arguments fails when the selector is compiled, as it does upstream; argument types
are checked when it runs, with cel-go's "no such overload" error.
"""

from __future__ import annotations

import itertools
import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from typing import Any

import re2  # type: ignore[import-untyped]

from drasil.driver.cel.operators import add, contains_item
from drasil.driver.cel.values import (
    INT64_MIN,
    NONE,
    CelError,
    CelOptional,
    Quantity,
    Semver,
    UInt,
    cel_equal,
    cel_order,
    check_int,
    check_uint,
    no_overload,
    type_name,
)

Function = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class Overload:
    """A library function and the argument counts it takes (a method's receiver excluded)."""

    function: Function
    arities: frozenset[int]


def _expect(name: str, args: tuple[Any, ...], *kinds: type) -> None:
    """Raise "no such overload" unless each argument is exactly of its kind."""
    if any(type(a) is not k for a, k in zip(args, kinds, strict=False)):
        raise no_overload(name, *args)


# --- standard functions and conversions -------------------------------------------


def _size(value: Any) -> int:
    if type(value) in (str, bytes) or isinstance(value, list | tuple | Mapping):
        return len(value)
    raise no_overload("size", value)


_INTEGER_TEXT = re.compile(r"^[+-]?[0-9]+$")
_FLOAT_TEXT = re.compile(r"^[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?$")


def _conversion_error(value: Any, target: str) -> CelError:
    return CelError(f"type conversion error from '{type_name(value)}' to '{target}'")


def _to_int(value: Any) -> int:
    kind = type(value)
    if kind is int:
        return int(value)
    if kind is UInt:
        return check_int(int(value))
    if kind is float:
        if math.isnan(value) or not INT64_MIN <= value < 2.0**63:
            raise CelError("integer overflow")
        return int(value)
    if kind is str and _INTEGER_TEXT.match(value):
        return check_int(int(value))
    raise _conversion_error(value, "int")


def _to_uint(value: Any) -> UInt:
    kind = type(value)
    if kind in (int, UInt):
        return check_uint(value)
    if kind is float:
        if math.isnan(value) or not 0 <= value < 2.0**64:
            raise CelError("unsigned integer overflow")
        return UInt(int(value))
    if kind is str and _INTEGER_TEXT.match(value):
        return check_uint(int(value))
    raise _conversion_error(value, "uint")


def _to_double(value: Any) -> float:
    kind = type(value)
    if kind in (int, UInt, float):
        return float(value)
    if kind is str and _FLOAT_TEXT.match(value):
        return float(value)
    raise _conversion_error(value, "double")


_BOOL_TEXT = {
    **dict.fromkeys(("1", "t", "T", "TRUE", "true", "True"), True),
    **dict.fromkeys(("0", "f", "F", "FALSE", "false", "False"), False),
}


def _to_bool(value: Any) -> bool:
    if type(value) is bool:
        return bool(value)
    if type(value) is str and value in _BOOL_TEXT:
        return _BOOL_TEXT[value]
    raise _conversion_error(value, "bool")


def _to_string(value: Any) -> str:
    kind = type(value)
    if kind is str:
        return str(value)
    if kind is bool:
        return "true" if value else "false"
    if kind in (int, UInt):
        return str(int(value))
    if kind is float:
        return format_double(value)
    if kind is bytes:
        try:
            return bytes(value).decode()
        except UnicodeDecodeError:
            raise CelError("invalid UTF-8 in bytes, cannot convert to string") from None
    raise _conversion_error(value, "string")


def _to_bytes(value: Any) -> bytes:
    if type(value) is bytes:
        return bytes(value)
    if type(value) is str:
        return str(value).encode()
    raise _conversion_error(value, "bytes")


def format_double(value: float) -> str:
    """Go's ``%g`` (shortest digits; exponent form below 1e-4 and from 1e6 on)."""
    if math.isnan(value) or math.isinf(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    if value == 0:
        return "-0" if math.copysign(1.0, value) < 0 else "0"
    sign, digit_tuple, exponent = Decimal(repr(value)).normalize().as_tuple()
    digits = "".join(str(d) for d in digit_tuple)
    point = len(digits) + int(exponent)
    prefix = "-" if sign else ""
    if point - 1 < -4 or point - 1 >= 6:
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{prefix}{mantissa}e{point - 1:+03d}"
    if point <= 0:
        return f"{prefix}0.{'0' * -point}{digits}"
    whole, fraction = digits[:point].ljust(point, "0"), digits[point:]
    return prefix + whole + ("." + fraction if fraction else "")


# --- strings extension -------------------------------------------------------------

_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_UPPER = str.maketrans("abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _contains(text: Any, part: Any) -> bool:
    _expect("contains", (text, part), str, str)
    return bool(part in text)


def _starts_with(text: Any, prefix: Any) -> bool:
    _expect("startsWith", (text, prefix), str, str)
    return bool(text.startswith(prefix))


def _ends_with(text: Any, suffix: Any) -> bool:
    _expect("endsWith", (text, suffix), str, str)
    return bool(text.endswith(suffix))


def _lower_ascii(text: Any) -> str:
    _expect("lowerAscii", (text,), str)
    return str(text.translate(_LOWER))


def _upper_ascii(text: Any) -> str:
    _expect("upperAscii", (text,), str)
    return str(text.translate(_UPPER))


def _trim(text: Any) -> str:
    _expect("trim", (text,), str)
    return str(text.strip())


def _check_position(position: int, text: str) -> None:
    if not 0 <= position <= len(text):
        raise CelError(f"index out of range: {position}")


def _char_at(text: Any, position: Any) -> str:
    _expect("charAt", (text, position), str, int)
    _check_position(position, text)
    return str(text[position : position + 1])


def _index_of(receiver: Any, item: Any, offset: Any = 0) -> int:
    if isinstance(receiver, list | tuple):
        return next((i for i, e in enumerate(receiver) if cel_equal(e, item)), -1)
    _expect("indexOf", (receiver, item, offset), str, str, int)
    _check_position(offset, receiver)
    return int(receiver.find(item, offset))


def _last_index_of(receiver: Any, item: Any, offset: Any = None) -> int:
    if isinstance(receiver, list | tuple):
        matches = [i for i, e in enumerate(receiver) if cel_equal(e, item)]
        return matches[-1] if matches else -1
    if offset is None:
        offset = len(receiver) if type(receiver) is str else 0
    _expect("lastIndexOf", (receiver, item, offset), str, str, int)
    _check_position(offset, receiver)
    return int(receiver.rfind(item, 0, offset + len(item)))


def _replace(text: Any, old: Any, new: Any, count: Any = -1) -> str:
    _expect("replace", (text, old, new, count), str, str, str, int)
    return str(text.replace(old, new, count))


def _split(text: Any, separator: Any, limit: Any = -1) -> list[str]:
    """Go's ``strings.SplitN``: 0 → no parts, < 0 → all parts."""
    _expect("split", (text, separator, limit), str, str, int)
    if limit == 0:
        return []
    if separator == "":
        chars = list(text)
        if 0 < limit < len(chars):
            return [*chars[: limit - 1], "".join(chars[limit - 1 :])]
        return chars
    return list(text.split(separator, limit - 1 if limit > 0 else -1))


def _substring(text: Any, start: Any, end: Any = None) -> str:
    if end is None:
        end = len(text) if type(text) is str else 0
    _expect("substring", (text, start, end), str, int, int)
    _check_position(start, text)
    _check_position(end, text)
    if start > end:
        raise CelError(f"invalid substring range. start: {start}, end: {end}")
    return str(text[start:end])


def _join(items: Any, separator: Any = "") -> str:
    if not isinstance(items, list | tuple) or any(type(i) is not str for i in items):
        raise no_overload("join", items, separator)
    _expect("join", (separator,), str)
    return str(separator.join(items))


# --- regex -------------------------------------------------------------------------


@lru_cache(maxsize=256)
def _regex(pattern: str) -> Any:
    try:
        return re2.compile(pattern)
    except re2.error as err:
        raise CelError(f"error parsing regexp: {err}") from None


def _matches(text: Any, pattern: Any) -> bool:
    _expect("matches", (text, pattern), str, str)
    return _regex(pattern).search(text) is not None


def _find(text: Any, pattern: Any) -> str:
    _expect("find", (text, pattern), str, str)
    match = _regex(pattern).search(text)
    return "" if match is None else str(match.group(0))


def _find_all(text: Any, pattern: Any, limit: Any = -1) -> list[str]:
    _expect("findAll", (text, pattern, limit), str, str, int)
    if limit == 0:
        return []
    found = [str(m.group(0)) for m in _regex(pattern).finditer(text)]
    return found if limit < 0 else found[:limit]


# --- lists and sets ----------------------------------------------------------------


def _list(name: str, value: Any) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, list | tuple):
        raise no_overload(name, value)
    return value


def _is_sorted(items: Any) -> bool:
    values = _list("isSorted", items)
    return all(cel_order("isSorted", operator.le, a, b) for a, b in itertools.pairwise(values))


def _sum(items: Any) -> Any:
    values = _list("sum", items)
    if not values:
        return 0
    total = values[0]
    if type(total) not in (int, UInt, float):
        raise no_overload("sum", items)
    for value in values[1:]:
        total = add(total, value)
    return total


def _extreme(name: str, better: Callable[[Any, Any], bool]) -> Function:
    def pick(items: Any) -> Any:
        values = _list(name, items)
        if not values:
            raise CelError(f"{name} called on empty list")
        best = values[0]
        for value in values[1:]:
            if cel_order(name, better, value, best):
                best = value
        return best

    return pick


def _sets_contains(items: Any, subset: Any) -> bool:
    values = _list("sets.contains", items)
    return all(contains_item(v, values) for v in _list("sets.contains", subset))


def _sets_equivalent(left: Any, right: Any) -> bool:
    return _sets_contains(left, right) and _sets_contains(right, left)


def _sets_intersects(left: Any, right: Any) -> bool:
    values = _list("sets.intersects", left)
    return any(contains_item(v, values) for v in _list("sets.intersects", right))


# --- semver and quantity -----------------------------------------------------------


def _semver(text: Any, normalize: Any = False) -> Semver:
    _expect("semver", (text, normalize), str, bool)
    return Semver.parse(text, normalize=normalize)


def _is_semver(text: Any, normalize: Any = False) -> bool:
    _expect("isSemver", (text, normalize), str, bool)
    try:
        Semver.parse(text, normalize=normalize)
    except CelError:
        return False
    return True


def _semver_part(name: str, part: Callable[[Semver], int]) -> Function:
    def read(version: Any) -> int:
        _expect(name, (version,), Semver)
        return part(version)

    return read


def _quantity(text: Any) -> Quantity:
    _expect("quantity", (text,), str)
    return Quantity.parse(text)


def _is_quantity(text: Any) -> bool:
    _expect("isQuantity", (text,), str)
    try:
        Quantity.parse(text)
    except CelError:
        return False
    return True


def _compare_to(receiver: Any, other: Any) -> int:
    """``compareTo`` of two versions or two quantities."""
    kind = type(receiver)
    if kind is type(other) and kind in (Semver, Quantity):
        return int(receiver.compare(other))
    raise no_overload("compareTo", receiver, other)


def _is_greater_than(receiver: Any, other: Any) -> bool:
    if type(receiver) is type(other) and type(receiver) in (Semver, Quantity):
        return bool(receiver.compare(other) == 1)
    raise no_overload("isGreaterThan", receiver, other)


def _is_less_than(receiver: Any, other: Any) -> bool:
    if type(receiver) is type(other) and type(receiver) in (Semver, Quantity):
        return bool(receiver.compare(other) == -1)
    raise no_overload("isLessThan", receiver, other)


def _quantity_operand(name: str, quantity: Any, other: Any) -> Decimal | int:
    if type(quantity) is Quantity:
        if type(other) is Quantity:
            return Decimal(other.value)
        if type(other) is int:
            return int(other)
    raise no_overload(name, quantity, other)


def _quantity_add(quantity: Any, other: Any) -> Quantity:
    return quantity.add(_quantity_operand("add", quantity, other))  # type: ignore[no-any-return]


def _quantity_sub(quantity: Any, other: Any) -> Quantity:
    return quantity.add(-_quantity_operand("sub", quantity, other))  # type: ignore[no-any-return]


def _as_integer(quantity: Any) -> int:
    _expect("asInteger", (quantity,), Quantity)
    if not quantity.is_integer():
        raise CelError("cannot convert value to integer")
    return int(quantity.value)


def _is_integer(quantity: Any) -> bool:
    _expect("isInteger", (quantity,), Quantity)
    return bool(quantity.is_integer())


def _as_approximate_float(quantity: Any) -> float:
    _expect("asApproximateFloat", (quantity,), Quantity)
    return float(quantity.value)


def _sign(quantity: Any) -> int:
    _expect("sign", (quantity,), Quantity)
    value = quantity.value
    return int((value > 0) - (value < 0))


# --- optional values ---------------------------------------------------------------


def _optional(name: str, value: Any) -> CelOptional:
    if type(value) is not CelOptional:
        raise no_overload(name, value)
    return value


def _has_value(value: Any) -> bool:
    return _optional("hasValue", value).present


def _value(value: Any) -> Any:
    optional = _optional("value", value)
    if not optional.present:
        raise CelError("optional.none() dereference")
    return optional.value


def _or_value(value: Any, default: Any) -> Any:
    optional = _optional("orValue", value)
    return optional.value if optional.present else default


def _or(value: Any, other: Any) -> CelOptional:
    optional = _optional("or", value)
    return optional if optional.present else _optional("or", other)


def _of_non_zero(value: Any) -> CelOptional:
    if value is None or (type(value) is not bool and value in (0, "", b"")):
        return NONE
    if value is False or (isinstance(value, list | tuple | Mapping) and not value):
        return NONE
    return CelOptional(value, True)


def _arities(*counts: int) -> frozenset[int]:
    return frozenset(counts)


ONE = _arities(1)
NONE_ARGS = _arities(0)

GLOBALS: dict[str, Overload] = {
    "size": Overload(_size, ONE),
    "int": Overload(_to_int, ONE),
    "uint": Overload(_to_uint, ONE),
    "double": Overload(_to_double, ONE),
    "string": Overload(_to_string, ONE),
    "bool": Overload(_to_bool, ONE),
    "bytes": Overload(_to_bytes, ONE),
    "dyn": Overload(lambda value: value, ONE),
    "matches": Overload(_matches, _arities(2)),
    "semver": Overload(_semver, _arities(1, 2)),
    "isSemver": Overload(_is_semver, _arities(1, 2)),
    "quantity": Overload(_quantity, ONE),
    "isQuantity": Overload(_is_quantity, ONE),
    "sign": Overload(_sign, ONE),
    "optional.of": Overload(lambda value: CelOptional(value, True), ONE),
    "optional.ofNonZeroValue": Overload(_of_non_zero, ONE),
    "optional.none": Overload(lambda: NONE, NONE_ARGS),
    "sets.contains": Overload(_sets_contains, _arities(2)),
    "sets.equivalent": Overload(_sets_equivalent, _arities(2)),
    "sets.intersects": Overload(_sets_intersects, _arities(2)),
}
"""Functions called as ``name(args)`` (namespaced ones as ``optional.of(x)``)."""

METHODS: dict[str, Overload] = {
    "size": Overload(_size, NONE_ARGS),
    "contains": Overload(_contains, ONE),
    "startsWith": Overload(_starts_with, ONE),
    "endsWith": Overload(_ends_with, ONE),
    "matches": Overload(_matches, ONE),
    "lowerAscii": Overload(_lower_ascii, NONE_ARGS),
    "upperAscii": Overload(_upper_ascii, NONE_ARGS),
    "trim": Overload(_trim, NONE_ARGS),
    "charAt": Overload(_char_at, ONE),
    "indexOf": Overload(_index_of, _arities(1, 2)),
    "lastIndexOf": Overload(_last_index_of, _arities(1, 2)),
    "replace": Overload(_replace, _arities(2, 3)),
    "split": Overload(_split, _arities(1, 2)),
    "substring": Overload(_substring, _arities(1, 2)),
    "join": Overload(_join, _arities(0, 1)),
    "find": Overload(_find, ONE),
    "findAll": Overload(_find_all, _arities(1, 2)),
    "isSorted": Overload(_is_sorted, NONE_ARGS),
    "sum": Overload(_sum, NONE_ARGS),
    "min": Overload(_extreme("min", operator.lt), NONE_ARGS),
    "max": Overload(_extreme("max", operator.gt), NONE_ARGS),
    "major": Overload(_semver_part("major", lambda v: v.major), NONE_ARGS),
    "minor": Overload(_semver_part("minor", lambda v: v.minor), NONE_ARGS),
    "patch": Overload(_semver_part("patch", lambda v: v.patch), NONE_ARGS),
    "compareTo": Overload(_compare_to, ONE),
    "isGreaterThan": Overload(_is_greater_than, ONE),
    "isLessThan": Overload(_is_less_than, ONE),
    "add": Overload(_quantity_add, ONE),
    "sub": Overload(_quantity_sub, ONE),
    "asInteger": Overload(_as_integer, NONE_ARGS),
    "isInteger": Overload(_is_integer, NONE_ARGS),
    "asApproximateFloat": Overload(_as_approximate_float, NONE_ARGS),
    "hasValue": Overload(_has_value, NONE_ARGS),
    "value": Overload(_value, NONE_ARGS),
    "orValue": Overload(_or_value, ONE),
    "or": Overload(_or, ONE),
}
"""Functions called as ``receiver.name(args)``; the receiver comes first."""

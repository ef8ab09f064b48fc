"""CEL's operators on the values of the DRA selector environment.

Arithmetic with cel-go's overflow and division rules, negation, ``!``, indexing and
field selection (plain and optional: ``[?key]``, ``.?field``) and ``in``. The compiler
(``drasil.driver.cel.compiler``) turns each operator of a selector into a call of
one of these; the named functions and methods are in ``drasil.driver.cel.functions``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from drasil.driver.cel.values import (
    NONE,
    CelError,
    CelOptional,
    UInt,
    cel_equal,
    check_int,
    check_uint,
    no_overload,
    type_name,
)


def add(left: Any, right: Any) -> Any:
    kind = type(left)
    if kind is type(right):
        if kind is int:
            return check_int(left + right)
        if kind is UInt:
            return check_uint(left + right)
        if kind in (float, str, bytes):
            return left + right
    if isinstance(left, list | tuple) and isinstance(right, list | tuple):
        return [*left, *right]
    raise no_overload("_+_", left, right)


def subtract(left: Any, right: Any) -> Any:
    kind = type(left)
    if kind is type(right):
        if kind is int:
            return check_int(left - right)
        if kind is UInt:
            return check_uint(left - right)
        if kind is float:
            return left - right
    raise no_overload("_-_", left, right)


def multiply(left: Any, right: Any) -> Any:
    kind = type(left)
    if kind is type(right):
        if kind is int:
            return check_int(left * right)
        if kind is UInt:
            return check_uint(left * right)
        if kind is float:
            return left * right
    raise no_overload("_*_", left, right)


def divide(left: Any, right: Any) -> Any:
    kind = type(left)
    if kind is not type(right) or kind not in (int, UInt, float):
        raise no_overload("_/_", left, right)
    if kind is float:
        return _float_divide(left, right)
    if right == 0:
        raise CelError("division by zero")
    # Go truncates toward zero; Python floors.
    quotient = abs(left) // abs(right)
    if (left < 0) != (right < 0):
        quotient = -quotient
    return check_int(quotient) if kind is int else UInt(quotient)


def _float_divide(left: float, right: float) -> float:
    if right != 0:
        return left / right
    if left == 0 or math.isnan(left):
        return math.nan
    return math.copysign(math.inf, left) * math.copysign(1.0, right)


def modulo(left: Any, right: Any) -> Any:
    kind = type(left)
    if kind is not type(right) or kind not in (int, UInt):
        raise no_overload("_%_", left, right)
    if right == 0:
        raise CelError("modulus by zero")
    # Go's remainder takes the sign of the dividend.
    remainder = abs(left) % abs(right)
    return -remainder if left < 0 else type(left)(remainder)


def negate(value: Any) -> Any:
    kind = type(value)
    if kind is int:
        return check_int(-value)
    if kind is float:
        return -value
    raise no_overload("-_", value)


def logical_not(value: Any) -> bool:
    if type(value) is bool:
        return not value
    raise no_overload("!_", value)


def _key_text(key: Any) -> str:
    if type(key) is bool:
        return "true" if key else "false"
    return str(key)


def index(container: Any, key: Any) -> Any:
    """``container[key]``: list element or map value, with cel-go's errors."""
    if type(container) is CelOptional:
        return index_optional(container, key)
    if isinstance(container, Mapping):
        if type(key) not in (str, int, UInt, bool):
            raise no_overload("_[_]", container, key)
        try:
            return container[key]
        except KeyError:
            raise CelError(f"no such key: {_key_text(key)}") from None
    if isinstance(container, list | tuple):
        if type(key) not in (int, UInt):
            raise no_overload("_[_]", container, key)
        if not 0 <= key < len(container):
            raise CelError(f"index out of range: {key}")
        return container[key]
    raise no_overload("_[_]", container, key)


def select(value: Any, field: str) -> Any:
    """``value.field``: a map's entry; an error for a missing key, as upstream."""
    if isinstance(value, Mapping):
        try:
            return value[field]
        except KeyError:
            raise CelError(f"no such key: {field}") from None
    if type(value) is CelOptional:
        return select_optional(value, field)
    raise CelError(f"no such overload: {type_name(value)} has no field '{field}'")


def select_optional(value: Any, field: str) -> CelOptional:
    """``value.?field``: ``optional.of`` the entry, or ``optional.none()``."""
    if type(value) is CelOptional:
        if not value.present:
            return NONE
        value = value.value
    if isinstance(value, Mapping):
        try:
            return CelOptional(value[field], True)
        except KeyError:
            return NONE
    raise CelError(f"no such overload: {type_name(value)} has no field '{field}'")


def index_optional(container: Any, key: Any) -> CelOptional:
    """``container[?key]``: ``optional.of`` the element, or ``optional.none()``."""
    if type(container) is CelOptional:
        if not container.present:
            return NONE
        container = container.value
    try:
        return CelOptional(index(container, key), True)
    except CelError:
        if isinstance(container, Mapping | list | tuple):
            return NONE
        raise


def contains_item(item: Any, container: Any) -> bool:
    """``item in container``: list membership (CEL equality) or map key."""
    if isinstance(container, list | tuple):
        return any(cel_equal(element, item) for element in container)
    if isinstance(container, Mapping):
        if type(item) is str:
            return item in container
        return any(type(k) is type(item) and k == item for k in container)
    raise no_overload("@in", item, container)

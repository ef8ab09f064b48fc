"""Options declared once: a daemon's settings are a dataclass whose fields carry their flag.

Each field is ``option(...)``: its flag, environment variable, default (as the text the
variable would hold), choices, help, and how that text becomes the field's value. The
parser (``parser``), the environment fallback (a flag wins over its variable), the
checks argparse leaves out (choices and absolute paths of values from the environment)
and the conversion (``settings``) are made from those declarations, so that a new option
is written in one place. A field whose type is itself such a dataclass (the controller's
``LeaderElection``) declares its own fields' flags. Used by both daemons' ``options``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from drasil.driver.endpoints import parse_addr

_META = "drasil.flag"
_SECTION = "drasil.flag-section"
_T = TypeVar("_T")


class FlagError(ValueError):
    """A flag or environment variable with a value the daemon cannot run with."""


def text(value: str | None) -> str | None:
    """The value as given."""
    return value


@dataclass(frozen=True)
class Flag:
    """How one settings field is given: ``flag`` (None: by ``env`` only), ``env``,
    ``default`` (the text ``env`` would hold; None: unset), ``choices``, ``help``,
    ``short`` (``-v``), ``dest`` (the name argparse shows in upper case; the flag's by
    default), ``kind`` (int or float: converted by argparse, a bad number in ``env`` is
    the daemon's error naming the variable), ``truth`` (given: a switch ``--x/--no-x``,
    its default the truth of the text), ``convert`` (text to the field's value; a
    ``FlagError`` it raises becomes the daemon's error) and ``absolute`` (a given path
    must be absolute)."""

    flag: str | None
    env: str | None = None
    default: str | None = None
    choices: tuple[str, ...] | None = None
    help: str | None = None
    short: str | None = None
    dest: str | None = None
    kind: Callable[[str], Any] | None = None
    truth: Callable[[str], bool] | None = None
    convert: Callable[[Any], Any] = text
    absolute: bool = False

    @property
    def name(self) -> str:
        """The argparse destination."""
        if self.dest is not None:
            return self.dest
        assert self.flag is not None
        return self.flag.lstrip("-").replace("-", "_")

    def default_text(self, env: Mapping[str, str]) -> str | None:
        if self.env is None:
            return self.default
        return env.get(self.env, self.default)


def option(flag: str | None, **declared: Any) -> Any:
    """A settings field given by ``flag`` (``Flag``'s other fields as keywords)."""
    return dataclasses.field(metadata={_META: Flag(flag, **declared)})


def section(cls: type) -> Any:
    """A settings field that is a settings dataclass of its own (its fields' flags)."""
    return dataclasses.field(metadata={_SECTION: cls})


def _declared(cls: type) -> Iterator[tuple[str, Flag | None, type | None]]:
    """(field name, its flag, or its section's class) in declaration order."""
    for f in fields(cls):
        yield f.name, f.metadata.get(_META), f.metadata.get(_SECTION)


_KIND_NAMES: dict[Callable[[str], Any], str] = {int: "an integer", float: "a number"}


def parser(
    cls: type,
    env: Mapping[str, str],
    *,
    error: Callable[[str], Exception] = FlagError,
    **kwargs: Any,
) -> argparse.ArgumentParser:
    """An argparse parser of ``cls``'s flags, in declaration order, their defaults from
    ``env``; a number in ``env`` that is none raises ``error`` naming the variable."""
    p = argparse.ArgumentParser(**kwargs)
    _add(p, cls, env, error)
    return p


def _add(
    p: argparse.ArgumentParser,
    cls: type,
    env: Mapping[str, str],
    error: Callable[[str], Exception],
) -> None:
    for _, flag, nested in _declared(cls):
        if nested is not None:
            _add(p, nested, env, error)
        if flag is None or flag.flag is None:
            continue
        names = [flag.short, flag.flag] if flag.short else [flag.flag]
        default: Any = flag.default_text(env)
        if flag.kind is not None and flag.env is not None and flag.env in env:
            default = _number(flag, env[flag.env], error)
        extra: dict[str, Any] = {}
        if flag.truth is not None:
            extra["action"] = argparse.BooleanOptionalAction
            default = flag.truth(default or "")
        if flag.choices is not None:
            extra["choices"] = flag.choices
        if flag.help is not None:
            extra["help"] = flag.help
        if flag.kind is not None:
            extra["type"] = flag.kind
        p.add_argument(*names, dest=flag.name, default=default, **extra)


def address(flag: str) -> Callable[[str], str]:
    """A converter of a listen address (``:9400``, ``127.0.0.1:0``, ``0`` for none)."""

    def check(value: str) -> str:
        try:
            parse_addr(value)
        except ValueError as err:
            raise FlagError(f"{flag}: {err}") from None
        return value

    return check


def _number(flag: Flag, value: str, error: Callable[[str], Exception]) -> Any:
    assert flag.kind is not None
    try:
        return flag.kind(value)
    except ValueError:
        what = _KIND_NAMES.get(flag.kind, f"a {getattr(flag.kind, '__name__', 'value')}")
        raise error(f"env {flag.env}: {value!r} is not {what}") from None


def settings(
    cls: type[_T],
    ns: argparse.Namespace,
    env: Mapping[str, str],
    *,
    error: Callable[[str], Exception] = FlagError,
) -> _T:
    """``cls`` from parsed flags, with the checks argparse does not make of defaults
    taken from the environment (choices, absolute paths); ``error`` makes the exception
    raised (the daemon's own ``OptionsError``)."""
    values: dict[str, Any] = {}
    for name, flag, nested in _declared(cls):
        if nested is not None:
            values[name] = settings(nested, ns, env, error=error)
            continue
        assert flag is not None
        raw = getattr(ns, flag.name) if flag.flag is not None else flag.default_text(env)
        _check(flag, raw, error)
        try:
            values[name] = flag.convert(raw)
        except FlagError as err:
            raise error(str(err)) from None
    return cls(**values)


def _check(flag: Flag, raw: Any, error: Callable[[str], Exception]) -> None:
    label = flag.flag or f"env {flag.env}"
    # argparse checks choices only for values given as flags, not for env defaults.
    if flag.choices is not None and raw not in flag.choices:
        raise error(f"{label}: unsupported value {raw!r}; allowed values are {flag.choices}")
    if flag.absolute and raw and not str(raw).startswith("/"):
        raise error(f"{label}: {raw!r} is not an absolute path")


def flags_of(cls: type) -> Sequence[Flag]:
    """Every flag ``cls`` declares (nested settings included), in order."""
    found: list[Flag] = []
    for _, flag, nested in _declared(cls):
        if nested is not None:
            found.extend(flags_of(nested))
        if flag is not None:
            found.append(flag)
    return found

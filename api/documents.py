"""Bounded readers of untrusted JSON and YAML, and the errors they and the configs raise.

Whatever a user wrote (an opaque config, a values file, a manifest given to
``drasil migrate check``) is read here before anything else looks at it: its size,
nesting, number of values and integers are bounded (``drasil.api.limits``) before it is
parsed, and the parsers are strict (duplicate keys, NaN, YAML anchors and aliases
refused; YAML read as kubectl would turn it into JSON). ``load_documents`` and
``load_json`` raise ``ConfigError`` and nothing else, whatever they are given, with the
position of the problem. The config kinds (``drasil.api.config``) build on this module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn

import yaml
from pydantic import BaseModel, ConfigDict
from yaml.constructor import ConstructorError

from drasil.api.limits import MAX_DEPTH, MAX_FILE_BYTES, MAX_INTEGER_DIGITS, MAX_VALUES

# --- errors ------------------------------------------------------------------------


class StrictModel(BaseModel):
    """The base of every model of an object users write (config kinds, DevicePools):
    strict like the API server's own types ("5" is not an integer), no unknown field,
    frozen, by the API's camelCase names or the Python ones; a schema's titles are the
    API's names."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        field_title_generator=lambda name, field: field.alias or name,
    )


@dataclass(frozen=True)
class ConfigIssue:
    """One problem of a config: where (JSON path, "" for the whole input), what, why."""

    path: str
    value: object
    message: str
    allowed: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(ValueError):
    """A config that cannot be used; ``issues`` lists every problem found, not just one."""

    def __init__(self, issues: Sequence[ConfigIssue]) -> None:
        self.issues = tuple(issues)
        super().__init__("; ".join(str(issue) for issue in self.issues))


def fail(message: str, *, value: object = None, path: str = "") -> ConfigError:
    return ConfigError([ConfigIssue(path=path, value=value, message=message)])


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def json_path(loc: Sequence[int | str]) -> str:
    """``loc`` as a JSON path: ``sharing.mpsConfig["0"]``, ``requests[1]``."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _IDENTIFIER.match(part):
            text += f".{part}" if text else part
        else:
            text += f"[{json.dumps(part)}]"
    return text


# --- input limits ------------------------------------------------------------------


def valid_text(raw: bytes | str) -> str:
    """Text that is valid Unicode: UTF-8 bytes decoded, lone surrogates refused."""
    if isinstance(raw, bytes):
        try:
            return raw.decode()
        except UnicodeDecodeError as err:
            raise fail(f"config is not UTF-8: {err.reason} at byte {err.start}") from None
    try:
        raw.encode()
    except UnicodeEncodeError as err:
        message = f"text is not valid Unicode: {err.reason} at character {err.start}"
        raise fail(message) from None
    return raw


def _too_deep(where: str, *, path: str = "") -> ConfigError:
    message = f"nested too deeply{where}: at most {MAX_DEPTH} levels of objects and lists"
    return fail(message, value=MAX_DEPTH, path=path)


def _long_integer(text: str | None, where: str, *, path: str = "") -> ConfigError:
    shown = None if text is None else text if len(text) <= 24 else f"{text[:20]}..."
    number = "integer" if shown is None else f"integer {shown}"
    message = f"{number} is too long{where}: at most {MAX_INTEGER_DIGITS} digits"
    return fail(message, value=shown, path=path)


_INTEGER_BOUND: Final = 10**MAX_INTEGER_DIGITS


def check_structure(document: object) -> None:
    """Refuse, without recursion, a document too deep or with too many values.

    Also refuses what JSON cannot hold: keys that are not strings, values that are
    not objects, lists, strings, numbers, booleans or null, and integers of more
    than ``MAX_INTEGER_DIGITS`` digits. Shared references (a Python structure that
    repeats a part, as a YAML alias bomb would) count each time they are reached,
    and the walk stops at the first excess: at most ``MAX_VALUES`` steps.
    """
    stack: list[tuple[object, tuple[int | str, ...]]] = [(document, ())]
    count = 1
    while stack:
        value, loc = stack.pop()
        if isinstance(value, Mapping | list | tuple):
            if len(loc) >= MAX_DEPTH:
                raise _too_deep("", path=json_path(loc))
            items = value.items() if isinstance(value, Mapping) else enumerate(value)
            for key, item in items:
                count += 1
                if count > MAX_VALUES:
                    raise _too_many_values()
                if isinstance(value, Mapping) and not isinstance(key, str):
                    kind = type(key).__name__
                    message = f"invalid key of type {kind}: a key must be a string"
                    raise fail(message, value=kind, path=json_path(loc))
                stack.append((item, (*loc, key)))
        elif not isinstance(value, _JSON_SCALARS):
            kind = type(value).__name__
            message = f"invalid value of type {kind}: {_JSON_VALUES}"
            raise fail(message, value=kind, path=json_path(loc))
        elif isinstance(value, int) and abs(value) >= _INTEGER_BOUND:  # never made text
            raise _long_integer(None, "", path=json_path(loc))


_JSON_SCALARS: Final = (str, int, float, type(None))
_JSON_VALUES: Final = "a config holds objects, lists, strings, numbers, booleans and null"


def _too_many_values() -> ConfigError:
    return fail(
        f"config is too large: more than {MAX_VALUES} values (keys and list items); "
        "leave out settings that repeat defaults",
        value=MAX_VALUES,
    )


# --- reading JSON and YAML strictly ------------------------------------------------


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise fail(f'duplicate key "{key}": each key may appear once', value=key)
        result[key] = value
    return result


def _no_constant(name: str) -> object:
    raise fail(f"invalid JSON: {name} is not a JSON number", value=name)


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise _long_integer(text, " in JSON")
    return int(text)


# A JSON string (possibly unterminated, which json reports) or a bracket.
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)


def _check_json_depth(text: str) -> None:
    """Refuse JSON nested deeper than ``MAX_DEPTH`` before ``json`` recurses into it."""
    depth = 0
    for token in _JSON_TOKEN.finditer(text):
        bracket = token.group()
        if bracket in ("[", "{"):
            depth += 1
            if depth > MAX_DEPTH:
                start = token.start()
                line = text.count("\n", 0, start) + 1
                column = start - text.rfind("\n", 0, start)
                raise _too_deep(f" (line {line}, column {column})")
        elif bracket in ("]", "}"):
            depth -= 1


def load_json(text: str | bytes) -> Any:
    """Parse JSON, rejecting duplicate keys and NaN/Infinity; errors are ConfigError."""
    text = valid_text(text) if isinstance(text, str | bytes) else _not_text(text)
    _check_json_depth(text)
    try:
        return json.loads(
            text,
            object_pairs_hook=_unique_keys,
            parse_constant=_no_constant,
            parse_int=_json_int,
        )
    except json.JSONDecodeError as err:
        raise fail(f"invalid JSON: {err.msg} (line {err.lineno}, column {err.colno})") from None


def _not_text(value: object) -> NoReturn:
    raise fail(f"expected text (JSON or YAML), got {type(value).__name__}")


def _where(mark: yaml.Mark | None) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"


def _json_key(key: object, node: yaml.Node) -> str:
    # kubectl turns YAML into JSON, where `0: 4Gi` has the key "0"; do the same.
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, str | int | float):
        return str(key)
    raise fail(f"invalid YAML: a key must be a string ({_where(node.start_mark)})", value=key)


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader for untrusted text, which must read like JSON.

    Beyond SafeLoader it rejects duplicate keys (PyYAML keeps the last one silently),
    anchors and aliases (a few of them expand exponentially: "billion laughs"),
    nesting deeper than ``MAX_DEPTH`` (composing recurses) and integers longer than
    ``MAX_INTEGER_DIGITS``; explicit tags that do not fit their value (``!!int x``)
    are YAML errors, and dates stay strings, as kubectl sends them.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def fetch_flow_collection_start(self, TokenClass: type[yaml.Token]) -> None:  # noqa: N803
        # The scanner looks ahead over every open "[" or "{" (its cost grows with their
        # square), long before the composer sees the nesting: stop it at the limit.
        if self.flow_level >= MAX_DEPTH:
            raise _too_deep(f" ({_where(self.get_mark())})")
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise fail(
                f"YAML anchors and aliases (&name, *name) are not allowed "
                f"({_where(event.start_mark)}): write each value out"
            )
        nested = isinstance(event, yaml.CollectionStartEvent)
        if nested:
            self._depth += 1
            if self._depth > MAX_DEPTH:
                raise _too_deep(f" ({_where(event.start_mark)})")
        try:
            return super().compose_node(parent, index)
        finally:
            if nested:
                self._depth -= 1

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if not isinstance(node, yaml.MappingNode):
            raise ConstructorError(None, None, "expected a mapping", node.start_mark)
        self.flatten_mapping(node)  # "<<" merge keys: inline mappings only, no aliases
        mapping: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = _json_key(self.construct_object(key_node, deep=deep), key_node)
            if key in mapping:
                where = _where(key_node.start_mark)
                message = f'duplicate key "{key}" ({where}): each key may appear once'
                raise fail(message, value=key)
            mapping[key] = self.construct_object(value_node, deep=deep)
        return mapping

    def _scalar(self, node: yaml.Node, what: str, construct: Any) -> Any:
        """``construct(node)``, with a ConstructorError for a value its tag cannot read."""
        try:
            return construct(self, node)
        except (ValueError, LookupError, TypeError, OverflowError):
            text = self.construct_scalar(node)  # type: ignore[arg-type]
            message = f"invalid {what} {text!r}"
            raise ConstructorError(None, None, message, node.start_mark) from None

    def construct_strict_int(self, node: yaml.Node) -> int:
        text = str(self.construct_scalar(node))  # type: ignore[arg-type]
        if len(text.lstrip("+-").replace("_", "")) > MAX_INTEGER_DIGITS:
            raise _long_integer(text, f" ({_where(node.start_mark)})")
        return int(self._scalar(node, "integer", yaml.SafeLoader.construct_yaml_int))

    def construct_strict_float(self, node: yaml.Node) -> float:
        return float(self._scalar(node, "number", yaml.SafeLoader.construct_yaml_float))

    def construct_strict_bool(self, node: yaml.Node) -> bool:
        return bool(self._scalar(node, "boolean", yaml.SafeLoader.construct_yaml_bool))

    def construct_date_text(self, node: yaml.Node) -> str:
        return str(self.construct_scalar(node))  # type: ignore[arg-type]


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_strict_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _StrictLoader.construct_strict_float)
_StrictLoader.add_constructor("tag:yaml.org,2002:bool", _StrictLoader.construct_strict_bool)
_StrictLoader.add_constructor("tag:yaml.org,2002:timestamp", _StrictLoader.construct_date_text)


def load_documents(text: str | bytes) -> list[Any]:
    """Parse JSON (text starting with ``{``) or YAML documents; empty documents are dropped.

    Text over ``MAX_FILE_BYTES``, nested over ``MAX_DEPTH``, with integers over
    ``MAX_INTEGER_DIGITS`` digits or YAML anchors is refused before it is built.
    """
    text = valid_text(text) if isinstance(text, str | bytes) else _not_text(text)
    size = len(text.encode())
    if size > MAX_FILE_BYTES:
        message = f"text is too large ({size} bytes): at most {MAX_FILE_BYTES} bytes (1 MiB)"
        raise fail(message, value=size)
    if text.lstrip().startswith("{"):
        return [load_json(text)]
    try:
        documents = list(yaml.load_all(text, Loader=_StrictLoader))
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" ({_where(mark)})" if mark else ""
        raise fail(f"invalid YAML: {err.problem or err.context}{where}") from None
    except yaml.YAMLError as err:
        raise fail(f"invalid YAML: {err}") from None
    return [document for document in documents if document is not None]

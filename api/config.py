"""The opaque config kinds of ``resource.drasil.dev/v1beta1``: GpuConfig and MigDeviceConfig.

Users put these into ``opaque.parameters`` of a DeviceClass or ResourceClaim config
entry. Decoding is strict because a config that is silently half-applied is worse than
one that is rejected: unknown fields, duplicate keys and wrong types ("5" for 5) are
errors, and every error names its JSON path, the bad value and what is allowed.

``python -m drasil.api.config schemas`` regenerates the JSON Schemas in ``api/schemas/``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Final, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from drasil.api.quantity import QuantityError, format_bytes, parse_quantity

API_VERSION: Final = "resource.drasil.dev/v1beta1"
MAX_PARAMETERS_BYTES: Final = 10 * 1024
"""The API server's limit on ``opaque.parameters`` (OpaqueParametersMaxLength)."""

_MIN_PINNED_MEMORY: Final = 2**20
SCHEMA_DIR: Final = Path(__file__).parent / "schemas"


# --- errors ------------------------------------------------------------------------


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


def _fail(message: str, *, value: object = None, path: str = "") -> ConfigError:
    return ConfigError([ConfigIssue(path=path, value=value, message=message)])


def _show(value: object) -> str:
    """A value as the user wrote it (JSON), cut short so one message stays readable."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def _quoted(values: Iterable[str]) -> str:
    return ", ".join(f'"{value}"' for value in values)


# --- field types -------------------------------------------------------------------


class SharingStrategy(StrEnum):
    """How the containers of a claim share one device."""

    EXCLUSIVE = "Exclusive"
    TIME_SLICING = "TimeSlicing"
    MPS = "MPS"


class TimeSlicingInterval(StrEnum):
    """The compute time slice (``nvidia-smi compute-policy --set-timeslice``)."""

    DEFAULT = "Default"
    SHORT = "Short"
    MEDIUM = "Medium"
    LONG = "Long"


def _one_of(enum: type[StrEnum]) -> BeforeValidator:
    # Strict pydantic accepts only enum instances from Python data; accept exactly the
    # values instead, with an error that lists them.
    allowed = tuple(member.value for member in enum)

    def check(value: object) -> object:
        if isinstance(value, enum) or (isinstance(value, str) and value in allowed):
            return enum(value)
        raise PydanticCustomError("drasil_unsupported", "unsupported value", {"allowed": allowed})

    return BeforeValidator(check)


def _invalid(reason: str, *allowed: str) -> PydanticCustomError:
    return PydanticCustomError("drasil_invalid", "{reason}", {"reason": reason, "allowed": allowed})


def _percentage(value: object) -> object:
    if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= 100:
        raise _invalid("allowed range is 0 to 100", "0-100")
    return value


def _memory_bytes(value: object) -> object:
    """A Quantity (``512Mi`` or a plain integer) as a whole number of bytes ≥ 1Mi."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _invalid("must be a quantity such as 512Mi or 4Gi", ">=1Mi")
    try:
        amount = parse_quantity(value) if isinstance(value, str) else Decimal(value)
    except QuantityError:
        raise _invalid("must be a quantity such as 512Mi or 4Gi", ">=1Mi") from None
    if amount < _MIN_PINNED_MEMORY or amount != amount.to_integral_value():
        raise _invalid("must be a whole number of bytes of at least 1Mi", ">=1Mi")
    return int(amount)


_DEVICE_KEY = re.compile(r"^(?:[0-9]+|(?:GPU|MIG)-[0-9A-Za-z/-]+)$")


def _device_key(value: object) -> object:
    if isinstance(value, str) and not _DEVICE_KEY.match(value):
        raise _invalid('must be a device index ("0") or UUID ("GPU-…", "MIG-…")', "index", "UUID")
    return value


Percentage = Annotated[
    int,
    BeforeValidator(_percentage),
    WithJsonSchema({"type": "integer", "minimum": 0, "maximum": 100}),
]
MemoryLimit = Annotated[
    int,
    BeforeValidator(_memory_bytes),
    PlainSerializer(format_bytes, return_type=str, when_used="json"),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPE])?$"},
                {"type": "integer", "minimum": _MIN_PINNED_MEMORY},
            ],
            "description": "A Kubernetes quantity of bytes, at least 1Mi (e.g. 512Mi, 4Gi).",
        }
    ),
]
"""Bytes; written as a Quantity (``4Gi``) or an integer, serialized back as a Quantity."""
DeviceKey = Annotated[
    str,
    BeforeValidator(_device_key),
    WithJsonSchema({"type": "string", "pattern": _DEVICE_KEY.pattern}),
]


# --- models ------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        field_title_generator=lambda name, field: field.alias or name,
    )


class TimeSlicingConfig(_Strict):
    """Settings of strategy ``TimeSlicing``."""

    interval: Annotated[TimeSlicingInterval, _one_of(TimeSlicingInterval)] = (
        TimeSlicingInterval.DEFAULT
    )


class MpsConfig(_Strict):
    """Settings of strategy ``MPS``; a field left out keeps the MPS daemon's default."""

    default_active_thread_percentage: Percentage | None = Field(
        None, alias="defaultActiveThreadPercentage"
    )
    default_pinned_device_memory_limit: MemoryLimit | None = Field(
        None, alias="defaultPinnedDeviceMemoryLimit"
    )
    default_per_device_pinned_memory_limit: dict[DeviceKey, MemoryLimit] | None = Field(
        None, alias="defaultPerDevicePinnedMemoryLimit"
    )


# Each settings block belongs to one strategy: (field name, alias, strategy).
_SETTINGS: Final = (
    ("time_slicing", "timeSlicing", SharingStrategy.TIME_SLICING),
    ("mps", "mps", SharingStrategy.MPS),
)


def _settings_rules(schema: dict[str, Any]) -> None:
    """Say in the JSON Schema what ``_Sharing._check_settings`` enforces."""
    schema["allOf"] = [
        {
            "if": {"required": [alias]},
            "then": {"required": ["strategy"], "properties": {"strategy": {"const": strategy}}},
        }
        for _, alias, strategy in _SETTINGS
        if alias in schema["properties"]
    ]


class _Sharing(_Strict):
    """Shared by both kinds: the strategy, and one settings block that must match it.

    Invariant after validation: strategy ``TimeSlicing`` has ``time_slicing`` set (where
    the kind has it), ``MPS`` has ``mps`` set, and no other strategy has either.
    """

    model_config = ConfigDict(json_schema_extra=_settings_rules)

    strategy: Annotated[SharingStrategy, _one_of(SharingStrategy)] = SharingStrategy.EXCLUSIVE
    mps: MpsConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_settings(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        for name, alias, strategy in _SETTINGS:
            present = name in data or alias in data
            if name in cls.model_fields and data.get("strategy") == strategy and not present:
                data = {**data, alias: {}}
        return data

    @model_validator(mode="after")
    def _check_settings(self) -> _Sharing:
        for name, alias, strategy in _SETTINGS:
            if getattr(self, name, None) is not None and self.strategy != strategy:
                raise PydanticCustomError(
                    "drasil_conflict",
                    "{field} needs strategy {strategy}",
                    {
                        "field": alias,
                        "strategy": strategy.value,
                        "current": self.strategy.value,
                        "allowed": (strategy.value,),
                    },
                )
        return self


class GpuSharing(_Sharing):
    """Sharing of a full GPU: ``Exclusive``, ``TimeSlicing`` (with an interval) or ``MPS``."""

    time_slicing: TimeSlicingConfig | None = Field(None, alias="timeSlicing")


class MigDeviceSharing(_Sharing):
    """Sharing of a MIG device: ``Exclusive``, ``TimeSlicing`` or ``MPS``.

    As in NVIDIA's driver, MIG devices may be time-sliced and shared through MPS, but
    there is no ``timeSlicing`` block: the time-slice interval is a setting of the
    parent GPU, which other claims may be using, so one claim must not change it.
    """


def _require_type_meta(schema: dict[str, Any]) -> None:
    # Python callers may leave apiVersion/kind to their defaults; documents may not.
    schema["required"] = ["apiVersion", "kind"]


class GpuConfig(_Strict):
    """Config for full GPUs (devices of type ``gpu``). Without ``sharing``: Exclusive."""

    model_config = ConfigDict(json_schema_extra=_require_type_meta)

    api_version: Literal["resource.drasil.dev/v1beta1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["GpuConfig"] = "GpuConfig"
    sharing: GpuSharing = Field(default_factory=GpuSharing)


class MigDeviceConfig(_Strict):
    """Config for MIG devices (type ``mig``); see ``MigDeviceSharing``. Default: Exclusive."""

    model_config = ConfigDict(json_schema_extra=_require_type_meta)

    api_version: Literal["resource.drasil.dev/v1beta1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["MigDeviceConfig"] = "MigDeviceConfig"
    sharing: MigDeviceSharing = Field(default_factory=MigDeviceSharing)


OpaqueConfig = GpuConfig | MigDeviceConfig
KINDS: Final[Mapping[str, type[GpuConfig] | type[MigDeviceConfig]]] = {
    "GpuConfig": GpuConfig,
    "MigDeviceConfig": MigDeviceConfig,
}


# --- reading JSON and YAML strictly ------------------------------------------------


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _fail(f'duplicate key "{key}": each key may appear once', value=key)
        result[key] = value
    return result


def _no_constant(name: str) -> object:
    raise _fail(f"invalid JSON: {name} is not a JSON number", value=name)


def load_json(text: str) -> Any:
    """Parse JSON, rejecting duplicate keys and NaN/Infinity; errors are ConfigError."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except json.JSONDecodeError as err:
        raise _fail(f"invalid JSON: {err.msg} (line {err.lineno}, column {err.colno})") from None


def _where(node: yaml.Node) -> str:
    return f"line {node.start_mark.line + 1}, column {node.start_mark.column + 1}"


def _json_key(key: object, node: yaml.Node) -> str:
    # kubectl turns YAML into JSON, where `0: 4Gi` has the key "0"; do the same.
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, str | int | float):
        return str(key)
    raise _fail(f"invalid YAML: a key must be a string ({_where(node)})", value=key)


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that rejects duplicate keys (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        self.flatten_mapping(node)
        mapping: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = _json_key(self.construct_object(key_node, deep=deep), key_node)
            if key in mapping:
                message = f'duplicate key "{key}" ({_where(key_node)}): each key may appear once'
                raise _fail(message, value=key)
            mapping[key] = self.construct_object(value_node, deep=deep)
        return mapping


def load_documents(text: str) -> list[Any]:
    """Parse JSON (text starting with ``{``) or YAML documents; empty documents are dropped."""
    if text.lstrip().startswith("{"):
        return [load_json(text)]
    try:
        documents = list(yaml.load_all(text, Loader=_StrictLoader))
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise _fail(f"invalid YAML: {err.problem or err.context}{where}") from None
    except yaml.YAMLError as err:
        raise _fail(f"invalid YAML: {err}") from None
    return [document for document in documents if document is not None]


# --- decoding ----------------------------------------------------------------------


def _check_size(size: int) -> None:
    if size > MAX_PARAMETERS_BYTES:
        raise _fail(
            f"config is too large ({size} bytes or more): the API limits opaque parameters "
            f"to {MAX_PARAMETERS_BYTES} bytes (10 KiB); leave out settings that repeat defaults",
            value=size,
        )


def _encoded_size(document: object) -> int:
    """The size kubectl would send (compact JSON), counted only up to just past the
    limit, so a YAML alias bomb is never expanded in full."""
    encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str)
    size = 0
    try:
        for chunk in encoder.iterencode(document):
            size += len(chunk.encode())
            if size > MAX_PARAMETERS_BYTES:
                break
    except ValueError as err:  # a YAML anchor that contains itself
        raise _fail(f"config cannot be written as JSON: {err}") from None
    return size


def _document(raw: bytes | str | Mapping[str, Any]) -> object:
    if isinstance(raw, bytes):
        try:
            raw = raw.decode()
        except UnicodeDecodeError as err:
            raise _fail(f"config is not UTF-8: {err.reason} at byte {err.start}") from None
    if not isinstance(raw, str):
        document = dict(raw) if isinstance(raw, Mapping) else raw
        _check_size(_encoded_size(document))
        return document
    # On the wire the API limit applies to the raw bytes.
    _check_size(len(raw.encode()))
    documents = load_documents(raw)
    if len(documents) != 1:
        raise _fail(f"expected one config document, found {len(documents)}", value=len(documents))
    return documents[0]


def _problem(value: object) -> str:
    return "required field is missing" if value is None else f"unsupported value {_show(value)}"


def _type_meta_issues(document: Mapping[str, Any]) -> list[ConfigIssue]:
    issues = []
    version = document.get("apiVersion")
    if version != API_VERSION:
        message = f'{_problem(version)}: the supported API version is "{API_VERSION}"'
        issues.append(ConfigIssue("apiVersion", version, message, (API_VERSION,)))
    kind = document.get("kind")
    if kind not in KINDS:
        message = f"{_problem(kind)}: supported kinds are {_quoted(KINDS)}"
        issues.append(ConfigIssue("kind", kind, message, tuple(KINDS)))
    return issues


def decode_config(raw: bytes | str | Mapping[str, Any]) -> OpaqueConfig:
    """Decode one ``GpuConfig`` or ``MigDeviceConfig`` from JSON/YAML text or a mapping.

    Defaults are filled in (no ``sharing`` means Exclusive; see ``_Sharing`` for the
    settings blocks). Raises ``ConfigError`` listing every problem found.
    """
    document = _document(raw)
    if not isinstance(document, Mapping):
        message = f"a config must be an object with apiVersion and kind ({_quoted(KINDS)})"
        raise _fail(f"{message}, got {_show(document)}", value=document)
    issues = _type_meta_issues(document)
    if issues:
        raise ConfigError(issues)
    model = KINDS[document["kind"]]
    try:
        return model.model_validate(document, strict=True)
    except ValidationError as err:
        raise ConfigError([_issue(error, model) for error in err.errors()]) from None


# --- pydantic errors as user messages ----------------------------------------------

_TYPE_NAMES: Final = {
    "int_type": "an integer",
    "string_type": "a string",
    "bool_type": "a boolean",
    "dict_type": "an object",
    "model_type": "an object",
}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _path(loc: Sequence[int | str]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _IDENTIFIER.match(part):
            text += f".{part}" if text else part
        else:
            text += f"[{json.dumps(part)}]"
    return text


def _model_at(model: type[BaseModel], loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The model class validating the object at ``loc`` (models nest as ``M | None``)."""
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None:
            return None
        field = next(
            (f for name, f in current.model_fields.items() if part in (name, f.alias)), None
        )
        if field is None:
            return None
        candidates = get_args(field.annotation) or (field.annotation,)
        current = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
    return current


def _issue(error: ErrorDetails, model: type[BaseModel]) -> ConfigIssue:
    loc, value = list(error["loc"]), error["input"]
    ctx = error.get("ctx", {})
    allowed = tuple(str(item) for item in ctx.get("allowed", ()))
    kind, what = error["type"], "value"
    if loc and loc[-1] == "[key]":
        loc, what = loc[:-1], "key"
    if kind == "extra_forbidden":
        owner = _model_at(model, loc[:-1])
        allowed = tuple(f.alias or n for n, f in owner.model_fields.items()) if owner else ()
        message = f"unknown field; allowed fields are {_quoted(allowed)}"
    elif kind == "drasil_unsupported":
        message = f"unsupported {what} {_show(value)}: allowed values are {_quoted(allowed)}"
    elif kind == "drasil_conflict":
        loc, value = [*loc, ctx["field"]], ctx["current"]
        message = (
            f'not allowed with strategy {_show(value)}: only with strategy "{ctx["strategy"]}"'
        )
    elif kind in _TYPE_NAMES:
        allowed = (_TYPE_NAMES[kind],)
        message = f"invalid {what} {_show(value)}: must be {_TYPE_NAMES[kind]}"
    else:
        message = f"invalid {what} {_show(value)}: {error['msg']}"
    return ConfigIssue(path=_path(loc), value=value, message=message, allowed=allowed)


# --- JSON Schema -------------------------------------------------------------------


def config_json_schema(kind: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one kind; unknown fields are not allowed."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}: supported kinds are {_quoted(KINDS)}")
    schema = KINDS[kind].model_json_schema(by_alias=True)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def schema_files() -> dict[Path, str]:
    """The checked-in schema files and the text each must have."""
    return {
        SCHEMA_DIR / f"{kind.lower()}.json": json.dumps(config_json_schema(kind), indent=2) + "\n"
        for kind in KINDS
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m drasil.api.config")
    commands = parser.add_subparsers(dest="command", required=True)
    schemas = commands.add_parser("schemas", help=f"write the JSON Schemas into {SCHEMA_DIR}")
    schemas.add_argument("--check", action="store_true", help="only report stale files (exit 1)")
    args = parser.parse_args(argv)
    files = schema_files()
    if args.check:
        stale = [path for path, text in files.items() if _read(path) != text]
        for path in stale:
            print(f"{path} is stale: run python -m drasil.api.config schemas", file=sys.stderr)
        return 1 if stale else 0
    SCHEMA_DIR.mkdir(exist_ok=True)
    for path, text in files.items():
        path.write_text(text)
    return 0


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


if __name__ == "__main__":
    sys.exit(main())

"""The opaque config kinds of ``resource.drasil.dev/v1beta1``: GpuConfig and MigDeviceConfig.

Users put these into ``opaque.parameters`` of a DeviceClass or ResourceClaim config
entry. ``decode_config`` also reads the same-named kinds of NVIDIA's DRA driver,
``resource.nvidia.com/v1beta1`` (``drasil.api.nvidiaconfig``), into these models, so
nothing that uses a decoded config knows which of the two API versions it came from.

Decoding is strict because a config that is silently half-applied is worse than
one that is rejected: unknown fields, duplicate keys and wrong types ("5" for 5) are
errors, and every error names its JSON path, the bad value and what is allowed.

The input is untrusted: it is read by the bounded readers of ``drasil.api.documents``
(size, nesting, number of values, integers; no YAML anchors), and quantities are
bounded before they are parsed (``drasil.api.limits``). ``decode_config`` raises
``ConfigError`` and nothing else, whatever it is given.

``python -m drasil.api.config schemas`` regenerates the JSON Schemas in ``api/schemas/``.

The kinds and the wording of their errors are one contract that users, the controller
and the plugin all see through ``decode_config``; the sections below (field types,
models, decoding, messages, schemas) are read together when any of them changes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Final, Literal, get_args

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

from drasil.api import limits
from drasil.api.documents import (
    ConfigError,
    ConfigIssue,
    StrictModel,
    check_structure,
    fail,
    json_path,
    load_documents,
    valid_text,
)
from drasil.api.limits import (
    MAX_BYTES,
    MAX_QUANTITY_CHARS,
)
from drasil.api.quantity import QuantityError, QuantityRangeError, format_bytes, parse_quantity

API_VERSION: Final = "resource.drasil.dev/v1beta1"
NVIDIA_API_VERSION: Final = "resource.nvidia.com/v1beta1"
"""NVIDIA's DRA driver's config kinds (``drasil.api.nvidiaconfig``), decoded into drasil's."""
MAX_PARAMETERS_BYTES: Final = limits.MAX_PARAMETERS_BYTES
"""The API server's limit on ``opaque.parameters`` (OpaqueParametersMaxLength)."""

_MIN_PINNED_MEMORY: Final = 2**20
SCHEMA_DIR: Final = Path(__file__).parent / "schemas"


# --- messages --------------------------------------------------------------------


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


def _too_many_bytes() -> PydanticCustomError:
    reason = f"at most {MAX_BYTES} bytes (8Ei - 1)"
    allowed = (">=1Mi", f"<={MAX_BYTES}")
    return PydanticCustomError("drasil_range", "{reason}", {"reason": reason, "allowed": allowed})


def _memory_bytes(value: object) -> object:
    """A Quantity (``512Mi`` or a plain integer) as a whole number of bytes, 1Mi to 2^63-1."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _invalid("must be a quantity such as 512Mi or 4Gi", ">=1Mi")
    if isinstance(value, int):
        amount = value  # compared, never converted: an int of any size costs nothing here
    elif len(value) > MAX_QUANTITY_CHARS:
        raise _invalid(f"too long: a quantity has at most {MAX_QUANTITY_CHARS} characters")
    else:
        try:
            quantity = parse_quantity(value)
        except QuantityRangeError as err:
            if err.too_large:
                raise _too_many_bytes() from None
            raise _invalid("must be a whole number of bytes of at least 1Mi", ">=1Mi") from None
        except QuantityError:
            raise _invalid("must be a quantity such as 512Mi or 4Gi", ">=1Mi") from None
        if quantity != quantity.to_integral_value():
            raise _invalid("must be a whole number of bytes of at least 1Mi", ">=1Mi")
        amount = int(quantity)  # below 1e64: at most 64 digits
    if amount > MAX_BYTES:
        raise _too_many_bytes()
    if amount < _MIN_PINNED_MEMORY:
        raise _invalid("must be a whole number of bytes of at least 1Mi", ">=1Mi")
    return amount


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
                {
                    "type": "string",
                    "pattern": r"^[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPE])?$",
                    "maxLength": MAX_QUANTITY_CHARS,
                },
                {"type": "integer", "minimum": _MIN_PINNED_MEMORY, "maximum": MAX_BYTES},
            ],
            "description": (
                "A Kubernetes quantity of bytes, at least 1Mi and at most 2^63-1 (e.g. 512Mi, 4Gi)."
            ),
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


class TimeSlicingConfig(StrictModel):
    """Settings of strategy ``TimeSlicing``."""

    interval: Annotated[TimeSlicingInterval, _one_of(TimeSlicingInterval)] = (
        TimeSlicingInterval.DEFAULT
    )


class MpsConfig(StrictModel):
    """Settings of strategy ``MPS``: the limits its daemon holds (docs/sharing.md).

    The fields of NVIDIA's ``mpsConfig``: ``defaultActiveThreadPercentage`` (0 to 100),
    ``defaultPinnedDeviceMemoryLimit``, ``defaultPerDevicePinnedMemoryLimit`` (by device
    index or UUID) and ``multiUser`` (a daemon that serves more than one user).
    """

    default_active_thread_percentage: Percentage | None = Field(
        None, alias="defaultActiveThreadPercentage"
    )
    default_pinned_device_memory_limit: MemoryLimit | None = Field(
        None, alias="defaultPinnedDeviceMemoryLimit"
    )
    default_per_device_pinned_memory_limit: dict[DeviceKey, MemoryLimit] | None = Field(
        None, alias="defaultPerDevicePinnedMemoryLimit"
    )
    multi_user: bool | None = Field(None, alias="multiUser")


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


class _Sharing(StrictModel):
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
    """Sharing of a full GPU: ``Exclusive``, ``TimeSlicing`` (with an interval) or ``MPS``.

    ``MPS`` on a share of a consumable GPU (``--gpu-sharing consumable``) runs the
    GPU's shared daemon with the share's limits; on a GPU allocated whole it runs one
    daemon for the claim (EXCLUSIVE_PROCESS, limits from ``mps``) that every container
    of the claim's Pods joins. Refused on an admin-access request.
    """

    time_slicing: TimeSlicingConfig | None = Field(None, alias="timeSlicing")


class MigDeviceSharing(_Sharing):
    """Sharing of a MIG device: ``Exclusive``, ``TimeSlicing`` or ``MPS``.

    ``MPS`` on a share of a MIG placement (``--mig-mode dynamic`` with
    ``--gpu-sharing consumable``) runs the MIG instance's shared daemon, which must be
    MPS; on a MIG device allocated whole it runs one daemon for the claim on top of the
    MIG instance. Refused on an admin-access request. There is no ``timeSlicing``
    block: the time-slice interval is a setting of the parent GPU, which other claims
    may be using, so one claim must not change it, and ``TimeSlicing`` changes nothing
    on the GPU (the processes of the containers sharing the MIG device take turns, as
    they would).
    """


def _require_type_meta(schema: dict[str, Any]) -> None:
    # Python callers may leave apiVersion/kind to their defaults; documents may not.
    schema["required"] = ["apiVersion", "kind"]


class GpuConfig(StrictModel):
    """Config for full GPUs (devices of type ``gpu``). Without ``sharing``: Exclusive."""

    model_config = ConfigDict(json_schema_extra=_require_type_meta)

    api_version: Literal["resource.drasil.dev/v1beta1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["GpuConfig"] = "GpuConfig"
    sharing: GpuSharing = Field(default_factory=GpuSharing)


class MigDeviceConfig(StrictModel):
    """Config for MIG devices (type ``mig``); see ``MigDeviceSharing``. Default: Exclusive."""

    model_config = ConfigDict(json_schema_extra=_require_type_meta)

    api_version: Literal["resource.drasil.dev/v1beta1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["MigDeviceConfig"] = "MigDeviceConfig"
    sharing: MigDeviceSharing = Field(default_factory=MigDeviceSharing)


class IommuBackendPolicy(StrEnum):
    """Which VFIO interface a passthrough device's container gets."""

    LEGACY_ONLY = "LegacyOnly"  # the IOMMU group: /dev/vfio/<group>
    # The device's own node, /dev/vfio/devices/vfio<N>, where the kernel has iommufd
    # (/dev/iommu); the group where it has not.
    PREFER_IOMMUFD = "PreferIommuFD"


class IommuConfig(StrictModel):
    """The VFIO nodes of a passthrough device. ``enableAPIDevice`` adds the API device
    (``/dev/vfio/vfio``; ``/dev/iommu`` with iommufd), which KubeVirt's launcher needs."""

    backend_policy: Annotated[IommuBackendPolicy, _one_of(IommuBackendPolicy)] = Field(
        IommuBackendPolicy.LEGACY_ONLY, alias="backendPolicy"
    )
    enable_api_device: bool = Field(True, alias="enableAPIDevice")


_NOT_SHARED: Final = GpuSharing()


class VfioDeviceConfig(StrictModel):
    """Config for GPUs passed through to VMs (types ``vfio``, ``amdgpu-vfio``;
    docs/passthrough.md). A VM gets its GPU whole: never shared."""

    model_config = ConfigDict(json_schema_extra=_require_type_meta)

    api_version: Literal["resource.drasil.dev/v1beta1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["VfioDeviceConfig"] = "VfioDeviceConfig"
    iommu: IommuConfig = Field(default_factory=IommuConfig)

    @property
    def sharing(self) -> GpuSharing:
        """Exclusive: what the sharing code reads of every kind."""
        return _NOT_SHARED


OpaqueConfig = GpuConfig | MigDeviceConfig | VfioDeviceConfig
KINDS: Final[Mapping[str, type[GpuConfig] | type[MigDeviceConfig] | type[VfioDeviceConfig]]] = {
    "GpuConfig": GpuConfig,
    "MigDeviceConfig": MigDeviceConfig,
    "VfioDeviceConfig": VfioDeviceConfig,
}
API_VERSIONS: Final[Mapping[str, tuple[str, ...]]] = {
    API_VERSION: tuple(KINDS),
    NVIDIA_API_VERSION: ("GpuConfig", "MigDeviceConfig", "VfioDeviceConfig"),
}
"""The API versions ``decode_config`` reads, and the kinds of each."""


# --- decoding ----------------------------------------------------------------------


def _check_size(size: int) -> None:
    if size > MAX_PARAMETERS_BYTES:
        raise fail(
            f"config is too large ({size} bytes or more): the API limits opaque parameters "
            f"to {MAX_PARAMETERS_BYTES} bytes (10 KiB); leave out settings that repeat defaults",
            value=size,
        )


def _encoded_size(document: object) -> int:
    """The size kubectl would send (compact JSON), counted only up to just past the
    limit. ``_check_structure`` has bounded the document first: no deep nesting (the
    encoder recurses), no cycles, no integer too long to write."""
    encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str)
    size = 0
    for chunk in encoder.iterencode(document):
        size += len(chunk.encode(errors="surrogatepass"))
        if size > MAX_PARAMETERS_BYTES:
            break
    return size


def _document(raw: object) -> object:
    if not isinstance(raw, str | bytes):
        document = dict(raw) if isinstance(raw, Mapping) else raw
        check_structure(document)
        _check_size(_encoded_size(document))
        return document
    text = valid_text(raw)
    # On the wire the API limit applies to the raw bytes.
    _check_size(len(text.encode()))
    documents = load_documents(text)
    if len(documents) != 1:
        raise fail(f"expected one config document, found {len(documents)}", value=len(documents))
    check_structure(documents[0])
    return documents[0]


def _problem(value: object) -> str:
    return "required field is missing" if value is None else f"unsupported value {_show(value)}"


def _type_meta_issues(document: Mapping[str, Any]) -> list[ConfigIssue]:
    """apiVersion must be one of ``API_VERSIONS``, and kind one of that version's kinds."""
    issues = []
    version = document.get("apiVersion")
    if not (isinstance(version, str) and version in API_VERSIONS):
        versions = tuple(API_VERSIONS)
        message = f"{_problem(version)}: the supported API versions are {_quoted(versions)}"
        issues.append(ConfigIssue("apiVersion", version, message, versions))
        kinds = tuple(dict.fromkeys(kind for ks in API_VERSIONS.values() for kind in ks))
        of_version = ""
    else:
        kinds, of_version = API_VERSIONS[version], f' of "{version}"'
    kind = document.get("kind")
    if not (isinstance(kind, str) and kind in kinds):
        message = f"{_problem(kind)}: supported kinds{of_version} are {_quoted(kinds)}"
        issues.append(ConfigIssue("kind", kind, message, kinds))
    return issues


def config_api_version(document: Mapping[str, Any]) -> str:
    """The API version of a config that decodes: ``API_VERSION`` or ``NVIDIA_API_VERSION``.

    ``decode_config`` returns drasil's models for both; this tells a caller (a log line,
    an explanation) which of the two the user wrote. Raises ``ConfigError`` for a
    document of neither, as ``decode_config`` would.
    """
    issues = _type_meta_issues(document)
    if issues:
        raise ConfigError(issues)
    return str(document["apiVersion"])


def decode_config(raw: bytes | str | Mapping[str, Any]) -> OpaqueConfig:
    """Decode one ``GpuConfig`` or ``MigDeviceConfig`` from JSON/YAML text or a mapping.

    Either API version of ``API_VERSIONS``: NVIDIA's kinds are decoded by their own
    rules (``drasil.api.nvidiaconfig``) into the same models. Defaults are filled in
    (no ``sharing`` means Exclusive; see ``_Sharing`` for the settings blocks). Raises
    ``ConfigError`` listing every problem found.
    """
    document = _document(raw)
    if not isinstance(document, Mapping):
        message = f"a config must be an object with apiVersion and kind ({_quoted(KINDS)})"
        raise fail(f"{message}, got {_show(document)}", value=document)
    if config_api_version(document) == NVIDIA_API_VERSION:
        # nvidiaconfig builds on this module's models and readers: imported when needed.
        from drasil.api.nvidiaconfig import decode_nvidia  # noqa: PLC0415

        return decode_nvidia(document)
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
    if kind in {"missing", "drasil_missing"}:
        value = None
        listed = f": allowed values are {_quoted(allowed)}" if allowed else ""
        message = f"required field is missing{listed}"
    elif kind == "extra_forbidden":
        owner = _model_at(model, loc[:-1])
        allowed = tuple(f.alias or n for n, f in owner.model_fields.items()) if owner else ()
        message = f"unknown field; allowed fields are {_quoted(allowed)}"
    elif kind == "drasil_unsupported":
        message = f"unsupported {what} {_show(value)}: allowed values are {_quoted(allowed)}"
        if ctx.get("hint"):
            message += f" ({ctx['hint']})"
    elif kind == "drasil_conflict":
        loc, value = [*loc, ctx["field"]], ctx["current"]
        message = (
            f'not allowed with strategy {_show(value)}: only with strategy "{ctx["strategy"]}"'
        )
    elif kind == "drasil_range":
        message = f"{_show(value)} is out of range: {ctx['reason']}"
    elif kind in _TYPE_NAMES:
        allowed = (_TYPE_NAMES[kind],)
        message = f"invalid {what} {_show(value)}: must be {_TYPE_NAMES[kind]}"
    else:
        message = f"invalid {what} {_show(value)}: {error['msg']}"
    return ConfigIssue(path=json_path(loc), value=value, message=message, allowed=allowed)


# --- JSON Schema -------------------------------------------------------------------


def _models(api_version: str) -> Mapping[str, type[BaseModel]]:
    if api_version == API_VERSION:
        return KINDS
    if api_version == NVIDIA_API_VERSION:
        from drasil.api.nvidiaconfig import NVIDIA_KINDS  # noqa: PLC0415 (see decode_config)

        return NVIDIA_KINDS
    versions = _quoted(API_VERSIONS)
    raise ValueError(f"unknown API version {api_version!r}: supported versions are {versions}")


def config_json_schema(kind: str, *, api_version: str = API_VERSION) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one kind; unknown fields are not allowed.

    ``api_version`` ``NVIDIA_API_VERSION``: the schema of NVIDIA's kind of that name,
    as ``decode_config`` reads it.
    """
    models = _models(api_version)
    if kind not in models:
        raise ValueError(f"unknown kind {kind!r}: supported kinds are {_quoted(models)}")
    schema = models[kind].model_json_schema(by_alias=True)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


# The schema file of each API version's kinds is named <prefix><kind>.json.
_SCHEMA_PREFIXES: Final = {API_VERSION: "", NVIDIA_API_VERSION: "nvidia-"}


def schema_files() -> dict[Path, str]:
    """The checked-in schema files and the text each must have."""
    return {
        SCHEMA_DIR / f"{prefix}{kind.lower()}.json": json.dumps(
            config_json_schema(kind, api_version=version), indent=2
        )
        + "\n"
        for version, prefix in _SCHEMA_PREFIXES.items()
        for kind in API_VERSIONS[version]
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

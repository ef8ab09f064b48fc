"""NVIDIA's opaque config kinds, ``resource.nvidia.com/v1beta1``, read into drasil's.

Users coming from NVIDIA's DRA driver (kubernetes-sigs/dra-driver-nvidia-gpu) write
``GpuConfig`` and ``MigDeviceConfig`` of NVIDIA's API version. ``decode_config``
(``drasil.api.config``) hands such a document to ``decode_nvidia``, which decodes it by
NVIDIA's rules and returns drasil's own ``GpuConfig`` or ``MigDeviceConfig``, so the
plugin, the controller and ``drasil validate-config`` see one model whichever version
the user wrote.

NVIDIA's shape, and how it maps onto drasil's (docs/nvidia-dra.md):

- no ``sharing`` (or ``sharing: null``): not shared, drasil's ``Exclusive``;
- ``sharing.strategy`` is required and is ``TimeSlicing`` or ``MPS``, nothing else
  (NVIDIA has no ``Exclusive`` value: a device is exclusive without ``sharing``);
- ``sharing.timeSlicingConfig`` (``GpuConfig`` only) becomes ``sharing.timeSlicing``,
  its ``interval`` ``Default`` where the block or the interval is left out;
- ``sharing.mpsConfig`` becomes ``sharing.mps`` (empty where left out); its fields
  are drasil's ``MpsConfig`` field for field, ``multiUser`` included;
- a settings block of the other strategy is refused, as NVIDIA's validation does.

Decoding is as strict as NVIDIA's StrictDecoder and as drasil's own (unknown fields,
duplicate keys, wrong types), through drasil's bounded readers, and every error names
the path as the user wrote it (``sharing.mpsConfig.defaultActiveThreadPercentage``).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from drasil.api.config import (
    NVIDIA_API_VERSION,
    GpuConfig,
    GpuSharing,
    IommuBackendPolicy,
    IommuConfig,
    MigDeviceConfig,
    MigDeviceSharing,
    MpsConfig,
    OpaqueConfig,
    SharingStrategy,
    TimeSlicingConfig,
    TimeSlicingInterval,
    VfioDeviceConfig,
    _document,
    _issue,
    _one_of,
    _quoted,
    _require_type_meta,
    _show,
    _type_meta_issues,
)
from drasil.api.documents import ConfigError, ConfigIssue, StrictModel, fail

__all__ = [
    "NVIDIA_API_VERSION",
    "NVIDIA_KINDS",
    "NvidiaGpuConfig",
    "NvidiaGpuSharing",
    "NvidiaMigDeviceConfig",
    "NvidiaMigDeviceSharing",
    "NvidiaSharingStrategy",
    "NvidiaTimeSlicingConfig",
    "NvidiaVfioDeviceConfig",
    "decode_nvidia",
]


class NvidiaSharingStrategy(StrEnum):
    """NVIDIA's sharing strategies; drasil's of the same names."""

    TIME_SLICING = "TimeSlicing"
    MPS = "MPS"


_STRATEGIES: Final = tuple(member.value for member in NvidiaSharingStrategy)


def _strategy(value: object) -> object:
    # Required, though pydantic's own "missing" error would not list the values.
    if value is None:
        raise PydanticCustomError("drasil_missing", "required field", {"allowed": _STRATEGIES})
    if isinstance(value, NvidiaSharingStrategy):
        return value
    if isinstance(value, str) and value in _STRATEGIES:
        return NvidiaSharingStrategy(value)
    ctx: dict[str, object] = {"allowed": _STRATEGIES}
    if value == SharingStrategy.EXCLUSIVE.value:
        ctx["hint"] = 'a device is not shared where "sharing" is left out'
    raise PydanticCustomError("drasil_unsupported", "unsupported value", ctx)


Strategy = Annotated[NvidiaSharingStrategy, BeforeValidator(_strategy)]


class NvidiaTimeSlicingConfig(StrictModel):
    """NVIDIA's ``timeSlicingConfig``: ``interval``, ``Default`` when left out or null."""

    interval: Annotated[TimeSlicingInterval, _one_of(TimeSlicingInterval)] | None = None


# Each settings block belongs to one strategy: (field name, alias, strategy).
_SETTINGS: Final = (
    ("time_slicing_config", "timeSlicingConfig", NvidiaSharingStrategy.TIME_SLICING),
    ("mps_config", "mpsConfig", NvidiaSharingStrategy.MPS),
)


def _sharing_schema(schema: dict[str, Any]) -> None:
    """Say in the JSON Schema what ``_NvidiaSharing`` enforces: a strategy, and settings
    blocks of that strategy only."""
    schema["required"] = ["strategy"]
    schema["properties"]["strategy"].pop("default", None)
    schema["allOf"] = [
        {
            # A block given as null is no block (decode_nvidia reads it as left out).
            "if": {"required": [alias], "properties": {alias: {"type": "object"}}},
            "then": {"properties": {"strategy": {"const": strategy}}},
        }
        for _, alias, strategy in _SETTINGS
        if alias in schema["properties"]
    ]


class _NvidiaSharing(StrictModel):
    """Shared by both of NVIDIA's kinds: a required strategy, and ``mpsConfig``."""

    model_config = ConfigDict(json_schema_extra=_sharing_schema)

    # None only until validated: _strategy refuses it, as "required field is missing".
    strategy: Strategy = Field(None, validate_default=True)
    mps_config: MpsConfig | None = Field(None, alias="mpsConfig")

    @model_validator(mode="after")
    def _check_settings(self) -> _NvidiaSharing:
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

    def _mps(self) -> MpsConfig:
        return self.mps_config if self.mps_config is not None else MpsConfig()


class NvidiaGpuSharing(_NvidiaSharing):
    """NVIDIA's ``GpuConfig.sharing``: ``TimeSlicing`` (``timeSlicingConfig``) or ``MPS``."""

    time_slicing_config: NvidiaTimeSlicingConfig | None = Field(None, alias="timeSlicingConfig")

    def to_drasil(self) -> GpuSharing:
        if self.strategy is NvidiaSharingStrategy.MPS:
            return GpuSharing(strategy=SharingStrategy.MPS, mps=self._mps())
        given = self.time_slicing_config
        interval = given.interval if given is not None else None
        settings = TimeSlicingConfig(interval=interval or TimeSlicingInterval.DEFAULT)
        return GpuSharing(strategy=SharingStrategy.TIME_SLICING, time_slicing=settings)


class NvidiaMigDeviceSharing(_NvidiaSharing):
    """NVIDIA's ``MigDeviceConfig.sharing``: ``TimeSlicing`` or ``MPS`` (``mpsConfig``).

    No ``timeSlicingConfig``, in NVIDIA's API as in drasil's: the interval is a setting
    of the parent GPU.
    """

    def to_drasil(self) -> MigDeviceSharing:
        if self.strategy is NvidiaSharingStrategy.MPS:
            return MigDeviceSharing(strategy=SharingStrategy.MPS, mps=self._mps())
        return MigDeviceSharing(strategy=SharingStrategy.TIME_SLICING)


class NvidiaGpuConfig(StrictModel):
    """NVIDIA's ``GpuConfig``; ``to_drasil`` gives drasil's. Without ``sharing``: not shared."""

    model_config = ConfigDict(title="GpuConfig", json_schema_extra=_require_type_meta)

    api_version: Literal["resource.nvidia.com/v1beta1"] = Field(
        NVIDIA_API_VERSION, alias="apiVersion"
    )
    kind: Literal["GpuConfig"] = "GpuConfig"
    sharing: NvidiaGpuSharing | None = None

    def to_drasil(self) -> GpuConfig:
        if self.sharing is None:
            return GpuConfig()
        return GpuConfig(sharing=self.sharing.to_drasil())


class NvidiaMigDeviceConfig(StrictModel):
    """NVIDIA's ``MigDeviceConfig``; ``to_drasil`` gives drasil's. Without ``sharing``:
    not shared."""

    model_config = ConfigDict(title="MigDeviceConfig", json_schema_extra=_require_type_meta)

    api_version: Literal["resource.nvidia.com/v1beta1"] = Field(
        NVIDIA_API_VERSION, alias="apiVersion"
    )
    kind: Literal["MigDeviceConfig"] = "MigDeviceConfig"
    sharing: NvidiaMigDeviceSharing | None = None

    def to_drasil(self) -> MigDeviceConfig:
        if self.sharing is None:
            return MigDeviceConfig()
        return MigDeviceConfig(sharing=self.sharing.to_drasil())


class NvidiaIommuConfig(StrictModel):
    """NVIDIA's ``iommu`` block, with its defaults: the group, and no API device."""

    model_config = ConfigDict(title="IOMMUConfig")

    backend_policy: Annotated[IommuBackendPolicy, _one_of(IommuBackendPolicy)] = Field(
        IommuBackendPolicy.LEGACY_ONLY, alias="backendPolicy"
    )
    enable_api_device: bool = Field(False, alias="enableAPIDevice")


class NvidiaVfioDeviceConfig(StrictModel):
    """NVIDIA's ``VfioDeviceConfig`` (passthrough, alpha); ``to_drasil`` gives drasil's.
    NVIDIA's defaults differ from drasil's in one place: without ``enableAPIDevice``
    the container gets no ``/dev/vfio/vfio``, as under NVIDIA's driver."""

    model_config = ConfigDict(title="VfioDeviceConfig", json_schema_extra=_require_type_meta)

    api_version: Literal["resource.nvidia.com/v1beta1"] = Field(
        NVIDIA_API_VERSION, alias="apiVersion"
    )
    kind: Literal["VfioDeviceConfig"] = "VfioDeviceConfig"
    iommu: NvidiaIommuConfig = Field(default_factory=NvidiaIommuConfig)

    def to_drasil(self) -> VfioDeviceConfig:
        iommu = IommuConfig(
            backend_policy=self.iommu.backend_policy,
            enable_api_device=self.iommu.enable_api_device,
        )
        return VfioDeviceConfig(iommu=iommu)


NvidiaKind = type[NvidiaGpuConfig] | type[NvidiaMigDeviceConfig] | type[NvidiaVfioDeviceConfig]
NVIDIA_KINDS: Final[Mapping[str, NvidiaKind]] = {
    "GpuConfig": NvidiaGpuConfig,
    "MigDeviceConfig": NvidiaMigDeviceConfig,
    "VfioDeviceConfig": NvidiaVfioDeviceConfig,
}


def decode_nvidia(raw: bytes | str | Mapping[str, Any]) -> OpaqueConfig:
    """Decode one of NVIDIA's ``GpuConfig``/``MigDeviceConfig``/``VfioDeviceConfig`` into
    drasil's model.

    Takes what ``decode_config`` takes (text or a mapping, bounded by the same readers)
    and raises ``ConfigError`` listing every problem found; a config of drasil's own API
    version is refused here (``decode_config`` reads both).
    """
    document = _document(raw)
    if not isinstance(document, Mapping):
        message = f"a config must be an object with apiVersion and kind ({_quoted(NVIDIA_KINDS)})"
        raise fail(f"{message}, got {_show(document)}", value=document)
    issues = _type_meta_issues(document)
    version = document.get("apiVersion")
    if not issues and version != NVIDIA_API_VERSION:
        message = f'unsupported value {_show(version)}: the API version is "{NVIDIA_API_VERSION}"'
        issues = [ConfigIssue("apiVersion", version, message, (NVIDIA_API_VERSION,))]
    if issues:
        raise ConfigError(issues)
    model = NVIDIA_KINDS[document["kind"]]
    try:
        config = model.model_validate(document, strict=True)
    except ValidationError as err:
        raise ConfigError([_issue(error, model) for error in err.errors()]) from None
    return config.to_drasil()

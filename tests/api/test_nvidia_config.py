"""NVIDIA's opaque config kinds (resource.nvidia.com/v1beta1) decoded into drasil's models."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from drasil.api.config import (
    API_VERSION,
    API_VERSIONS,
    NVIDIA_API_VERSION,
    GpuConfig,
    GpuSharing,
    MigDeviceConfig,
    MigDeviceSharing,
    MpsConfig,
    SharingStrategy,
    TimeSlicingConfig,
    TimeSlicingInterval,
    config_api_version,
    config_json_schema,
    decode_config,
)
from drasil.api.documents import ConfigError
from drasil.api.nvidiaconfig import NVIDIA_KINDS, NvidiaGpuConfig, decode_nvidia

NVIDIA_STRATEGIES = 'allowed values are "TimeSlicing", "MPS"'


def gpu(sharing: Any = None, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"apiVersion": NVIDIA_API_VERSION, "kind": "GpuConfig", **extra}
    if sharing is not None:
        config["sharing"] = sharing
    return config


def mig(sharing: Any = None) -> dict[str, Any]:
    config: dict[str, Any] = {"apiVersion": NVIDIA_API_VERSION, "kind": "MigDeviceConfig"}
    if sharing is not None:
        config["sharing"] = sharing
    return config


def mps(**settings: Any) -> dict[str, Any]:
    return {"strategy": "MPS", "mpsConfig": settings}


def refusal(config: object) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        decode_config(config)  # type: ignore[arg-type]
    return caught.value


def time_sliced(interval: TimeSlicingInterval) -> GpuConfig:
    settings = TimeSlicingConfig(interval=interval)
    return GpuConfig(
        sharing=GpuSharing(strategy=SharingStrategy.TIME_SLICING, time_slicing=settings)
    )


def mps_gpu(**settings: Any) -> GpuConfig:
    return GpuConfig(sharing=GpuSharing(strategy=SharingStrategy.MPS, mps=MpsConfig(**settings)))


# --- what decodes, and into what ------------------------------------------------------

QUICKSTART_TIME_SLICING = """\
apiVersion: resource.nvidia.com/v1beta1
kind: GpuConfig
sharing:
  strategy: TimeSlicing
  timeSlicingConfig:
    interval: Long
"""

QUICKSTART_MPS = """\
apiVersion: resource.nvidia.com/v1beta1
kind: GpuConfig
sharing:
  strategy: MPS
  mpsConfig:
    defaultActiveThreadPercentage: 50
    defaultPinnedDeviceMemoryLimit: 10Gi
"""

QUICKSTART_MIG_MPS = """\
apiVersion: resource.nvidia.com/v1beta1
kind: MigDeviceConfig
sharing:
  strategy: MPS
  mpsConfig:
    defaultActiveThreadPercentage: 50
    defaultPinnedDeviceMemoryLimit: 10Gi
"""


def test_nvidia_quickstart_configs_decode_verbatim() -> None:
    assert decode_config(QUICKSTART_TIME_SLICING) == time_sliced(TimeSlicingInterval.LONG)
    expected = mps_gpu(
        default_active_thread_percentage=50, default_pinned_device_memory_limit=10 * 2**30
    )
    assert decode_config(QUICKSTART_MPS) == expected
    mig_mps = decode_config(QUICKSTART_MIG_MPS)
    assert isinstance(mig_mps, MigDeviceConfig)
    assert mig_mps.sharing.strategy is SharingStrategy.MPS
    assert mig_mps.sharing.mps == expected.sharing.mps


def test_the_result_is_drasils_own_model() -> None:
    config = decode_config(QUICKSTART_MPS)
    assert type(config) is GpuConfig
    assert config.api_version == API_VERSION
    # What drasil's own kind says the same way decodes to the same value.
    own = {
        "apiVersion": API_VERSION,
        "kind": "GpuConfig",
        "sharing": {
            "strategy": "MPS",
            "mps": {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"},
        },
    }
    assert decode_config(own) == config


@pytest.mark.parametrize("interval", list(TimeSlicingInterval))
def test_every_interval(interval: TimeSlicingInterval) -> None:
    config = gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval.value}})
    assert decode_config(config) == time_sliced(interval)


@pytest.mark.parametrize(
    "sharing",
    [
        {"strategy": "TimeSlicing"},
        {"strategy": "TimeSlicing", "timeSlicingConfig": {}},
        {"strategy": "TimeSlicing", "timeSlicingConfig": None},
        {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": None}},
        {"strategy": "TimeSlicing", "mpsConfig": None},
    ],
    ids=["no-block", "empty-block", "null-block", "null-interval", "null-mps"],
)
def test_time_slicing_defaults_to_interval_default(sharing: dict[str, Any]) -> None:
    assert decode_config(gpu(sharing)) == time_sliced(TimeSlicingInterval.DEFAULT)


@pytest.mark.parametrize(
    "sharing",
    [{"strategy": "MPS"}, mps(), {"strategy": "MPS", "mpsConfig": None}],
    ids=["no-block", "empty-block", "null-block"],
)
def test_mps_without_settings_is_empty_mps(sharing: dict[str, Any]) -> None:
    config = decode_config(gpu(sharing))
    assert config == mps_gpu()
    assert config.sharing.mps == MpsConfig()
    assert isinstance(config, GpuConfig)
    assert config.sharing.time_slicing is None


@pytest.mark.parametrize("kind", ["GpuConfig", "MigDeviceConfig"])
@pytest.mark.parametrize("sharing", [None, {"sharing": None}], ids=["absent", "null"])
def test_no_sharing_is_exclusive(kind: str, sharing: dict[str, Any] | None) -> None:
    config = decode_config({"apiVersion": NVIDIA_API_VERSION, "kind": kind, **(sharing or {})})
    assert config == (GpuConfig() if kind == "GpuConfig" else MigDeviceConfig())
    assert config.sharing.strategy is SharingStrategy.EXCLUSIVE


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"defaultActiveThreadPercentage": 0}, {"default_active_thread_percentage": 0}),
        ({"defaultActiveThreadPercentage": 100}, {"default_active_thread_percentage": 100}),
        ({"defaultPinnedDeviceMemoryLimit": "1Mi"}, {"default_pinned_device_memory_limit": 2**20}),
        (
            {"defaultPinnedDeviceMemoryLimit": "2G"},
            {"default_pinned_device_memory_limit": 2 * 10**9},
        ),
        ({"defaultPinnedDeviceMemoryLimit": 2**30}, {"default_pinned_device_memory_limit": 2**30}),
        (
            {
                "defaultPerDevicePinnedMemoryLimit": {
                    "0": "1Gi",
                    "GPU-12ab": "2Gi",
                    "MIG-3cd": 2**21,
                }
            },
            {
                "default_per_device_pinned_memory_limit": {
                    "0": 2**30,
                    "GPU-12ab": 2 * 2**30,
                    "MIG-3cd": 2**21,
                }
            },
        ),
        ({"multiUser": True}, {"multi_user": True}),
        ({"multiUser": False}, {"multi_user": False}),
    ],
    ids=[
        "percentage-0",
        "percentage-100",
        "pinned-1Mi",
        "pinned-decimal",
        "pinned-integer",
        "per-device",
        "multi-user",
        "single-user",
    ],
)
def test_every_mps_field(settings: dict[str, Any], expected: dict[str, Any]) -> None:
    assert decode_config(gpu(mps(**settings))) == mps_gpu(**expected)


def test_all_mps_fields_together_on_a_mig_device() -> None:
    settings = {
        "defaultActiveThreadPercentage": 25,
        "defaultPinnedDeviceMemoryLimit": "4Gi",
        "defaultPerDevicePinnedMemoryLimit": {"1": "3Gi"},
        "multiUser": True,
    }
    config = decode_config(json.dumps(mig(mps(**settings))))
    expected = MpsConfig.model_validate(settings)
    assert config == MigDeviceConfig(
        sharing=MigDeviceSharing(strategy=SharingStrategy.MPS, mps=expected)
    )
    assert expected.multi_user is True


def test_mig_device_time_slicing() -> None:
    config = decode_config(mig({"strategy": "TimeSlicing"}))
    assert config == MigDeviceConfig(
        sharing=MigDeviceSharing(strategy=SharingStrategy.TIME_SLICING)
    )


def test_multi_user_in_drasils_own_kind() -> None:
    own = {
        "apiVersion": API_VERSION,
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": {"multiUser": True}},
    }
    config = decode_config(own)
    assert config.sharing.mps is not None
    assert config.sharing.mps.multi_user is True
    assert MpsConfig().multi_user is None


def test_drasils_own_kinds_keep_decoding() -> None:
    own = {"apiVersion": API_VERSION, "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}}
    config = decode_config(own)
    assert isinstance(config, MigDeviceConfig)
    assert config.sharing.mps == MpsConfig()
    # drasil's own field names are not NVIDIA's, and the other way round.
    assert "unknown field" in str(refusal({**own, "sharing": mps()}))
    assert "unknown field" in str(refusal(gpu({"strategy": "MPS", "mps": {}})))


def test_which_api_version_a_config_came_from() -> None:
    assert API_VERSIONS == {
        API_VERSION: ("GpuConfig", "MigDeviceConfig", "VfioDeviceConfig"),
        NVIDIA_API_VERSION: ("GpuConfig", "MigDeviceConfig", "VfioDeviceConfig"),
    }
    assert config_api_version(gpu()) == NVIDIA_API_VERSION
    assert config_api_version({"apiVersion": API_VERSION, "kind": "GpuConfig"}) == API_VERSION
    with pytest.raises(ConfigError, match="supported API versions"):
        config_api_version({"apiVersion": "v1", "kind": "GpuConfig"})


def test_decode_nvidia_reads_only_nvidias_version() -> None:
    assert decode_nvidia(QUICKSTART_TIME_SLICING) == time_sliced(TimeSlicingInterval.LONG)
    assert decode_nvidia(gpu()) == GpuConfig()
    with pytest.raises(ConfigError) as caught:
        decode_nvidia({"apiVersion": API_VERSION, "kind": "GpuConfig"})
    assert str(caught.value) == (
        f'apiVersion: unsupported value "{API_VERSION}": the API version is "{NVIDIA_API_VERSION}"'
    )
    with pytest.raises(ConfigError, match="must be an object"):
        decode_nvidia("[1]")


def test_nvidia_models_map_to_drasils() -> None:
    config = NvidiaGpuConfig.model_validate(gpu({"strategy": "TimeSlicing"}))
    assert config.to_drasil() == time_sliced(TimeSlicingInterval.DEFAULT)
    assert NvidiaGpuConfig().to_drasil() == GpuConfig()


# --- refusals: path as written, the value, what is allowed -----------------------------

ERROR_CASES: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "strategy-exclusive",
        gpu({"strategy": "Exclusive"}),
        "sharing.strategy",
        f'unsupported value "Exclusive": {NVIDIA_STRATEGIES} '
        '(a device is not shared where "sharing" is left out)',
    ),
    (
        "strategy-empty",
        gpu({"strategy": ""}),
        "sharing.strategy",
        f'unsupported value "": {NVIDIA_STRATEGIES}',
    ),
    (
        "strategy-unknown",
        gpu({"strategy": "Foo"}),
        "sharing.strategy",
        f'unsupported value "Foo": {NVIDIA_STRATEGIES}',
    ),
    (
        "strategy-lowercase",
        gpu({"strategy": "mps"}),
        "sharing.strategy",
        f'unsupported value "mps": {NVIDIA_STRATEGIES}',
    ),
    (
        "strategy-not-a-string",
        gpu({"strategy": 1}),
        "sharing.strategy",
        f"unsupported value 1: {NVIDIA_STRATEGIES}",
    ),
    (
        "strategy-missing",
        gpu({}),
        "sharing.strategy",
        f"required field is missing: {NVIDIA_STRATEGIES}",
    ),
    (
        "strategy-null",
        gpu({"strategy": None}),
        "sharing.strategy",
        f"required field is missing: {NVIDIA_STRATEGIES}",
    ),
    (
        "mig-strategy-missing",
        mig({"mpsConfig": {}}),
        "sharing.strategy",
        f"required field is missing: {NVIDIA_STRATEGIES}",
    ),
    (
        "interval",
        gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Huge"}}),
        "sharing.timeSlicingConfig.interval",
        'unsupported value "Huge": allowed values are "Default", "Short", "Medium", "Long"',
    ),
    (
        "interval-not-a-string",
        gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": 5}}),
        "sharing.timeSlicingConfig.interval",
        'unsupported value 5: allowed values are "Default", "Short", "Medium", "Long"',
    ),
    (
        "percentage-negative",
        gpu(mps(defaultActiveThreadPercentage=-1)),
        "sharing.mpsConfig.defaultActiveThreadPercentage",
        "invalid value -1: allowed range is 0 to 100",
    ),
    (
        "percentage-over",
        gpu(mps(defaultActiveThreadPercentage=101)),
        "sharing.mpsConfig.defaultActiveThreadPercentage",
        "invalid value 101: allowed range is 0 to 100",
    ),
    (
        "percentage-string",
        gpu(mps(defaultActiveThreadPercentage="50")),
        "sharing.mpsConfig.defaultActiveThreadPercentage",
        'invalid value "50": must be an integer',
    ),
    (
        "percentage-bool",
        gpu(mps(defaultActiveThreadPercentage=True)),
        "sharing.mpsConfig.defaultActiveThreadPercentage",
        "invalid value true: must be an integer",
    ),
    (
        "percentage-float",
        gpu(mps(defaultActiveThreadPercentage=50.0)),
        "sharing.mpsConfig.defaultActiveThreadPercentage",
        "invalid value 50.0: must be an integer",
    ),
    (
        "pinned-below-1Mi",
        gpu(mps(defaultPinnedDeviceMemoryLimit="1Ki")),
        "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
        'invalid value "1Ki": must be a whole number of bytes of at least 1Mi',
    ),
    (
        "pinned-not-a-quantity",
        gpu(mps(defaultPinnedDeviceMemoryLimit="lots")),
        "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
        'invalid value "lots": must be a quantity such as 512Mi or 4Gi',
    ),
    (
        "pinned-negative",
        gpu(mps(defaultPinnedDeviceMemoryLimit="-1Gi")),
        "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
        'invalid value "-1Gi": must be a whole number of bytes of at least 1Mi',
    ),
    (
        "pinned-bool",
        gpu(mps(defaultPinnedDeviceMemoryLimit=True)),
        "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
        "invalid value true: must be a quantity such as 512Mi or 4Gi",
    ),
    (
        "per-device-key",
        gpu(mps(defaultPerDevicePinnedMemoryLimit={"first": "1Gi"})),
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.first",
        'invalid key "first": must be a device index ("0") or UUID ("GPU-…", "MIG-…")',
    ),
    (
        "per-device-key-lowercase-uuid",
        gpu(mps(defaultPerDevicePinnedMemoryLimit={"gpu-12ab": "1Gi"})),
        'sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit["gpu-12ab"]',
        'invalid key "gpu-12ab": must be a device index ("0") or UUID ("GPU-…", "MIG-…")',
    ),
    (
        "per-device-value",
        gpu(mps(defaultPerDevicePinnedMemoryLimit={"GPU-12ab": "1Ki"})),
        'sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit["GPU-12ab"]',
        'invalid value "1Ki": must be a whole number of bytes of at least 1Mi',
    ),
    (
        "per-device-not-a-map",
        gpu(mps(defaultPerDevicePinnedMemoryLimit=["1Gi"])),
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit",
        'invalid value ["1Gi"]: must be an object',
    ),
    (
        "multi-user-string",
        gpu(mps(multiUser="true")),
        "sharing.mpsConfig.multiUser",
        'invalid value "true": must be a boolean',
    ),
    (
        "mps-config-with-time-slicing",
        gpu({"strategy": "TimeSlicing", "mpsConfig": {}}),
        "sharing.mpsConfig",
        'not allowed with strategy "TimeSlicing": only with strategy "MPS"',
    ),
    (
        "mig-mps-config-with-time-slicing",
        mig({"strategy": "TimeSlicing", "mpsConfig": {"defaultActiveThreadPercentage": 10}}),
        "sharing.mpsConfig",
        'not allowed with strategy "TimeSlicing": only with strategy "MPS"',
    ),
    (
        "time-slicing-config-with-mps",
        gpu({"strategy": "MPS", "timeSlicingConfig": {"interval": "Short"}}),
        "sharing.timeSlicingConfig",
        'not allowed with strategy "MPS": only with strategy "TimeSlicing"',
    ),
    (
        "time-slicing-config-in-mig",
        mig({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}),
        "sharing.timeSlicingConfig",
        'unknown field; allowed fields are "strategy", "mpsConfig"',
    ),
    (
        "unknown-top-level",
        gpu(colour="blue"),
        "colour",
        'unknown field; allowed fields are "apiVersion", "kind", "sharing"',
    ),
    (
        "unknown-in-sharing",
        gpu({"strategy": "MPS", "replicas": 2}),
        "sharing.replicas",
        'unknown field; allowed fields are "strategy", "mpsConfig", "timeSlicingConfig"',
    ),
    (
        "unknown-in-time-slicing-config",
        gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long", "x": 1}}),
        "sharing.timeSlicingConfig.x",
        'unknown field; allowed fields are "interval"',
    ),
    (
        "unknown-in-mps-config",
        gpu(mps(defaultActiveThreadPercentag=5)),
        "sharing.mpsConfig.defaultActiveThreadPercentag",
        'unknown field; allowed fields are "defaultActiveThreadPercentage", '
        '"defaultPinnedDeviceMemoryLimit", "defaultPerDevicePinnedMemoryLimit", "multiUser"',
    ),
    (
        "drasils-field-name",
        gpu({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}),
        "sharing.timeSlicing",
        'unknown field; allowed fields are "strategy", "mpsConfig", "timeSlicingConfig"',
    ),
    (
        "sharing-not-an-object",
        gpu("MPS"),
        "sharing",
        'invalid value "MPS": must be an object',
    ),
    (
        "wrong-kind-for-the-version",
        {"apiVersion": NVIDIA_API_VERSION, "kind": "ComputeDomainChannelConfig"},
        "kind",
        'unsupported value "ComputeDomainChannelConfig": supported kinds of '
        f'"{NVIDIA_API_VERSION}" are "GpuConfig", "MigDeviceConfig", "VfioDeviceConfig"',
    ),
    (
        "missing-kind",
        {"apiVersion": NVIDIA_API_VERSION},
        "kind",
        f'required field is missing: supported kinds of "{NVIDIA_API_VERSION}" are '
        '"GpuConfig", "MigDeviceConfig", "VfioDeviceConfig"',
    ),
    (
        "wrong-api-version",
        {"apiVersion": "resource.nvidia.com/v1beta2", "kind": "GpuConfig"},
        "apiVersion",
        'unsupported value "resource.nvidia.com/v1beta2": the supported API versions are '
        f'"{API_VERSION}", "{NVIDIA_API_VERSION}"',
    ),
]


@pytest.mark.parametrize(
    ("config", "path", "message"),
    [case[1:] for case in ERROR_CASES],
    ids=[case[0] for case in ERROR_CASES],
)
def test_refusals_name_path_value_and_allowed_values(
    config: dict[str, Any], path: str, message: str
) -> None:
    error = refusal(config)
    assert str(error) == f"{path}: {message}"
    assert [issue.path for issue in error.issues] == [path]
    # The same from JSON text reads the same.
    assert str(refusal(json.dumps(config))) == str(error)


def test_the_bad_value_and_the_allowed_values_are_in_the_issue() -> None:
    (issue,) = refusal(gpu({"strategy": "Exclusive"})).issues
    assert (issue.path, issue.value, issue.allowed) == (
        "sharing.strategy",
        "Exclusive",
        ("TimeSlicing", "MPS"),
    )
    (issue,) = refusal(gpu({})).issues
    assert (issue.value, issue.allowed) == (None, ("TimeSlicing", "MPS"))
    (issue,) = refusal(gpu({"strategy": "TimeSlicing", "mpsConfig": {}})).issues
    assert (issue.path, issue.value, issue.allowed) == (
        "sharing.mpsConfig",
        "TimeSlicing",
        ("MPS",),
    )


def test_every_problem_is_reported() -> None:
    config = gpu(
        mps(
            defaultActiveThreadPercentage="50",
            defaultPinnedDeviceMemoryLimit="tiny",
            defaultPerDevicePinnedMemoryLimit={"x": "1Gi"},
            multiUser=1,
            colour="blue",
        )
    )
    paths = {issue.path for issue in refusal(config).issues}
    assert paths == {
        "sharing.mpsConfig.defaultActiveThreadPercentage",
        "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.x",
        "sharing.mpsConfig.multiUser",
        "sharing.mpsConfig.colour",
    }


def test_wrong_api_version_and_kind_are_both_reported() -> None:
    error = refusal({"apiVersion": "resource.nvidia.com/v1", "kind": "ComputeDomain"})
    assert [issue.path for issue in error.issues] == ["apiVersion", "kind"]
    assert error.issues[1].message == (
        'unsupported value "ComputeDomain": supported kinds are "GpuConfig", "MigDeviceConfig", '
        '"VfioDeviceConfig"'
    )
    assert error.issues[0].allowed == (API_VERSION, NVIDIA_API_VERSION)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (
            f'{{"apiVersion": "{NVIDIA_API_VERSION}", "kind": "GpuConfig", "kind": "GpuConfig"}}',
            "kind",
        ),
        (
            f'{{"apiVersion": "{NVIDIA_API_VERSION}", "kind": "GpuConfig", '
            '"sharing": {"strategy": "MPS", "strategy": "TimeSlicing"}}',
            "strategy",
        ),
        (
            f'{{"apiVersion": "{NVIDIA_API_VERSION}", "kind": "GpuConfig", "sharing": '
            '{"strategy": "MPS", "mpsConfig": {"multiUser": true, "multiUser": false}}}',
            "multiUser",
        ),
    ],
    ids=["top", "sharing", "mps-config"],
)
def test_duplicate_keys_in_json(text: str, key: str) -> None:
    error = refusal(text)
    assert str(error) == f'duplicate key "{key}": each key may appear once'


def test_duplicate_keys_in_yaml_name_their_line() -> None:
    text = QUICKSTART_TIME_SLICING + "    interval: Short\n"
    assert str(refusal(text)) == (
        'duplicate key "interval" (line 7, column 5): each key may appear once'
    )
    text = QUICKSTART_MPS.replace("sharing:\n", "sharing:\n  strategy: TimeSlicing\n")
    assert str(refusal(text)) == (
        'duplicate key "strategy" (line 5, column 3): each key may appear once'
    )


def test_yaml_wrong_types_are_not_coerced() -> None:
    text = QUICKSTART_MPS.replace("50", '"50"')
    assert str(refusal(text)) == (
        'sharing.mpsConfig.defaultActiveThreadPercentage: invalid value "50": must be an integer'
    )
    text = QUICKSTART_MPS + '    multiUser: "true"\n'
    message = 'sharing.mpsConfig.multiUser: invalid value "true": must be a boolean'
    assert str(refusal(text)) == message


def test_bounded_readers_apply_to_nvidias_kinds() -> None:
    limits = {str(index): "1Gi" for index in range(1000)}
    with pytest.raises(ConfigError, match=r"too large .*10 KiB"):
        decode_config(gpu(mps(defaultPerDevicePinnedMemoryLimit=limits)))
    with pytest.raises(ConfigError, match="anchors and aliases"):
        decode_config(QUICKSTART_MPS.replace("50", "&a 50"))


# --- JSON Schemas of NVIDIA's kinds ---------------------------------------------------

VALID = [
    gpu(),
    gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}),
    gpu({"strategy": "TimeSlicing", "mpsConfig": None}),
    gpu(mps(defaultActiveThreadPercentage=20, defaultPinnedDeviceMemoryLimit="2Gi")),
    gpu(mps(multiUser=True)),
    mig({"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"0": 2**30}}}),
    mig({"strategy": "TimeSlicing"}),
]
INVALID = [
    gpu({}),
    gpu({"strategy": "Exclusive"}),
    gpu({"strategy": "TimeSlicing", "mpsConfig": {}}),
    gpu({"strategy": "MPS", "timeSlicingConfig": {}}),
    gpu(mps(defaultActiveThreadPercentage=101)),
    gpu(mps(defaultActiveThreadPercentage="5")),
    gpu(mps(multiUser="true")),
    mig({"strategy": "TimeSlicing", "timeSlicingConfig": {}}),
    gpu(unknown=True),
    {"kind": "GpuConfig"},
]


def _schema(config: dict[str, Any]) -> Any:
    schema = config_json_schema(config["kind"], api_version=NVIDIA_API_VERSION)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("config", VALID)
def test_schemas_accept_what_decode_accepts(config: dict[str, Any]) -> None:
    decode_config(config)
    _schema(config).validate(config)


@pytest.mark.parametrize("config", INVALID)
def test_schemas_reject_what_decode_rejects(config: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        decode_config(config)
    assert not _schema(config).is_valid(config)


def test_schemas_of_both_versions_are_distinct() -> None:
    for kind in NVIDIA_KINDS:
        ours = config_json_schema(kind)
        theirs = config_json_schema(kind, api_version=NVIDIA_API_VERSION)
        assert theirs["title"] == ours["title"] == kind
        assert theirs["properties"]["apiVersion"]["const"] == NVIDIA_API_VERSION
    with pytest.raises(ValueError, match="unknown API version"):
        config_json_schema("GpuConfig", api_version="v1")

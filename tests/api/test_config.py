"""The opaque config API: strict decoding, messages users can act on, JSON Schemas."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import yaml

from drasil.api.config import (
    API_VERSION,
    KINDS,
    MAX_PARAMETERS_BYTES,
    GpuConfig,
    MigDeviceConfig,
    MpsConfig,
    SharingStrategy,
    TimeSlicingInterval,
    config_json_schema,
    decode_config,
    main,
    schema_files,
)
from drasil.api.documents import ConfigError, load_documents

STRATEGIES = ['"Exclusive"', '"TimeSlicing"', '"MPS"']
GPU_FIELDS = ['"strategy"', '"mps"', '"timeSlicing"']


def gpu(sharing: Any = None, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"apiVersion": API_VERSION, "kind": "GpuConfig", **extra}
    if sharing is not None:
        config["sharing"] = sharing
    return config


def mig(sharing: Any = None) -> dict[str, Any]:
    config: dict[str, Any] = {"apiVersion": API_VERSION, "kind": "MigDeviceConfig"}
    if sharing is not None:
        config["sharing"] = sharing
    return config


def mps(**settings: Any) -> dict[str, Any]:
    return {"strategy": "MPS", "mps": settings}


# --- valid configs and their defaults ------------------------------------------------


def test_config_without_sharing_is_exclusive() -> None:
    config = decode_config(gpu())
    assert isinstance(config, GpuConfig)
    assert config.sharing.strategy is SharingStrategy.EXCLUSIVE
    assert config.sharing.time_slicing is None
    assert config.sharing.mps is None
    assert decode_config(gpu({})) == config == GpuConfig()
    assert decode_config(mig()) == MigDeviceConfig()


def test_time_slicing_without_settings_gets_the_default_interval() -> None:
    config = decode_config(gpu({"strategy": "TimeSlicing"}))
    assert isinstance(config, GpuConfig)
    assert config.sharing.time_slicing is not None
    assert config.sharing.time_slicing.interval is TimeSlicingInterval.DEFAULT


def test_time_slicing_interval() -> None:
    config = decode_config(gpu({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}))
    assert isinstance(config, GpuConfig)
    assert config.sharing.time_slicing is not None
    assert config.sharing.time_slicing.interval is TimeSlicingInterval.LONG


def test_mps_without_settings_keeps_the_daemon_defaults() -> None:
    config = decode_config(gpu({"strategy": "MPS"}))
    assert config.sharing.mps == MpsConfig()


def test_mps_settings_are_read_as_bytes() -> None:
    sharing = mps(
        defaultActiveThreadPercentage=50,
        defaultPinnedDeviceMemoryLimit="1Gi",
        defaultPerDevicePinnedMemoryLimit={
            "0": "2Gi",
            "GPU-1234-abcd": 1048576,
            "MIG-ab12": "1.5Gi",
        },
    )
    config = decode_config(gpu(sharing))
    settings = config.sharing.mps
    assert settings is not None
    assert settings.default_active_thread_percentage == 50
    assert settings.default_pinned_device_memory_limit == 2**30
    assert settings.default_per_device_pinned_memory_limit == {
        "0": 2 * 2**30,
        "GPU-1234-abcd": 2**20,
        "MIG-ab12": 3 * 2**29,
    }


@pytest.mark.parametrize("strategy", ["Exclusive", "TimeSlicing", "MPS"])
def test_mig_devices_allow_every_strategy(strategy: str) -> None:
    config = decode_config(mig({"strategy": strategy}))
    assert isinstance(config, MigDeviceConfig)
    assert config.sharing.strategy == strategy


def test_mig_devices_take_mps_settings() -> None:
    config = decode_config(mig(mps(defaultActiveThreadPercentage=25)))
    assert config.sharing.mps is not None
    assert config.sharing.mps.default_active_thread_percentage == 25


@pytest.mark.parametrize(
    "raw",
    [
        json.dumps(gpu(mps(defaultActiveThreadPercentage=10))),
        json.dumps(gpu(mps(defaultActiveThreadPercentage=10))).encode(),
        f"apiVersion: {API_VERSION}\nkind: GpuConfig\n"
        "sharing:\n  strategy: MPS\n  mps:\n    defaultActiveThreadPercentage: 10\n",
    ],
    ids=["json", "bytes", "yaml"],
)
def test_text_forms_decode_alike(raw: str | bytes) -> None:
    assert decode_config(raw) == decode_config(gpu(mps(defaultActiveThreadPercentage=10)))


def test_yaml_number_keys_become_strings_as_kubectl_sends_them() -> None:
    text = (
        f"apiVersion: {API_VERSION}\nkind: GpuConfig\nsharing:\n  strategy: MPS\n"
        "  mps:\n    defaultPerDevicePinnedMemoryLimit:\n      0: 1Gi\n"
    )
    settings = decode_config(text).sharing.mps
    assert settings is not None
    assert settings.default_per_device_pinned_memory_limit == {"0": 2**30}


def test_json_form_round_trips() -> None:
    sharing = mps(
        defaultPinnedDeviceMemoryLimit="1536Mi", defaultPerDevicePinnedMemoryLimit={"1": "2Gi"}
    )
    config = decode_config(gpu(sharing))
    text = config.model_dump_json(exclude_none=True)
    assert json.loads(text)["sharing"]["mps"] == {
        "defaultPinnedDeviceMemoryLimit": "1536Mi",
        "defaultPerDevicePinnedMemoryLimit": {"1": "2Gi"},
    }
    assert decode_config(text) == config


# --- errors: path, bad value and what is allowed ----------------------------------

ERROR_CASES: list[tuple[str, Any, str, list[str]]] = [
    # (id, config, path, [bad value, allowed...]); all must appear in the message.
    ("strategy", gpu({"strategy": "Foo"}), "sharing.strategy", ['"Foo"', *STRATEGIES]),
    ("strategy-number", gpu({"strategy": 5}), "sharing.strategy", ["5", *STRATEGIES]),
    ("strategy-case", gpu({"strategy": "mps"}), "sharing.strategy", ['"mps"', *STRATEGIES]),
    (
        "interval",
        gpu({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Fast"}}),
        "sharing.timeSlicing.interval",
        ['"Fast"', '"Default"', '"Short"', '"Medium"', '"Long"'],
    ),
    ("unknown-field", gpu({"foo": 1}), "sharing.foo", ["unknown field", *GPU_FIELDS]),
    (
        "unknown-top-field",
        gpu(metadata={"name": "x"}),
        "metadata",
        ["unknown field", '"apiVersion"', '"kind"', '"sharing"'],
    ),
    (
        "unknown-mps-field",
        gpu(mps(activeThreads=5)),
        "sharing.mps.activeThreads",
        ["unknown field", '"defaultActiveThreadPercentage"', '"defaultPinnedDeviceMemoryLimit"'],
    ),
    (
        "mig-time-slicing-settings",
        mig({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Short"}}),
        "sharing.timeSlicing",
        ["unknown field", '"strategy"', '"mps"'],
    ),
    (
        "time-slicing-with-exclusive",
        gpu({"strategy": "Exclusive", "timeSlicing": {"interval": "Short"}}),
        "sharing.timeSlicing",
        ['"Exclusive"', '"TimeSlicing"'],
    ),
    (
        "time-slicing-with-default-strategy",
        gpu({"timeSlicing": {}}),
        "sharing.timeSlicing",
        ['"Exclusive"', '"TimeSlicing"'],
    ),
    (
        "mps-with-time-slicing",
        gpu({"strategy": "TimeSlicing", "mps": {}}),
        "sharing.mps",
        ['"TimeSlicing"', '"MPS"'],
    ),
    ("mig-mps-with-exclusive", mig({"mps": {}}), "sharing.mps", ['"Exclusive"', '"MPS"']),
    (
        "percentage-string",
        gpu(mps(defaultActiveThreadPercentage="50")),
        "sharing.mps.defaultActiveThreadPercentage",
        ['"50"', "an integer"],
    ),
    (
        "percentage-float",
        gpu(mps(defaultActiveThreadPercentage=50.0)),
        "sharing.mps.defaultActiveThreadPercentage",
        ["50.0", "an integer"],
    ),
    (
        "percentage-bool",
        gpu(mps(defaultActiveThreadPercentage=True)),
        "sharing.mps.defaultActiveThreadPercentage",
        ["true", "an integer"],
    ),
    (
        "percentage-range",
        gpu(mps(defaultActiveThreadPercentage=150)),
        "sharing.mps.defaultActiveThreadPercentage",
        ["150", "0 to 100"],
    ),
    (
        "percentage-negative",
        gpu(mps(defaultActiveThreadPercentage=-1)),
        "sharing.mps.defaultActiveThreadPercentage",
        ["-1", "0 to 100"],
    ),
    (
        "memory-too-small",
        gpu(mps(defaultPinnedDeviceMemoryLimit="1Ki")),
        "sharing.mps.defaultPinnedDeviceMemoryLimit",
        ['"1Ki"', "at least 1Mi"],
    ),
    (
        "memory-not-a-quantity",
        gpu(mps(defaultPinnedDeviceMemoryLimit="lots")),
        "sharing.mps.defaultPinnedDeviceMemoryLimit",
        ['"lots"', "512Mi"],
    ),
    (
        "memory-float",
        gpu(mps(defaultPinnedDeviceMemoryLimit=1.5e9)),
        "sharing.mps.defaultPinnedDeviceMemoryLimit",
        ["1500000000.0", "512Mi"],
    ),
    (
        "memory-fraction-of-byte",
        gpu(mps(defaultPinnedDeviceMemoryLimit="1048576500m")),
        "sharing.mps.defaultPinnedDeviceMemoryLimit",
        ['"1048576500m"', "whole number of bytes"],
    ),
    (
        "per-device-key",
        gpu(mps(defaultPerDevicePinnedMemoryLimit={"first": "1Gi"})),
        "sharing.mps.defaultPerDevicePinnedMemoryLimit.first",
        ['invalid key "first"', "device index", "UUID"],
    ),
    (
        "per-device-value",
        gpu(mps(defaultPerDevicePinnedMemoryLimit={"GPU-12ab": "1Ki"})),
        'sharing.mps.defaultPerDevicePinnedMemoryLimit["GPU-12ab"]',
        ['"1Ki"', "at least 1Mi"],
    ),
    (
        "per-device-not-a-map",
        gpu(mps(defaultPerDevicePinnedMemoryLimit=["1Gi"])),
        "sharing.mps.defaultPerDevicePinnedMemoryLimit",
        ['["1Gi"]', "an object"],
    ),
    ("sharing-not-an-object", gpu("MPS"), "sharing", ['"MPS"', "an object"]),
    (
        "api-version",
        {"apiVersion": "resource.drasil.dev/v1", "kind": "GpuConfig"},
        "apiVersion",
        [
            '"resource.drasil.dev/v1"',
            f'supported API versions are "{API_VERSION}", "resource.nvidia.com/v1beta1"',
        ],
    ),
    (
        "kind",
        {"apiVersion": API_VERSION, "kind": "GPUConfig"},
        "kind",
        ['"GPUConfig"', '"GpuConfig"', '"MigDeviceConfig"'],
    ),
    (
        "missing-kind",
        {"apiVersion": API_VERSION},
        "kind",
        ["missing", '"GpuConfig"', '"MigDeviceConfig"'],
    ),
]


@pytest.mark.parametrize(
    ("config", "path", "expected"),
    [case[1:] for case in ERROR_CASES],
    ids=[case[0] for case in ERROR_CASES],
)
def test_errors_name_path_value_and_allowed_values(
    config: dict[str, Any], path: str, expected: list[str]
) -> None:
    with pytest.raises(ConfigError) as caught:
        decode_config(config)
    message = str(caught.value)
    assert message.startswith(f"{path}: "), message
    for text in expected:
        assert text in message, (text, message)
    assert [issue.path for issue in caught.value.issues] == [path]
    # The same problem from JSON text reads the same.
    with pytest.raises(ConfigError) as from_json:
        decode_config(json.dumps(config))
    assert str(from_json.value) == message


def test_error_message_of_the_brief() -> None:
    with pytest.raises(ConfigError) as caught:
        decode_config(gpu({"strategy": "Foo"}))
    assert str(caught.value) == (
        'sharing.strategy: unsupported value "Foo": '
        'allowed values are "Exclusive", "TimeSlicing", "MPS"'
    )
    (issue,) = caught.value.issues
    assert (issue.path, issue.value) == ("sharing.strategy", "Foo")
    assert issue.allowed == ("Exclusive", "TimeSlicing", "MPS")


def test_every_problem_is_reported() -> None:
    config = gpu(
        mps(
            defaultActiveThreadPercentage="50",
            defaultPinnedDeviceMemoryLimit="tiny",
            colour="blue",
        )
    )
    with pytest.raises(ConfigError) as caught:
        decode_config(config)
    paths = {issue.path for issue in caught.value.issues}
    assert paths == {
        "sharing.mps.defaultActiveThreadPercentage",
        "sharing.mps.defaultPinnedDeviceMemoryLimit",
        "sharing.mps.colour",
    }
    for path in paths:
        assert path in str(caught.value)


def test_wrong_api_version_and_kind_are_both_reported() -> None:
    with pytest.raises(ConfigError) as caught:
        decode_config({"apiVersion": "v1", "kind": "Pod"})
    assert [issue.path for issue in caught.value.issues] == ["apiVersion", "kind"]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("[1, 2]", "must be an object with apiVersion and kind"),
        ("just text", "must be an object with apiVersion and kind"),
        ('{"kind": ', "invalid JSON: Expecting value (line 1, column 10)"),
        ('{"kind": NaN}', "invalid JSON: NaN is not a JSON number"),
        ("kind: [", "invalid YAML: "),
        ("kind: a: b", "invalid YAML: mapping values are not allowed here (line 1, column 8)"),
        ("", "expected one config document, found 0"),
        ("kind: GpuConfig\n---\nkind: GpuConfig\n", "expected one config document, found 2"),
        (b"\xff\xfe", "config is not UTF-8"),
    ],
)
def test_unreadable_input(raw: str | bytes, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        decode_config(raw)
    assert expected in str(caught.value)


# --- duplicate keys ----------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '{"apiVersion": "x", "kind": "GpuConfig", "kind": "GpuConfig"}',
        '{"kind": "GpuConfig", "sharing": {"strategy": "MPS", "strategy": "MPS"}}',
    ],
)
def test_duplicate_keys_in_json_are_rejected(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        decode_config(text)
    assert 'duplicate key "' in str(caught.value)
    assert caught.value.issues[0].value in {"kind", "strategy"}


def test_duplicate_keys_in_yaml_are_rejected_with_their_line() -> None:
    text = (
        f"apiVersion: {API_VERSION}\nkind: GpuConfig\n"
        "sharing:\n  strategy: MPS\n  strategy: Exclusive\n"
    )
    with pytest.raises(ConfigError) as caught:
        decode_config(text)
    assert str(caught.value) == (
        'duplicate key "strategy" (line 5, column 3): each key may appear once'
    )


def test_yaml_keys_that_collide_as_json_are_duplicates() -> None:
    with pytest.raises(ConfigError, match='duplicate key "1"'):
        load_documents("1: a\n'1': b\n")


# --- the 10 KiB API limit ----------------------------------------------------------


def test_raw_input_up_to_the_limit_is_accepted() -> None:
    text = json.dumps(gpu())
    padded = text + " " * (MAX_PARAMETERS_BYTES - len(text))
    assert len(padded.encode()) == MAX_PARAMETERS_BYTES
    assert decode_config(padded) == GpuConfig()
    assert decode_config(padded.encode()) == GpuConfig()


@pytest.mark.parametrize("as_bytes", [False, True])
def test_raw_input_over_the_limit_is_rejected(as_bytes: bool) -> None:
    text = json.dumps(gpu())
    text += " " * (MAX_PARAMETERS_BYTES + 1 - len(text))
    with pytest.raises(ConfigError) as caught:
        decode_config(text.encode() if as_bytes else text)
    message = str(caught.value)
    assert f"({MAX_PARAMETERS_BYTES + 1} bytes or more)" in message
    assert "10240 bytes (10 KiB)" in message


def test_mapping_over_the_limit_is_rejected() -> None:
    limits = {str(index): "1Gi" for index in range(1000)}
    with pytest.raises(ConfigError, match=r"too large .*10 KiB"):
        decode_config(gpu(mps(defaultPerDevicePinnedMemoryLimit=limits)))


def test_yaml_alias_bomb_stops_at_the_limit() -> None:
    # load_documents refuses aliases (test_limits.py); a mapping built by another YAML
    # reader shares the parts as PyYAML does, and must stop at the limit all the same.
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 30)]
    document = yaml.safe_load("\n".join(lines))
    with pytest.raises(ConfigError, match="too large"):
        decode_config(document)


# --- JSON Schemas ------------------------------------------------------------------


def test_checked_in_schemas_are_current() -> None:
    for path, text in schema_files().items():
        assert path.is_file(), f"{path} is missing: run python -m drasil.api.config schemas"
        assert path.read_text() == text, f"{path} is stale: run python -m drasil.api.config schemas"
    assert main(["schemas", "--check"]) == 0


def _objects(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, list):
        return [found for item in node for found in _objects(item)]
    if not isinstance(node, dict):
        return []
    own = [node] if "properties" in node else []
    return own + [found for value in node.values() for found in _objects(value)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_schemas_reject_unknown_fields_everywhere(kind: str) -> None:
    objects = _objects(config_json_schema(kind))
    assert objects
    for node in objects:
        if "type" in node:  # not an allOf rule
            assert node["additionalProperties"] is False, node


VALID = [
    gpu(),
    gpu({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Short"}}),
    gpu(mps(defaultActiveThreadPercentage=20, defaultPinnedDeviceMemoryLimit="2Gi")),
    mig({"strategy": "MPS", "mps": {"defaultPerDevicePinnedMemoryLimit": {"0": 2**30}}}),
]
INVALID = [
    gpu({"strategy": "Foo"}),
    gpu({"foo": 1}),
    gpu(unknown=True),
    gpu({"strategy": "MPS", "timeSlicing": {}}),
    gpu(mps(defaultActiveThreadPercentage=101)),
    gpu(mps(defaultActiveThreadPercentage="5")),
    mig({"strategy": "TimeSlicing", "timeSlicing": {}}),
    {"kind": "GpuConfig"},
]


@pytest.mark.parametrize("config", VALID)
def test_schemas_accept_what_decode_accepts(config: dict[str, Any]) -> None:
    decode_config(config)
    jsonschema.Draft202012Validator(config_json_schema(config["kind"])).validate(config)


@pytest.mark.parametrize("config", INVALID)
def test_schemas_reject_what_decode_rejects(config: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        decode_config(config)
    validator = jsonschema.Draft202012Validator(config_json_schema(config["kind"]))
    assert not validator.is_valid(config)


def test_schema_of_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match='supported kinds are "GpuConfig", "MigDeviceConfig"'):
        config_json_schema("Pod")

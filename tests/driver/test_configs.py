"""Config resolution for allocated claims, and checking config files for the CLI."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drasil.api.config import (
    API_VERSION,
    GpuConfig,
    MigDeviceConfig,
    SharingStrategy,
    TimeSlicingInterval,
)
from drasil.driver.claims.configcheck import validate_config_document
from drasil.driver.claims.deviceconfigs import (
    AllocatedDevice,
    Allocation,
    AllocationError,
    ConfigResolutionError,
    OpaqueConfigEntry,
    parse_allocation,
    resolve_configs,
)
from drasil.driver.devices import Device, DeviceType

DRIVER = "gpu.drasil.dev"
ALLOWED = 'allowed values are "Exclusive", "TimeSlicing", "MPS"'


def device(name: str, kind: DeviceType = DeviceType.GPU) -> Device:
    return Device(
        name=name,
        type=kind,
        uuid=f"GPU-{name}",
        minor=0,
        attributes={"type": kind.value},
        capacity={"memory": 2**30},
    )


DEVICES = {d.name: d for d in (device("gpu-0"), device("gpu-1"), device("mig-0", DeviceType.MIG))}


def gpu_config(strategy: str = "Exclusive", **sharing: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "GpuConfig",
        "sharing": {"strategy": strategy, **sharing},
    }


def mig_config(strategy: str = "Exclusive") -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "MigDeviceConfig", "sharing": {"strategy": strategy}}


def result(request: str, name: str, *, driver: str = DRIVER) -> dict[str, Any]:
    return {"request": request, "driver": driver, "pool": "node-a", "device": name}


def entry(
    source: str, requests: list[str], parameters: Any, *, driver: str = DRIVER
) -> dict[str, Any]:
    return {
        "source": source,
        "requests": requests,
        "opaque": {"driver": driver, "parameters": parameters},
    }


def claim(results: list[dict[str, Any]], configs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "team", "name": "train"},
        "status": {"allocation": {"devices": {"results": results, "config": configs}}},
    }


def resolve(results: list[dict[str, Any]], configs: list[dict[str, Any]]) -> dict[str, Any]:
    allocation = parse_allocation(claim(results, configs), driver=DRIVER)
    return {name: r.config for name, r in resolve_configs(allocation, devices=DEVICES).items()}


def strategies(resolved: dict[str, Any]) -> dict[str, str]:
    return {name: config.sharing.strategy.value for name, config in resolved.items()}


def problems_of(results: list[dict[str, Any]], configs: list[dict[str, Any]]) -> list[str]:
    with pytest.raises(ConfigResolutionError) as caught:
        resolve(results, configs)
    assert str(caught.value) == "; ".join(caught.value.problems)
    return list(caught.value.problems)


# --- parse_allocation --------------------------------------------------------------


def test_parse_keeps_only_the_drivers_results_and_configs() -> None:
    results = [
        result("gpu", "gpu-0"),
        result("nic", "eth0", driver="net.example.com"),
        {**result("gpu", "gpu-1"), "adminAccess": True, "shareID": "a1b2"},
    ]
    configs = [
        entry("FromClass", ["nic"], {"anything": True}, driver="net.example.com"),
        entry("FromClaim", ["gpu"], gpu_config("MPS")),
        {"source": "FromClaim", "requests": ["gpu"]},  # not opaque: not ours to read
    ]
    allocation = parse_allocation(claim(results, configs), driver=DRIVER)
    assert allocation.devices == (
        AllocatedDevice(request="gpu", driver=DRIVER, pool="node-a", device="gpu-0"),
        AllocatedDevice(
            request="gpu",
            driver=DRIVER,
            pool="node-a",
            device="gpu-1",
            admin_access=True,
            share_id="a1b2",
        ),
    )
    (config,) = allocation.configs
    assert (config.index, config.source, config.requests) == (1, "FromClaim", ("gpu",))
    assert config.parameters == gpu_config("MPS")


def test_subrequest_results_know_their_base_request() -> None:
    allocation = parse_allocation(claim([result("gpu/full", "gpu-0")], []), driver=DRIVER)
    assert allocation.devices[0].base_request == "gpu"


@pytest.mark.parametrize(
    ("broken", "expected"),
    [
        (
            {"metadata": {"namespace": "team", "name": "train"}},
            "ResourceClaim team/train: status.allocation: missing; the claim is not allocated yet",
        ),
        (
            claim([result("gpu", "gpu-0"), {"request": "gpu", "driver": DRIVER, "pool": "p"}], []),
            "status.allocation.devices.results[1].device: expected a non-empty string, got None",
        ),
        (
            claim([], [{**entry("FromClaim", [], {}), "source": "FromPod"}]),
            'status.allocation.devices.config[0].source: expected "FromClass" or "FromClaim"',
        ),
        (
            claim([], [entry("FromClaim", [], "sharing: MPS")]),
            "status.allocation.devices.config[0].opaque.parameters: expected an object, got str",
        ),
        (
            claim([], [{**entry("FromClaim", [], {}), "requests": "gpu"}]),
            "status.allocation.devices.config[0].requests: expected a list, got str",
        ),
    ],
)
def test_parse_errors_name_the_field(broken: dict[str, Any], expected: str) -> None:
    with pytest.raises(AllocationError) as caught:
        parse_allocation(broken, driver=DRIVER)
    assert expected in str(caught.value)


# --- precedence ----------------------------------------------------------------------


def test_devices_without_config_get_their_types_default() -> None:
    resolved = resolve([result("gpu", "gpu-0"), result("mig", "mig-0")], [])
    assert resolved == {"gpu-0": GpuConfig(), "mig-0": MigDeviceConfig()}
    allocation = parse_allocation(claim([result("gpu", "gpu-0")], []), driver=DRIVER)
    assert resolve_configs(allocation, devices=DEVICES)["gpu-0"].entry is None


def test_claim_config_wins_over_class_config() -> None:
    configs = [
        entry("FromClass", ["gpu"], gpu_config("TimeSlicing")),
        entry("FromClaim", ["gpu"], gpu_config("Exclusive")),
    ]
    assert strategies(resolve([result("gpu", "gpu-0")], configs)) == {"gpu-0": "Exclusive"}
    # Class configs come first even in a list that says otherwise.
    assert strategies(resolve([result("gpu", "gpu-0")], configs[::-1])) == {"gpu-0": "Exclusive"}


def test_later_entry_wins_and_replaces_the_whole_object() -> None:
    configs = [
        entry("FromClass", [], gpu_config("MPS", mps={"defaultActiveThreadPercentage": 10})),
        entry("FromClaim", ["gpu"], gpu_config("TimeSlicing", timeSlicing={"interval": "Long"})),
        entry("FromClaim", ["gpu"], gpu_config("TimeSlicing")),
    ]
    allocation = parse_allocation(claim([result("gpu", "gpu-0")], configs), driver=DRIVER)
    resolved = resolve_configs(allocation, devices=DEVICES)["gpu-0"]
    assert resolved.entry is not None
    assert resolved.entry.index == 2
    assert isinstance(resolved.config, GpuConfig)
    assert resolved.config.sharing.mps is None
    assert resolved.config.sharing.time_slicing is not None
    assert resolved.config.sharing.time_slicing.interval is TimeSlicingInterval.DEFAULT


def test_entry_without_requests_applies_to_all_requests() -> None:
    configs = [
        entry("FromClaim", ["train"], gpu_config("Exclusive")),
        entry("FromClaim", [], gpu_config("TimeSlicing")),
    ]
    resolved = resolve([result("train", "gpu-0"), result("infer", "gpu-1")], configs)
    # Later wins, even over an entry that names the request.
    assert strategies(resolved) == {"gpu-0": "TimeSlicing", "gpu-1": "TimeSlicing"}


def test_entry_naming_a_request_applies_to_it_only() -> None:
    configs = [
        entry("FromClaim", [], gpu_config("TimeSlicing")),
        entry("FromClaim", ["train"], gpu_config("Exclusive")),
    ]
    resolved = resolve([result("train", "gpu-0"), result("infer", "gpu-1")], configs)
    assert strategies(resolved) == {"gpu-0": "Exclusive", "gpu-1": "TimeSlicing"}


@pytest.mark.parametrize(
    ("requests", "expected"),
    [
        (["gpu"], "TimeSlicing"),
        (["gpu/full"], "TimeSlicing"),
        (["gpu/small"], "Exclusive"),
        (["other"], "Exclusive"),
    ],
)
def test_first_available_results_match_base_and_full_request_names(
    requests: list[str], expected: str
) -> None:
    resolved = resolve(
        [result("gpu/full", "gpu-0")], [entry("FromClaim", requests, gpu_config("TimeSlicing"))]
    )
    assert strategies(resolved) == {"gpu-0": expected}


def test_entries_of_other_drivers_are_skipped() -> None:
    broken = {"apiVersion": "example.com/v1", "kind": "NicConfig"}
    configs = [
        entry("FromClaim", ["gpu"], gpu_config("TimeSlicing")),
        entry("FromClaim", ["gpu"], broken, driver="net.example.com"),
    ]
    assert strategies(resolve([result("gpu", "gpu-0")], configs)) == {"gpu-0": "TimeSlicing"}
    # Also when an Allocation is built by hand with foreign entries and results in it.
    allocation = Allocation(
        driver=DRIVER,
        devices=(
            AllocatedDevice(request="gpu", driver=DRIVER, pool="p", device="gpu-0"),
            AllocatedDevice(request="gpu", driver="net.example.com", pool="p", device="eth0"),
        ),
        configs=(
            OpaqueConfigEntry(
                source="FromClaim", requests=(), driver="net.example.com", parameters=broken
            ),
        ),
    )
    assert resolve_configs(allocation, devices=DEVICES)["gpu-0"].config == GpuConfig()


# --- kinds and device types --------------------------------------------------------


def test_mig_device_gets_mig_config_and_gpu_gets_gpu_config() -> None:
    configs = [
        entry("FromClaim", ["big"], gpu_config("TimeSlicing", timeSlicing={"interval": "Long"})),
        entry("FromClaim", ["small"], mig_config("TimeSlicing")),
    ]
    resolved = resolve([result("big", "gpu-0"), result("small", "mig-0")], configs)
    assert isinstance(resolved["mig-0"], MigDeviceConfig)
    assert resolved["mig-0"].sharing.strategy is SharingStrategy.TIME_SLICING
    assert isinstance(resolved["gpu-0"], GpuConfig)
    assert resolved["gpu-0"].sharing.time_slicing is not None
    assert resolved["gpu-0"].sharing.time_slicing.interval is TimeSlicingInterval.LONG


def test_config_for_all_requests_applies_only_to_devices_of_its_kind() -> None:
    configs = [
        entry("FromClaim", [], mig_config("TimeSlicing")),
        entry("FromClaim", [], gpu_config("TimeSlicing")),
    ]
    resolved = resolve([result("big", "gpu-0"), result("small", "mig-0")], configs)
    assert resolved == {
        "gpu-0": GpuConfig.model_validate(gpu_config("TimeSlicing")),
        "mig-0": MigDeviceConfig.model_validate(mig_config("TimeSlicing")),
    }


@pytest.mark.parametrize(
    ("config", "name", "request_name", "kinds"),
    [
        (gpu_config("MPS"), "mig-0", "small", ("GpuConfig", "MigDeviceConfig")),
        (mig_config("MPS"), "gpu-0", "small", ("MigDeviceConfig", "GpuConfig")),
        (gpu_config("MPS"), "mig-0", "small/mig", ("GpuConfig", "MigDeviceConfig")),
    ],
)
def test_kind_that_does_not_fit_the_device_is_an_error(
    config: dict[str, Any], name: str, request_name: str, kinds: tuple[str, str]
) -> None:
    (problem,) = problems_of([result(request_name, name)], [entry("FromClaim", ["small"], config)])
    assert problem == (
        f"config[0] (FromClaim, requests [small]): a {kinds[0]} cannot be applied to "
        f'device "{name}" of type {DEVICES[name].type} (request {request_name}); '
        f"use a {kinds[1]}"
    )


# --- errors ------------------------------------------------------------------------


def test_decode_error_names_the_entry() -> None:
    configs = [
        entry("FromClass", ["gpu"], gpu_config()),
        entry("FromClaim", ["gpu"], gpu_config("Foo")),
    ]
    assert problems_of([result("gpu", "gpu-0")], configs) == [
        "config[1] (FromClaim, requests [gpu]): "
        f'sharing.strategy: unsupported value "Foo": {ALLOWED}'
    ]


def test_broken_entry_is_reported_even_when_a_later_one_overrides_it() -> None:
    configs = [
        entry("FromClaim", [], gpu_config("MPS", mps={"defaultActiveThreadPercentage": 200})),
        entry("FromClaim", ["gpu"], gpu_config("TimeSlicing")),
    ]
    (problem,) = problems_of([result("gpu", "gpu-0")], configs)
    assert problem.startswith("config[0] (FromClaim, all requests): ")
    assert "sharing.mps.defaultActiveThreadPercentage: invalid value 200" in problem
    assert "0 to 100" in problem


def test_several_problems_are_reported_together() -> None:
    configs = [
        entry("FromClass", ["a"], gpu_config("Foo")),
        entry("FromClaim", ["b"], gpu_config("MPS")),
        entry("FromClaim", ["c"], {"apiVersion": API_VERSION, "kind": "GpuConfig", "x": 1}),
    ]
    results = [result("a", "gpu-0"), result("b", "mig-0"), result("d", "gpu-9")]
    problems = problems_of(results, configs)
    assert len(problems) == 4, problems
    assert problems[0].startswith(
        'config[0] (FromClass, requests [a]): sharing.strategy: unsupported value "Foo"'
    )
    assert problems[1].startswith("config[2] (FromClaim, requests [c]): x: unknown field")
    assert problems[2].startswith(
        'config[1] (FromClaim, requests [b]): a GpuConfig cannot be applied to device "mig-0"'
    )
    assert problems[3] == (
        'request d: device "gpu-9" (pool node-a) is not a device of driver gpu.drasil.dev '
        "on this node"
    )


def test_shared_device_needs_one_config() -> None:
    results = [result("a", "gpu-0"), result("b", "gpu-0")]
    same = [entry("FromClaim", [], gpu_config("TimeSlicing"))]
    assert strategies(resolve(results, same)) == {"gpu-0": "TimeSlicing"}
    different = [*same, entry("FromClaim", ["b"], gpu_config("Exclusive"))]
    (problem,) = problems_of(results, different)
    assert 'device "gpu-0" is allocated to requests a and b with different configs' in problem


# --- strategies drasil applies --------------------------------------------------------

MPS_ON_AN_ADMIN_DEVICE = (
    'sharing.strategy: unsupported value "MPS" for a device of an admin-access request: '
    "such a request sits beside the claim that holds the device and takes no sharing of "
    'its own; allowed values are "Exclusive", "TimeSlicing" (or no config for that request)'
)


def shareable(name: str) -> dict[str, Device]:
    """DEVICES with ``name`` published as --gpu-sharing consumable publishes a GPU."""
    return {**DEVICES, name: dataclasses.replace(DEVICES[name], allow_multiple_allocations=True)}


def test_mps_on_whole_gpus_and_mig_devices_is_applied() -> None:
    mps = gpu_config("MPS", mps={"defaultActiveThreadPercentage": 30})
    configs = [
        entry("FromClass", [], gpu_config("TimeSlicing")),
        entry("FromClaim", [], mps),
        entry("FromClaim", ["c"], mig_config("MPS")),
    ]
    results = [result("a", "gpu-0"), result("b", "gpu-1"), result("c", "mig-0")]
    assert strategies(resolve(results, configs)) == {"gpu-0": "MPS", "gpu-1": "MPS", "mig-0": "MPS"}


def test_mps_on_a_device_of_an_admin_access_request_is_refused_naming_it() -> None:
    configs = [entry("FromClaim", ["admin"], gpu_config("MPS"))]
    admin = {**result("admin", "gpu-1"), "adminAccess": True}
    assert problems_of([result("gpu", "gpu-0"), admin], configs) == [
        f'config[0] (FromClaim, requests [admin]) for device "gpu-1": {MPS_ON_AN_ADMIN_DEVICE}'
    ]
    # TimeSlicing (which changes nothing on an admin device) and no config still pass.
    fine = [entry("FromClaim", ["admin"], gpu_config("TimeSlicing"))]
    assert strategies(resolve([admin], fine)) == {"gpu-1": "TimeSlicing"}
    assert strategies(resolve([admin], [])) == {"gpu-1": "Exclusive"}


def test_mps_on_a_share_of_a_consumable_gpu_is_applied() -> None:
    mps = gpu_config("MPS", mps={"defaultActiveThreadPercentage": 30})
    share = {**result("gpu", "gpu-0"), "shareID": "a1b2"}
    allocation = parse_allocation(claim([share], [entry("FromClaim", [], mps)]), driver=DRIVER)
    resolved = resolve_configs(allocation, devices=shareable("gpu-0"))
    assert resolved["gpu-0"].config == GpuConfig.model_validate(mps)
    # The same GPU allocated whole (no shareID): applied too, with a daemon of its own.
    allocation = parse_allocation(
        claim([result("gpu", "gpu-0")], [entry("FromClaim", [], mps)]), driver=DRIVER
    )
    assert resolve_configs(allocation, devices=DEVICES)["gpu-0"].config.sharing.mps is not None


def test_mps_that_does_not_apply_is_not_refused() -> None:
    configs = [
        entry("FromClass", ["gpu"], gpu_config("MPS")),  # overridden by the claim
        entry("FromClaim", ["gpu"], gpu_config("TimeSlicing")),
        entry("FromClaim", [], mig_config("MPS")),  # no MIG device in the claim
    ]
    resolved = resolve([result("gpu", "gpu-0")], configs)
    assert strategies(resolved) == {"gpu-0": "TimeSlicing"}


# --- validate_config_document --------------------------------------------------------

CLAIM_WITH_FOO = """\
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: shared-gpu
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: gpu.drasil.dev
    config:
    - requests: [gpu]
      opaque:
        driver: gpu.drasil.dev
        parameters:
          apiVersion: resource.drasil.dev/v1beta1
          kind: GpuConfig
          sharing:
            strategy: Foo
"""

TEMPLATE = """\
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: mps-gpu
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly: {deviceClassName: gpu.drasil.dev}
      config:
      - opaque:
          driver: net.example.com
          parameters: {anything: goes}
      - opaque:
          driver: gpu.drasil.dev
          parameters:
            apiVersion: resource.drasil.dev/v1beta1
            kind: GpuConfig
            sharing: {strategy: MPS, mps: {defaultActiveThreadPercentage: %s}}
"""

DEVICE_CLASS = """\
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: mig.drasil.dev
spec:
  selectors:
  - cel: {expression: 'device.driver == "gpu.drasil.dev"'}
  config:
  - opaque:
      driver: gpu.drasil.dev
      parameters: {apiVersion: resource.drasil.dev/v1beta1, kind: MigDeviceConfig}
"""

POD = """\
apiVersion: v1
kind: Pod
metadata: {name: trainer}
spec:
  containers: [{name: main, image: busybox}]
"""


def test_claim_with_bad_strategy_names_path_value_and_allowed_values() -> None:
    (problem,) = validate_config_document(CLAIM_WITH_FOO)
    assert problem == (
        "ResourceClaim/shared-gpu: spec.devices.config[0].opaque.parameters: "
        f'sharing.strategy: unsupported value "Foo": {ALLOWED}'
    )


@pytest.mark.parametrize(
    "text",
    [
        CLAIM_WITH_FOO.replace("Foo", "TimeSlicing"),
        TEMPLATE % 50,
        DEVICE_CLASS,
        f"{DEVICE_CLASS}---\n{TEMPLATE % 50}---\n{POD}",
        f"apiVersion: {API_VERSION}\nkind: GpuConfig\nsharing: {{strategy: MPS}}\n",
        f'{{"apiVersion": "{API_VERSION}", "kind": "MigDeviceConfig"}}',
    ],
    ids=["claim", "template", "class", "several", "yaml-config", "json-config"],
)
def test_valid_documents_have_no_problems(text: str) -> None:
    assert validate_config_document(text) == []


def test_problems_name_document_and_entry_index() -> None:
    problems = validate_config_document(f"{TEMPLATE % 150}---\n{CLAIM_WITH_FOO}")
    assert problems == [
        "ResourceClaimTemplate/mps-gpu: spec.spec.devices.config[1].opaque.parameters: "
        "sharing.mps.defaultActiveThreadPercentage: invalid value 150: allowed range is 0 to 100",
        "ResourceClaim/shared-gpu: spec.devices.config[0].opaque.parameters: "
        f'sharing.strategy: unsupported value "Foo": {ALLOWED}',
    ]


def test_opaque_config_file_problems_name_the_document() -> None:
    text = f"apiVersion: {API_VERSION}\nkind: GpuConfig\nsharing: {{strategy: Foo}}\n"
    assert validate_config_document(text) == [
        f'GpuConfig (document 1): sharing.strategy: unsupported value "Foo": {ALLOWED}'
    ]


def test_mps_for_a_mig_device_is_left_to_prepare_in_a_file() -> None:
    # MPS applies to shares of a consumable GPU and of a MIG placement (dynamic MIG),
    # which a file cannot rule out: prepare decides, as for a GpuConfig.
    text = f"apiVersion: {API_VERSION}\nkind: MigDeviceConfig\nsharing: {{strategy: MPS}}\n"
    assert validate_config_document(text) == []
    mig_class = DEVICE_CLASS.replace("MigDeviceConfig", "MigDeviceConfig, sharing: {strategy: MPS}")
    assert validate_config_document(mig_class) == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", ["no opaque config for driver gpu.drasil.dev found"]),
        (POD, ["no opaque config for driver gpu.drasil.dev found"]),
        (
            DEVICE_CLASS.replace("driver: gpu.drasil.dev", "driver: other.example.com"),
            [
                "DeviceClass/mig.drasil.dev: no opaque config for driver gpu.drasil.dev "
                "found in spec.config"
            ],
        ),
        (
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: bare}\n",
            [
                "ResourceClaim/bare: no opaque config for driver gpu.drasil.dev "
                "found in spec.devices.config"
            ],
        ),
    ],
    ids=["empty", "pod", "other-driver", "no-config"],
)
def test_nothing_to_check_is_a_problem(text: str, expected: list[str]) -> None:
    assert validate_config_document(text) == expected


def test_other_driver_name() -> None:
    text = DEVICE_CLASS.replace("driver: gpu.drasil.dev", "driver: gpu.example.org")
    assert validate_config_document(text, driver="gpu.example.org") == []
    assert validate_config_document(DEVICE_CLASS, driver="gpu.example.org") != []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            CLAIM_WITH_FOO.replace("strategy: Foo", "strategy: MPS\n            strategy: MPS"),
            'duplicate key "strategy" (line 20, column 13): each key may appear once',
        ),
        ("kind: [", "invalid YAML: "),
        ("- a\n- b\n", "document 1: expected an object, got list"),
        (
            CLAIM_WITH_FOO.replace(
                "parameters:\n", "parameters: not-an-object\n        ignored:\n"
            ),
            "ResourceClaim/shared-gpu: spec.devices.config[0].opaque.parameters: "
            "must be an object holding a GpuConfig, MigDeviceConfig or VfioDeviceConfig, got str",
        ),
    ],
    ids=["duplicate-key", "yaml", "not-an-object", "parameters-not-an-object"],
)
def test_unreadable_documents(text: str, expected: str) -> None:
    problems = validate_config_document(text)
    assert len(problems) == 1, problems
    assert problems[0].startswith(expected), problems


# --- hostile input (issue 14): problems, never an exception, for any text ------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("kind: [GpuConfig]\n", "no opaque config for driver gpu.drasil.dev found"),
        (
            "kind: {}\napiVersion: resource.drasil.dev/v1beta1\n",
            "object (document 1): kind: unsupported value {}",
        ),
        ("metadata: {name: [x]}\nkind: ResourceClaim\n", "ResourceClaim (document 1): no opaque"),
        (b"kind: \xff", "config is not UTF-8: invalid start byte at byte 6"),
        ("a: &x 1\n", "YAML anchors and aliases"),
        ("a: " + "[" * 3000, "nested too deeply"),
        ("a: " + "9" * 5000, "at most 20 digits"),
        (CLAIM_WITH_FOO.replace("strategy: Foo", "strategy: " + "[" * 30), "nested too deeply"),
        (
            CLAIM_WITH_FOO.replace(
                "strategy: Foo",
                "strategy: MPS\n            mps: {defaultPinnedDeviceMemoryLimit: 1e5000}",
            ),
            '"1e5000" is out of range: at most 9223372036854775807 bytes (8Ei - 1)',
        ),
    ],
    ids=[
        "kind-list",
        "kind-object",
        "name-list",
        "not-utf8",
        "alias",
        "deep",
        "long-integer",
        "deep-in-claim",
        "huge-exponent-in-claim",
    ],
)
def test_hostile_documents_are_problems(text: str | bytes, expected: str) -> None:
    problems = validate_config_document(text)
    assert len(problems) == 1, problems
    assert expected in problems[0], problems


def claim_with(parameters: Any) -> str:
    document = yaml.safe_load(CLAIM_WITH_FOO)
    document["spec"]["devices"]["config"][0]["opaque"]["parameters"] = parameters
    return yaml.safe_dump(document, allow_unicode=True)


DOCUMENT_PIECES = [
    CLAIM_WITH_FOO,
    TEMPLATE % 50,
    DEVICE_CLASS,
    POD,
    "---\n",
    "kind: ResourceClaim\n",
    "kind: [GpuConfig]\n",
    "&a ",
    "*a ",
    "[",
    "{",
    "!!int ",
    "9" * 25,
    "\n",
    ": ",
    "- ",
]
documents = st.one_of(
    st.text(max_size=200),
    st.binary(max_size=200),
    st.lists(st.sampled_from(DOCUMENT_PIECES), max_size=12).map("".join),
    st.lists(st.sampled_from(DOCUMENT_PIECES), max_size=12).map(lambda p: "".join(p).encode()),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
        lambda children: (
            st.lists(children, max_size=5)
            | st.dictionaries(st.text(max_size=8), children, max_size=5)
        ),
        max_leaves=30,
    ).map(claim_with),
)


@settings(
    max_examples=200,
    deadline=timedelta(milliseconds=500),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(documents)
def test_validate_config_document_of_anything_gives_problems(text: str | bytes) -> None:
    problems = validate_config_document(text)
    assert isinstance(problems, list)
    assert all(isinstance(problem, str) and problem for problem in problems)

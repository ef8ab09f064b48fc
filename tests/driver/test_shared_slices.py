"""--gpu-sharing consumable: which GPUs are shareable, their slices, the API's policy rules."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from drasil.driver.devices import CapacityPolicy, Device, DeviceType
from drasil.driver.nvidia.nodedevices import (
    COMPUTE_PERCENT,
    COMPUTE_POLICY,
    DiscoveryResult,
    discover,
    memory_policy,
)
from drasil.driver.objects import JsonDict
from drasil.driver.simulated.nvml import simulated_library
from drasil.driver.slices.build import build_slices
from drasil.driver.slices.plan import plan_publish
from drasil.driver.slices.validate import SliceValidationError, validate_device

GiB = 2**30
DRIVER = "gpu.drasil.dev"


def _discover(spec: str, **kwargs: str) -> DiscoveryResult:
    return discover(simulated_library(spec, node_name="n"), node_name="n", **kwargs)


def _shareable(result: DiscoveryResult) -> list[str]:
    return [d.name for d in result.devices if d.allow_multiple_allocations]


def _slice(devices: list[Device]) -> JsonDict:
    (obj,) = build_slices(
        driver=DRIVER, pool="n", devices=devices, node_name="n", generation=1, owner=None
    )
    return obj


# -- discovery ------------------------------------------------------------------------


def test_exclusive_is_the_default_and_unchanged() -> None:
    result = _discover("h100-80gb:1,l4:1")
    assert _shareable(result) == []
    assert all(set(d.capacity) == {"memory"} and not d.capacity_policies for d in result.devices)


def test_consumable_shares_whole_gpus_with_both_policies() -> None:
    exclusive = _discover("h100-80gb:1,l4:1")
    result = _discover("h100-80gb:1,l4:1", gpu_sharing="consumable")
    assert _shareable(result) == ["gpu-0", "gpu-1"]
    l4, l4_exclusive = result.devices[1], exclusive.devices[1]
    assert l4.attributes == l4_exclusive.attributes
    assert dict(l4.capacity) == {**l4_exclusive.capacity, COMPUTE_PERCENT: 100}
    memory = l4_exclusive.capacity["memory"]
    assert memory % GiB != 0  # an L4's 23034 MiB: the maximum must round down
    assert dict(l4.capacity_policies) == {
        "memory": CapacityPolicy(default=22 * GiB, minimum=GiB, step=GiB, maximum=22 * GiB),
        COMPUTE_PERCENT: CapacityPolicy(default=0, minimum=0, step=1, maximum=100),
    }


def test_mig_devices_are_never_shareable() -> None:
    result = _discover("a100-40gb-mig:1,l4:1", gpu_sharing="consumable")
    assert _shareable(result) == ["gpu-1"]
    assert any(d.type is DeviceType.MIG for d in result.devices)


def test_dynamic_mig_shares_placements_and_gpus_without_mig() -> None:
    result = _discover("h100-80gb:1,l4:1", gpu_sharing="consumable", mig_mode="dynamic")
    shared = _shareable(result)
    h100 = result.devices[0]
    assert h100.name == "gpu-0"
    assert "gpu-0" not in shared
    assert h100.consumes_counters  # still partitionable, never shared whole
    assert "gpu-1" in shared
    placements = [d for d in result.devices if d.mig_placement is not None]
    assert placements
    assert all(d.name in shared for d in placements)
    small = next(d for d in placements if d.name == "gpu-0-mig-1g10gb-at-0")
    # Its own memory (9984 MiB) in whole GiB, a computePercent, engines pinned to 0.
    assert small.capacity["memory"] == 9984 * 2**20
    assert small.capacity_policies["memory"] == CapacityPolicy(9 * GiB, GiB, GiB, 9 * GiB)
    assert small.capacity_policies[COMPUTE_PERCENT] == CapacityPolicy(0, 0, 1, 100)
    assert small.capacity[COMPUTE_PERCENT] == 100
    assert small.capacity_policies["multiprocessors"] == CapacityPolicy(0, 0, None, 0)
    assert small.consumes_counters  # counters still keep overlapping placements apart
    slices = build_slices(
        driver=DRIVER,
        pool="n",
        devices=[small],
        node_name="n",
        counter_sets=result.counter_sets[:1],
        generation=1,
        owner=None,
    )
    published = [d for o in slices for d in o["spec"].get("devices") or []]
    device = next(d for d in published if d["name"] == small.name)
    assert device["allowMultipleAllocations"] is True
    assert device["capacity"]["multiprocessors"] == {
        "value": "16",
        "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "0"}},
    }
    validate_device(device)


def test_static_mig_and_exclusive_dynamic_mig_share_nothing() -> None:
    result = _discover("h100-80gb:1", mig_mode="dynamic")
    assert _shareable(result) == []


def test_unknown_sharing_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="gpu_sharing"):
        _discover("l4:1", gpu_sharing="timeslice")


def test_memory_policy_rounds_down_and_refuses_tiny_gpus() -> None:
    # The default is the maximum: a claim that names no amount takes the whole GPU.
    # The minimum keeps the shares that fit within MPS's 48 clients: 79 GiB / 48 -> 2 GiB.
    assert memory_policy(81559 * 2**20) == CapacityPolicy(79 * GiB, 2 * GiB, GiB, 79 * GiB)
    assert memory_policy(48 * GiB) == CapacityPolicy(48 * GiB, GiB, GiB, 48 * GiB)
    assert memory_policy(49 * GiB) == CapacityPolicy(49 * GiB, 2 * GiB, GiB, 49 * GiB)
    assert memory_policy(2 * GiB) == CapacityPolicy(2 * GiB, GiB, GiB, 2 * GiB)
    assert memory_policy(2 * GiB - 1) is None
    for gib in (2, 24, 48, 49, 80, 141, 192):
        policy = memory_policy(gib * GiB)
        assert policy is not None
        assert policy.maximum // policy.minimum <= 48


# -- slices ---------------------------------------------------------------------------


def test_shareable_device_json() -> None:
    device = _discover("h100-80gb:1", gpu_sharing="consumable").devices[0]
    published = _slice([device])["spec"]["devices"][0]
    assert published["allowMultipleAllocations"] is True
    assert published["capacity"] == {
        "computePercent": {
            "value": "100",
            "requestPolicy": {
                "default": "0",
                "validRange": {"min": "0", "max": "100", "step": "1"},
            },
        },
        "memory": {
            "value": "80Gi",
            "requestPolicy": {
                "default": "80Gi",
                "validRange": {"min": "2Gi", "max": "80Gi", "step": "1Gi"},
            },
        },
    }


def test_exclusive_device_json_has_no_sharing_fields() -> None:
    published = _slice(list(_discover("l4:1").devices))["spec"]["devices"][0]
    assert "allowMultipleAllocations" not in published
    assert all("requestPolicy" not in c for c in published["capacity"].values())


def test_policy_for_a_missing_capacity_is_a_bug() -> None:
    device = Device(
        name="gpu-0",
        type=DeviceType.GPU,
        uuid="GPU-0",
        minor=0,
        attributes={},
        capacity={"memory": 8 * GiB},
        allow_multiple_allocations=True,
        capacity_policies={"cores": COMPUTE_POLICY},
    )
    with pytest.raises(SliceValidationError, match='unknown capacity "cores"'):
        _slice([device])


def _shared(policy: dict[str, Any], *, value: str = "8Gi", allow: bool = True) -> JsonDict:
    device: JsonDict = {"name": "gpu-0", "capacity": {"memory": {"value": value}}}
    device["capacity"]["memory"]["requestPolicy"] = policy
    if allow:
        device["allowMultipleAllocations"] = True
    return device


def _range(default: str, **bounds: str) -> dict[str, Any]:
    return {"default": default, "validRange": bounds}


GOOD_POLICIES = [
    _range("1Gi", min="1Gi", max="8Gi", step="1Gi"),
    _range("0", min="0"),  # no step, no max: the capacity bounds it
    _range("3", min="-1"),  # without a step the server allows a negative min
    {"default": "9Gi"},  # a bare default is not checked at all
    {"default": "2Gi", "validValues": ["1Gi", "2Gi", "4Gi"]},
]


@pytest.mark.parametrize("policy", GOOD_POLICIES)
def test_policies_the_api_server_accepts(policy: dict[str, Any]) -> None:
    validate_device(_shared(policy))


BAD_POLICIES = [
    (_range("1Gi", min="1Gi"), False, "needs allowMultipleAllocations"),
    ({"validRange": {"min": "1Gi"}}, True, "default is required"),
    ({"default": "1Gi", "validRange": {"max": "2Gi"}}, True, "min is required"),
    (_range("9Gi", min="9Gi"), True, "min is larger than the capacity"),
    (_range("1Gi", min="2Gi"), True, "default is less than"),
    (_range("4Gi", min="1Gi", max="2Gi"), True, "default is more than"),
    (_range("1Gi", min="1Gi", max="9Gi"), True, "max must lie between"),
    (_range("2Gi", min="2Gi", max="1Gi"), True, "max must lie between"),
    (_range("1Gi", min="1Gi", step="0"), True, "greater than zero"),
    (_range("1Gi", min="1Gi", step="8Gi"), True, r"min \+ step is larger"),
    (_range("1536Mi", min="1Gi", step="1Gi"), True, "default is not validRange.min"),
    (_range("1Gi", min="1Gi", max="7680Mi", step="1Gi"), True, "validRange.max is not"),
    (_range("1", min="-1", step="2"), True, "must not be negative"),
    ({"default": "1Gi", "validRange": {"min": "1Gi"}, "validValues": ["1Gi"]}, True, "not both"),
    ({"default": "3Gi", "validValues": ["1Gi", "2Gi"]}, True, "not one of validValues"),
    ({"default": "1Gi", "validValues": ["2Gi", "1Gi"]}, True, "ascending"),
    ({"default": "1Gi", "validValues": ["1Gi", "9Gi"]}, True, "larger than the capacity"),
    ({"default": "1Gi", "validValues": [str(i) for i in range(11)]}, True, "at most 10"),
    (_range("lots", min="1Gi"), True, "default:"),
]


@pytest.mark.parametrize(("policy", "allow", "message"), BAD_POLICIES)
def test_policies_the_api_server_rejects(policy: dict[str, Any], allow: bool, message: str) -> None:
    with pytest.raises(SliceValidationError, match=message):
        validate_device(_shared(policy, allow=allow))


# -- planning -------------------------------------------------------------------------


def _stored(desired: list[JsonDict]) -> list[JsonDict]:
    """The slices as a server could return them: the same quantities spelled otherwise."""
    stored = copy.deepcopy(desired)
    for obj in stored:
        obj["metadata"].update(uid="u", resourceVersion="1")
        for device in obj["spec"]["devices"]:
            for entry in device["capacity"].values():
                policy = entry.get("requestPolicy")
                if policy is not None:
                    policy["validRange"]["min"] = str(parse_bytes(policy["validRange"]["min"]))
    return stored


def parse_bytes(text: str) -> int:
    return int(text[:-2]) * GiB if text.endswith("Gi") else int(text)


def _published(**kwargs: str) -> list[JsonDict]:
    result = _discover("h100-80gb:2", **kwargs)
    return build_slices(
        driver=DRIVER, pool="n", devices=result.devices, node_name="n", generation=1, owner=None
    )


def test_spelling_of_policy_quantities_causes_no_rewrite() -> None:
    desired = _published(gpu_sharing="consumable")
    assert plan_publish(desired=desired, existing=_stored(desired)).empty


def test_explicit_false_equals_absent() -> None:
    desired = _published()
    stored = _stored(desired)
    for device in stored[0]["spec"]["devices"]:
        device["allowMultipleAllocations"] = False
    assert plan_publish(desired=desired, existing=stored).empty


def test_switching_sharing_or_changing_a_policy_republishes() -> None:
    exclusive = _published()
    consumable = _published(gpu_sharing="consumable")
    assert plan_publish(desired=consumable, existing=_stored(exclusive)).writes == 1
    changed = copy.deepcopy(consumable)
    policy = changed[0]["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]
    policy["default"] = "2Gi"
    assert plan_publish(desired=changed, existing=_stored(consumable)).writes == 1


def test_gpus_older_than_volta_stay_exclusive(monkeypatch: pytest.MonkeyPatch) -> None:
    """MPS before Volta does not hold a client to its limits: no shares of such a GPU."""
    lib = simulated_library("l4:2", node_name="n")
    real = lib.device_cuda_compute_capability

    def capability(handle: object) -> tuple[int, int]:
        major, minor = real(handle)  # type: ignore[arg-type]
        return (6, 1) if lib.device_minor_number(handle) == 0 else (major, minor)  # type: ignore[arg-type]

    monkeypatch.setattr(lib, "device_cuda_compute_capability", capability)
    result = discover(lib, node_name="n", gpu_sharing="consumable")
    assert _shareable(result) == ["gpu-1"]

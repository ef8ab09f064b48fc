"""Shares of a consumable GPU in the prepare plan: modes, limits, conflicts, CDI names."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

import pytest
from test_claimplan import DRIVER, NODE, OTHER_UID, REF, UID, config, result

from drasil.api.checkpoint import ClaimRecord, ClaimState, PreparedDevice
from drasil.driver.claims.deviceconfigs import AllocationError
from drasil.driver.claims.plan import NodePool, PlanError, check_not_held, plan_prepare
from drasil.driver.devices import CapacityPolicy, Device, DeviceType

GIB = 2**30
GPU = Device(
    name="gpu-0",
    type=DeviceType.GPU,
    uuid="GPU-0000",
    minor=0,
    attributes={"type": "gpu", "uuid": "GPU-0000"},
    capacity={"memory": 80 * GIB, "computePercent": 100},
    allow_multiple_allocations=True,
    capacity_policies={
        "memory": CapacityPolicy(default=GIB, minimum=GIB, step=GIB),
        "computePercent": CapacityPolicy(default=0, minimum=0, step=1, maximum=100),
    },
)
POOL = NodePool(driver=DRIVER, pool=NODE, devices={"gpu-0": GPU})


def share(share_id: str = "s-1", **consumed: str) -> dict[str, Any]:
    return result("gpu-0", shareID=share_id, consumedCapacity=consumed)


def claim(*results: dict[str, Any], configs: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ml", "name": "train", "uid": UID},
        "status": {"allocation": {"devices": {"results": list(results), "config": list(configs)}}},
    }


def plan(*results: dict[str, Any], configs: tuple[dict[str, Any], ...] = ()) -> Any:
    return plan_prepare(claim(*results, configs=configs), ref=REF, node=POOL)


def test_a_share_is_mps_with_limits_from_what_it_consumed() -> None:
    (device,) = plan(share(memory="20Gi")).devices
    assert device.prepared.sharing == "MPS"
    assert device.result.consumed_capacity == {"memory": 20 * GIB}
    limits = device.share_limits
    assert limits is not None
    assert (limits.memory_bytes, limits.thread_percentage) == (20 * GIB, 25)


def test_a_consumed_compute_share_sets_the_thread_percentage() -> None:
    (device,) = plan(share(memory="8Gi", computePercent="30")).devices
    assert device.share_limits is not None
    assert device.share_limits.thread_percentage == 30


def test_the_cdi_device_of_a_share_is_named_after_the_share() -> None:
    (device,) = plan(share("a1b2")).devices
    assert device.prepared.cdi_device_ids == (f"k8s.{DRIVER}/claim={UID}-gpu-0-share-a1b2",)


def test_time_slicing_on_a_share_is_recorded_with_its_interval() -> None:
    configs = (config("TimeSlicing", timeSlicing={"interval": "Long"}),)
    (device,) = plan(share(), configs=configs).devices
    assert device.prepared.sharing == "TimeSlicing/Long"
    assert device.share_limits is None


def test_an_explicit_exclusive_config_on_a_share_is_refused_with_the_allowed_values() -> None:
    with pytest.raises(PlanError, match=r"Exclusive cannot apply to a share.*MPS and TimeSlicing"):
        plan(share(), configs=(config("Exclusive"),))


def test_a_consumed_capacity_that_is_not_a_quantity_is_the_claims_error() -> None:
    with pytest.raises(AllocationError, match=r"consumedCapacity\.memory"):
        plan(share(memory="lots"))


def held_by(sharing: str) -> dict[str, ClaimRecord]:
    device = PreparedDevice(pool_name=NODE, device_name="gpu-0", share_id="s-2", sharing=sharing)
    record = ClaimRecord(
        namespace="ml",
        name="other",
        state=ClaimState.PREPARE_COMPLETED,
        devices=(device,),
        updated_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    return {OTHER_UID: record}


def test_shares_that_agree_may_sit_on_one_gpu() -> None:
    check_not_held(plan(share()), held_by("MPS"))


def test_a_share_that_disagrees_is_refused_naming_both() -> None:
    configs = (config("TimeSlicing", requests=("gpu",), timeSlicing={"interval": "Long"}),)
    with pytest.raises(PlanError) as err:
        check_not_held(plan(share(), configs=configs), held_by("MPS"))
    text = str(err.value)
    assert "shared with MPS by claim ml/other" in text
    assert "ml/train asks TimeSlicing/Long" in text
    assert "config[0] (FromClaim, requests [gpu])" in text


def test_a_whole_exclusive_gpu_records_only_time_slicing() -> None:
    exclusive = dataclasses.replace(GPU, allow_multiple_allocations=False, capacity_policies={})
    node = dataclasses.replace(POOL, devices={"gpu-0": exclusive})
    plain = plan_prepare(claim(result("gpu-0")), ref=REF, node=node)
    assert plain.devices[0].prepared.sharing is None
    sliced = plan_prepare(
        claim(result("gpu-0"), configs=(config("TimeSlicing", timeSlicing={"interval": "Short"}),)),
        ref=REF,
        node=node,
    )
    assert sliced.devices[0].prepared.sharing == "TimeSlicing/Short"

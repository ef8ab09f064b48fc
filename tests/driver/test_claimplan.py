"""The prepare plan (``drasil.driver.claims.plan``): what one claim's prepare does,
worked out from the claim's JSON and the node's devices with no side effect."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

import pytest
from test_configs import DEVICES

from drasil.api.checkpoint import ClaimRecord, ClaimState, PreparedDevice
from drasil.api.config import API_VERSION, GpuConfig
from drasil.driver.cdi.spec import ContainerEdits
from drasil.driver.claims.deviceconfigs import AllocationError, ConfigResolutionError
from drasil.driver.claims.plan import (
    ClaimRef,
    NodePool,
    PlanError,
    PreparePlan,
    check_not_held,
    plan_prepare,
)

DRIVER = "gpu.drasil.dev"
NODE = "node-a"
UID = "0b7c3f2e-8d1a-4c55-9e0f-1a2b3c4d5e6f"
OTHER_UID = "1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f9"
REF = ClaimRef(namespace="ml", name="train", uid=UID)


# The devices of the config-resolution tests: gpu-0, gpu-1 and mig-0.
POOL = NodePool(driver=DRIVER, pool=NODE, devices=DEVICES)


def result(name: str, *, request: str = "gpu", pool: str = NODE, **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": DRIVER, "pool": pool, "device": name, **extra}


def config(strategy: str, *, requests: tuple[str, ...] = (), **sharing: Any) -> dict[str, Any]:
    parameters = {"apiVersion": API_VERSION, "kind": "GpuConfig"}
    parameters["sharing"] = {"strategy": strategy, **sharing}
    return {
        "source": "FromClaim",
        "requests": list(requests),
        "opaque": {"driver": DRIVER, "parameters": parameters},
    }


def claim(*results: dict[str, Any], configs: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ml", "name": "train", "uid": UID},
        "status": {"allocation": {"devices": {"results": list(results), "config": list(configs)}}},
    }


def plan_of(*results: dict[str, Any], **kwargs: Any) -> PreparePlan:
    return plan_prepare(claim(*results, **kwargs), ref=REF, node=POOL)


def cdi_id(name: str) -> str:
    return f"k8s.{DRIVER}/claim={UID}-{name}"


# ---- what the plan holds ---------------------------------------------------------------


def test_the_checkpoint_devices_and_kubelets_answer_in_result_order() -> None:
    plan = plan_of(result("gpu-1", request="big/full"), result("gpu-0"))
    assert plan.claim == REF
    assert plan.prepared == (
        PreparedDevice(
            request_names=("big",),  # the claim's request, not the firstAvailable subrequest
            pool_name=NODE,
            device_name="gpu-1",
            cdi_device_ids=(cdi_id("gpu-1"),),
        ),
        PreparedDevice(
            request_names=("gpu",),
            pool_name=NODE,
            device_name="gpu-0",
            cdi_device_ids=(cdi_id("gpu-0"),),
        ),
    )


def test_shares_and_admin_access_are_recorded() -> None:
    plan = plan_of(result("gpu-0", shareID="s-1"), result("gpu-1", adminAccess=True))
    assert [(d.share_id, d.admin_access) for d in plan.prepared] == [("s-1", False), (None, True)]


def test_the_spec_request_names_the_claim_its_devices_and_the_common_edits() -> None:
    edits = ContainerEdits(env={"EXTRA": "1"})
    node = dataclasses.replace(POOL, common_edits=edits)
    plan = plan_prepare(claim(result("gpu-1"), result("gpu-0")), ref=REF, node=node)
    spec = plan.spec
    assert (spec.claim_uid, spec.namespace, spec.name) == (UID, "ml", "train")
    assert [d.device for d in spec.devices] == [POOL.devices["gpu-1"], POOL.devices["gpu-0"]]
    assert spec.common_edits is edits


def test_each_device_gets_the_settings_of_its_resolved_config() -> None:
    plan = plan_of(
        result("gpu-0", request="a"),
        result("gpu-1", request="b"),
        configs=(config("TimeSlicing", requests=("a",), timeSlicing={"interval": "Long"}),),
    )
    sliced, default = plan.devices
    assert sliced.cdi.settings == {"SHARING_STRATEGY": "TimeSlicing", "TIMESLICE_INTERVAL": "Long"}
    assert sliced.config.entry is not None
    assert default.cdi.settings == {"SHARING_STRATEGY": "Exclusive"}
    assert default.config.config == GpuConfig()
    assert default.config.entry is None


def test_results_of_other_drivers_are_left_out() -> None:
    other = {**result("gpu-9"), "driver": "other.example.com"}
    assert [d.result.device for d in plan_of(other, result("gpu-0")).devices] == ["gpu-0"]


def test_a_plan_is_the_same_every_time_and_cannot_be_changed() -> None:
    first = plan_of(result("gpu-0"), configs=(config("TimeSlicing"),))
    assert plan_of(result("gpu-0"), configs=(config("TimeSlicing"),)) == first
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.devices = ()  # type: ignore[misc]


# ---- claims this node cannot prepare ---------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "pool_name"),
    [(result("gpu-7"), NODE), (result("gpu-0", pool="node-b"), "node-b")],
    ids=["unknown-device", "other-pool"],
)
def test_a_device_that_is_not_ours_is_named(entry: dict[str, Any], pool_name: str) -> None:
    with pytest.raises(PlanError) as err:
        plan_of(entry)
    assert str(err.value) == (
        f'request "gpu": device "{entry["device"]}" of pool "{pool_name}" is not a device of '
        f'driver {DRIVER} on node "{NODE}" (known: gpu-0, gpu-1, mig-0)'
    )


def test_errors_come_in_order_allocation_then_device_then_config() -> None:
    broken = claim(result("gpu-7"))
    broken["status"]["allocation"]["devices"]["results"].append("not an object")
    with pytest.raises(AllocationError):
        plan_prepare(broken, ref=REF, node=POOL)
    with pytest.raises(PlanError):
        plan_of(result("gpu-7"), configs=(config("NoSuchStrategy"),))
    with pytest.raises(ConfigResolutionError, match="NoSuchStrategy"):
        plan_of(result("gpu-0"), configs=(config("NoSuchStrategy"),))


def test_a_gpu_config_for_a_mig_request_is_refused() -> None:
    with pytest.raises(ConfigResolutionError, match="cannot be applied"):
        plan_of(result("mig-0", request="m"), configs=(config("Exclusive", requests=("m",)),))


# ---- devices other claims hold -----------------------------------------------------------------


def record(*devices: PreparedDevice) -> ClaimRecord:
    return ClaimRecord(
        namespace="ml",
        name="other",
        state=ClaimState.PREPARE_COMPLETED,
        devices=devices,
        updated_at=datetime(2026, 1, 1, tzinfo=UTC),
    )


def held(name: str, **extra: Any) -> PreparedDevice:
    return PreparedDevice(**{"pool_name": NODE, "device_name": name, **extra})


def test_a_device_another_claim_holds_is_refused_naming_that_claim() -> None:
    with pytest.raises(PlanError) as err:
        check_not_held(plan_of(result("gpu-0")), {OTHER_UID: record(held("gpu-0"))})
    assert str(err.value) == (
        f'device "gpu-0" is already prepared for claim ml/other ({OTHER_UID}); it cannot be '
        "used by ml/train until that claim is unprepared"
    )


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (result("gpu-0"), held("gpu-1")),  # another device
        (result("gpu-0"), held("gpu-0", pool_name="node-b")),  # another pool's device
        (result("gpu-0", adminAccess=True), held("gpu-0")),
        (result("gpu-0"), held("gpu-0", admin_access=True)),
        (result("gpu-0", shareID="s-1"), held("gpu-0", share_id="s-2")),
    ],
    ids=["other-device", "other-pool", "admin-ours", "admin-theirs", "both-shares"],
)
def test_devices_that_may_be_held_together(ours: dict[str, Any], theirs: PreparedDevice) -> None:
    check_not_held(plan_of(ours), {OTHER_UID: record(theirs)})


def test_a_share_on_an_exclusively_held_device_is_refused() -> None:
    with pytest.raises(PlanError, match="already prepared"):
        check_not_held(plan_of(result("gpu-0", shareID="s-1")), {OTHER_UID: record(held("gpu-0"))})


def test_the_claims_own_record_is_no_conflict() -> None:
    check_not_held(plan_of(result("gpu-0")), {UID: record(held("gpu-0"))})


def test_admin_access_devices_say_so_and_carry_no_sharing_settings() -> None:
    plan = plan_of(result("gpu-0", adminAccess=True), configs=(config("TimeSlicing"),))
    assert plan.devices[0].cdi.settings == {"ADMIN_ACCESS": "true"}

"""DevicePools with binding conditions and the simulated fabric."""

from __future__ import annotations

from typing import Any

import pytest

from drasil.api.devicepool import DevicePoolError, parse_devicepool
from drasil.controller.devicepools import ATTACH_FAILED_TAINT, desired_slices
from drasil.driver.devicepools import PoolSpecError

DRIVER = "gpu.drasil.dev"
OK, FAILED = "drasil.dev/Attached", "drasil.dev/AttachFailed"


def pool(*devices: dict[str, Any], **spec: Any) -> Any:
    return parse_devicepool(
        {
            "apiVersion": "drasil.dev/v1alpha1",
            "kind": "DevicePool",
            "metadata": {"name": "fabric", "uid": "uid-1"},
            "spec": {"allNodes": True, "devices": list(devices), **spec},
        }
    )


def fab(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "bindsToNode": True, "bindingConditions": [OK],
            "bindingFailureConditions": [FAILED], **extra}  # fmt: skip


def devices(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices for d in s["spec"]["devices"]}


def test_binding_fields_reach_the_slice() -> None:
    published = devices(desired_slices(pool(fab("fab-0")), driver=DRIVER))["fab-0"]

    assert published["bindsToNode"] is True
    assert published["bindingConditions"] == [OK]
    assert published["bindingFailureConditions"] == [FAILED]


def test_a_bad_binding_condition_is_an_invalid_spec_naming_the_device() -> None:
    bad = pool(fab("fab-0", bindingConditions=["no spaces allowed"]))

    with pytest.raises(PoolSpecError, match='device "fab-0": bindingConditions'):
        desired_slices(bad, driver=DRIVER)


def test_more_than_four_conditions_are_refused_by_the_types() -> None:
    with pytest.raises(DevicePoolError, match="bindingConditions"):
        pool(fab("fab-0", bindingConditions=list("abcde")))


def test_fail_devices_must_name_devices_of_the_pool() -> None:
    with pytest.raises(PoolSpecError, match='failDevices: no device named "fab-9"'):
        desired_slices(
            pool(fab("fab-0"), simulatedFabric={"failDevices": ["fab-9"]}), driver=DRIVER
        )


def test_attach_seconds_are_bounded() -> None:
    with pytest.raises(DevicePoolError, match="attachSeconds"):
        pool(fab("fab-0"), simulatedFabric={"attachSeconds": 7200})


def test_a_failed_device_is_tainted_while_the_fabric_fails_it() -> None:
    failing = pool(fab("fab-0"), fab("fab-1"), simulatedFabric={"failDevices": ["fab-0"]})
    repaired = pool(fab("fab-0"), fab("fab-1"), simulatedFabric={"failDevices": []})

    tainted = devices(desired_slices(failing, driver=DRIVER, attach_failed={"fab-0"}))
    assert [t["key"] for t in tainted["fab-0"]["taints"]] == [ATTACH_FAILED_TAINT]
    assert tainted["fab-0"]["taints"][0]["effect"] == "NoSchedule"
    assert "taints" not in tainted["fab-1"]
    lifted = devices(desired_slices(repaired, driver=DRIVER, attach_failed={"fab-0"}))
    assert "taints" not in lifted["fab-0"]

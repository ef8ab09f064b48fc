"""Binding-condition fields of devices in ResourceSlices (KEP-5007) and their checks."""

from __future__ import annotations

from typing import Any

import pytest

from drasil.driver.devices import Device, DeviceType
from drasil.driver.slices.build import build_slices
from drasil.driver.slices.validate import SliceValidationError, validate_device

OK, FAILED = "drasil.dev/Attached", "drasil.dev/AttachFailed"


def device(**binding: Any) -> Device:
    return Device(
        name="fab-0",
        type=DeviceType.GPU,
        uuid="",
        minor=0,
        attributes={},
        capacity={},
        **binding,
    )


def test_binding_fields_are_published() -> None:
    attachable = device(
        binds_to_node=True, binding_conditions=(OK,), binding_failure_conditions=(FAILED,)
    )
    [obj] = build_slices(driver="d.example.com", pool="p", devices=[attachable],
                         all_nodes=True, generation=1, owner=None)  # fmt: skip

    [published] = obj["spec"]["devices"]
    assert published["bindsToNode"] is True
    assert published["bindingConditions"] == [OK]
    assert published["bindingFailureConditions"] == [FAILED]


def test_a_plain_device_has_no_binding_fields() -> None:
    [obj] = build_slices(driver="d.example.com", pool="p", devices=[device()],
                         all_nodes=True, generation=1, owner=None)  # fmt: skip

    assert set(obj["spec"]["devices"][0]) == {"name"}


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"bindingConditions": ["a", "b", "c", "d", "e"], "bindingFailureConditions": ["f"]},
         "bindingConditions: 5 condition types, more than 4"),
        ({"bindingConditions": ["a"], "bindingFailureConditions": list("bcdef")},
         "bindingFailureConditions: 5 condition types, more than 4"),
        ({"bindingConditions": ["not a label"], "bindingFailureConditions": ["f"]},
         "bindingConditions: 'not a label': name"),
        ({"bindingConditions": ["a", "a"], "bindingFailureConditions": ["f"]},
         "bindingConditions: 'a' is listed twice"),
        ({"bindingConditions": ["a"], "bindingFailureConditions": ["a"]},
         "bindingFailureConditions: 'a' is also a binding condition"),
        ({"bindingConditions": ["a"]}, "bindingFailureConditions are required"),
        ({"bindingFailureConditions": ["a"]}, "bindingConditions are required"),
        ({"bindsToNode": "yes"}, "bindsToNode must be a boolean"),
    ],
)  # fmt: skip
def test_what_the_api_server_rejects_is_named(fields: dict[str, Any], error: str) -> None:
    with pytest.raises(SliceValidationError, match=error.replace("(", r"\(")):
        validate_device({"name": "fab-0", **fields})


def test_four_of_each_pass() -> None:
    validate_device(
        {"name": "x", "bindingConditions": list("abcd"), "bindingFailureConditions": list("efgh")}
    )

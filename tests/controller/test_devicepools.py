"""DevicePool → Device conversion, desired slices and the Ready condition."""

from __future__ import annotations

from typing import Any

import pytest

from drasil.api.devicepool import PoolDevice, parse_devicepool
from drasil.controller.devicepools import (
    POOL_LABEL,
    PoolStatus,
    desired_slices,
    foreign_owner,
    pool_driver,
    published_message,
    status_patch,
    to_device,
)
from drasil.driver.devicepools import PoolSpecError
from drasil.driver.devices import DeviceType, Version

DRIVER = "gpu.drasil.dev"
RACK_A = {"nodeSelectorTerms": [{"matchLabels": {"rack": "a"}}]}


def pool(*devices: dict[str, Any], **spec: Any) -> Any:
    return parse_devicepool(
        {
            "apiVersion": "drasil.dev/v1alpha1",
            "kind": "DevicePool",
            "metadata": {"name": "rack-a", "uid": "uid-1", "generation": 2},
            "spec": {"devices": list(devices), **({"allNodes": True} | spec)},
        }
    )


def gpu(name: str = "remote-0", **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {"type": {"string": "gpu"}, "productName": {"string": "NVIDIA L4"}},
        "capacity": {"memory": {"value": "24Gi"}},
        **extra,
    }


def test_to_device_keeps_attribute_types_and_whole_capacities() -> None:
    spec = PoolDevice.model_validate(
        {
            "name": "remote-0",
            "attributes": {
                "type": {"string": "mig"},
                "uuid": {"string": "GPU-1"},
                "minor": {"int": 3},
                "cuda": {"version": "12.4.0"},
                "nvlink": {"bool": True},
            },
            "capacity": {"memory": {"value": "24Gi"}, "slots": {"value": 7}, "bw": {"value": "1k"}},
        }
    )

    device = to_device(spec)

    assert (device.name, device.type, device.uuid, device.minor) == (
        "remote-0",
        DeviceType.MIG,
        "GPU-1",
        3,
    )
    assert device.attributes["cuda"] == Version("12.4.0")
    assert device.attributes["nvlink"] is True
    assert dict(device.capacity) == {"memory": 24 * 2**30, "slots": 7, "bw": 1000}


def test_a_device_without_type_is_a_gpu_for_the_builder() -> None:
    device = to_device(
        PoolDevice.model_validate({"name": "x", "attributes": {"type": {"string": "fpga"}}})
    )

    assert device.type is DeviceType.GPU
    assert device.attributes["type"] == "fpga"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("attributes", {"a": {"int": 1, "string": "x"}}, 'attribute "a": needs exactly one of'),
        (
            "capacity",
            {"memory": {"value": "lots"}},
            "capacity \"memory\": 'lots' is not a quantity",
        ),
        ("capacity", {"memory": {"value": "500m"}}, "is not a whole non-negative number"),
        ("capacity", {"memory": {"value": "-1"}}, "is not a whole non-negative number"),
    ],
)
def test_conversion_errors_name_device_and_field(field: str, value: Any, message: str) -> None:
    with pytest.raises(PoolSpecError, match=message) as err:
        desired_slices(pool({"name": "remote-0", field: value}), driver=DRIVER)
    assert str(err.value).startswith('device "remote-0"')


def test_desired_slices_use_the_shared_builder() -> None:
    slices = desired_slices(
        pool(gpu("remote-10"), gpu("remote-2"), nodeSelector=RACK_A, allNodes=None), driver=DRIVER
    )

    [obj] = slices
    assert obj["metadata"]["name"] == "rack-a-gpu-drasil-dev-0"
    assert obj["metadata"]["labels"] == {POOL_LABEL: "rack-a"}
    assert obj["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "drasil.dev/v1alpha1",
            "kind": "DevicePool",
            "name": "rack-a",
            "uid": "uid-1",
            "controller": True,
        }
    ]
    spec = obj["spec"]
    assert spec["driver"] == DRIVER
    assert spec["pool"] == {"name": "rack-a", "generation": 0, "resourceSliceCount": 1}
    assert spec["nodeSelector"] == RACK_A
    assert "allNodes" not in spec
    assert [d["name"] for d in spec["devices"]] == ["remote-2", "remote-10"]
    assert spec["devices"][0]["capacity"] == {"memory": {"value": "24Gi"}}


def test_taints_reach_the_slice() -> None:
    taint = {"key": "maintenance", "value": "planned", "effect": "NoSchedule"}

    [obj] = desired_slices(pool(gpu(taints=[taint])), driver=DRIVER)

    assert obj["spec"]["devices"][0]["taints"] == [taint]


def test_many_devices_are_split_under_the_limit() -> None:
    slices = desired_slices(pool(*(gpu(f"remote-{i}") for i in range(130))), driver=DRIVER)

    assert [len(s["spec"]["devices"]) for s in slices] == [128, 2]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {2}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"allNodes": None}, "set exactly one of spec.nodeSelector and spec.allNodes: true"),
        ({"nodeSelector": RACK_A}, "set exactly one of spec.nodeSelector and spec.allNodes: true"),
        (
            {"allNodes": None, "nodeSelector": {"nodeSelectorTerms": [{}, {}]}},
            "spec.nodeSelector must have exactly one nodeSelectorTerm",
        ),
    ],
)
def test_node_selection_errors(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(PoolSpecError, match=message):
        desired_slices(pool(gpu(), **spec), driver=DRIVER)


@pytest.mark.parametrize(
    ("device", "message"),
    [
        (gpu("Remote_0"), 'device "Remote_0": name is not a DNS label'),
        (gpu(attributes={"bad name!": {"string": "x"}}), 'attribute "bad name!"'),
        (gpu(attributes={"v": {"version": "12.4"}}), "is not a valid semver version"),
        (gpu(attributes={"s": {"string": "x" * 65}}), "of at most 64 characters"),
        (
            gpu(attributes={f"a{i}": {"int": i} for i in range(32)}),
            "more than 32 attributes and capacities",
        ),
    ],
)
def test_what_the_api_would_reject_is_an_error_in_words(
    device: dict[str, Any], message: str
) -> None:
    with pytest.raises(PoolSpecError, match=message):
        desired_slices(pool(device), driver=DRIVER)


def test_duplicate_device_names() -> None:
    with pytest.raises(PoolSpecError, match="device names used more than once: remote-0"):
        desired_slices(pool(gpu(), gpu()), driver=DRIVER)


def test_pool_driver_defaults_to_the_controllers() -> None:
    assert pool_driver(pool(gpu()), DRIVER) == DRIVER
    assert pool_driver(pool(gpu(), driver="other.example.com"), DRIVER) == "other.example.com"


def test_foreign_owner_names_a_node() -> None:
    node_slice = {
        "metadata": {"ownerReferences": [{"kind": "Node", "name": "n1", "controller": True}]}
    }
    ours = {
        "metadata": {
            "ownerReferences": [{"kind": "DevicePool", "name": "rack-a", "controller": True}]
        }
    }

    assert foreign_owner([ours, node_slice]) == "Node n1"
    assert foreign_owner([ours]) is None


def test_published_message_counts() -> None:
    slices = desired_slices(pool(gpu("a"), gpu("b")), driver=DRIVER)

    assert published_message(slices, driver=DRIVER, pool="rack-a") == (
        "2 devices published in 1 ResourceSlice of pool rack-a (driver gpu.drasil.dev)"
    )


def test_status_patch_sets_the_condition_and_moves_time_only_on_a_flip() -> None:
    ready = PoolStatus(True, "Published", "ok", ("s-0",), 2)

    first = status_patch(None, ready, now="T1")
    assert first == {
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "Published",
                    "message": "ok",
                    "lastTransitionTime": "T1",
                    "observedGeneration": 2,
                }
            ],
            "publishedSlices": ["s-0"],
            "observedGeneration": 2,
        }
    }
    current = first["status"]
    assert status_patch(current, ready, now="T2") is None

    other_message = status_patch(
        current, PoolStatus(True, "Published", "new", ("s-0",), 3), now="T2"
    )
    assert other_message is not None
    assert other_message["status"]["conditions"][0]["lastTransitionTime"] == "T1"

    broken = status_patch(current, PoolStatus(False, "InvalidSpec", "bad", ("s-0",), 3), now="T3")
    assert broken is not None
    assert broken["status"]["conditions"][0]["lastTransitionTime"] == "T3"


def test_status_patch_keeps_other_conditions() -> None:
    current = {"conditions": [{"type": "Audited", "status": "True"}]}

    patch = status_patch(current, PoolStatus(True, "Published", "ok", (), 1), now="T")

    assert patch is not None
    assert [c["type"] for c in patch["status"]["conditions"]] == ["Audited", "Ready"]

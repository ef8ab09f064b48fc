"""ResourceSlice building under the API limits, and publish planning."""

from __future__ import annotations

import copy
import itertools
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest

from drasil.driver.devices import (
    AttributeValue,
    CounterConsumption,
    CounterSet,
    Device,
    DeviceType,
    Version,
)
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.objects import JsonDict
from drasil.driver.simulated.nvml import simulated_library
from drasil.driver.slices.build import OwnerRef, Taint, build_slices, natural_key, slice_name
from drasil.driver.slices.plan import PublishPlan, plan_publish
from drasil.driver.slices.validate import (
    SliceValidationError,
    TaintEffect,
    is_dns_subdomain,
    validate_slice,
)

DRIVER = "gpu.drasil.dev"
UNHEALTHY = Taint(key="gpu.drasil.dev/unhealthy", value="xid-79", effect=TaintEffect.NO_SCHEDULE)


def _device(name: str, **attributes: AttributeValue) -> Device:
    return Device(
        name=name,
        type=DeviceType.GPU,
        uuid=f"GPU-{name}",
        minor=0,
        attributes={"type": "gpu", **attributes},
        capacity={"memory": 80 * 2**30},
    )


def _devices(count: int) -> list[Device]:
    return [_device(f"gpu-{i}") for i in range(count)]


def _build(devices: Sequence[Device], **kwargs: Any) -> list[JsonDict]:
    args: dict[str, Any] = {
        "driver": DRIVER,
        "pool": "node-a",
        "node_name": "node-a",
        "generation": 0,
        "owner": OwnerRef.node(name="node-a", uid="uid-node-a"),
    }
    args.update(kwargs)
    return build_slices(devices=devices, **args)


def _sizes(slices: Sequence[JsonDict]) -> list[int]:
    return [len(s["spec"].get("devices", [])) for s in slices]


def _validated(slices: list[JsonDict]) -> list[JsonDict]:
    # The helper every test uses: each built slice must pass the API-limit checks and
    # survive a JSON round trip unchanged (no Python-only types leak out).
    for obj in slices:
        validate_slice(obj)
        assert json.loads(json.dumps(obj)) == obj
    return slices


def test_discovered_h100_slice() -> None:
    result = discover(simulated_library("h100-80gb:8", node_name="node-a"), node_name="node-a")
    (obj,) = _validated(_build(result.devices))
    assert obj["apiVersion"] == "resource.k8s.io/v1"
    assert obj["kind"] == "ResourceSlice"
    assert obj["metadata"] == {
        "name": "node-a-gpu-drasil-dev-0",
        "ownerReferences": [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "name": "node-a",
                "uid": "uid-node-a",
                "controller": True,
            }
        ],
    }
    spec = obj["spec"]
    assert spec["driver"] == DRIVER
    assert spec["pool"] == {"name": "node-a", "generation": 0, "resourceSliceCount": 1}
    assert spec["nodeName"] == "node-a"
    device = spec["devices"][0]
    assert device["name"] == "gpu-0"
    attributes = device["attributes"]
    assert attributes["type"] == {"string": "gpu"}
    assert attributes["index"] == {"int": 0}
    assert attributes["cudaComputeCapability"] == {"version": "9.0.0"}
    assert attributes["driverVersion"] == {"version": "580.95.5"}
    assert attributes["resource.kubernetes.io/pciBusID"]["string"].startswith("0000:")
    assert device["capacity"] == {"memory": {"value": "80Gi"}}
    assert list(attributes) == sorted(attributes)


def test_memory_quantities() -> None:
    result = discover(
        simulated_library("a100-80gb:1,a100-40gb-mig:1", node_name="n"), node_name="n"
    )
    devices = {d["name"]: d for d in _validated(_build(result.devices))[0]["spec"]["devices"]}
    assert devices["gpu-0"]["capacity"] == {"memory": {"value": "80Gi"}}
    mig = devices["gpu-1-mig-1g5gb-9-0"]
    assert mig["capacity"]["memory"] == {"value": "4864Mi"}
    assert mig["capacity"]["multiprocessors"] == {"value": "14"}
    assert mig["attributes"]["profile"] == {"string": "1g.5gb"}
    assert mig["attributes"]["parentUUID"]["string"].startswith("GPU-")


def test_200_devices_split_128_and_72() -> None:
    slices = _validated(_build(_devices(200)))
    assert _sizes(slices) == [128, 72]
    assert [s["metadata"]["name"] for s in slices] == [
        "node-a-gpu-drasil-dev-0",
        "node-a-gpu-drasil-dev-1",
    ]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {2}
    names = [d["name"] for s in slices for d in s["spec"]["devices"]]
    assert names == [f"gpu-{i}" for i in range(200)]  # natural order: gpu-2 before gpu-10


def test_tainted_devices_split_into_64s() -> None:
    devices = _devices(200)
    slices = _validated(_build(devices, taints={d.name: [UNHEALTHY] for d in devices}))
    assert _sizes(slices) == [64, 64, 64, 8]
    taint = slices[0]["spec"]["devices"][0]["taints"][0]
    assert taint == {"key": "gpu.drasil.dev/unhealthy", "value": "xid-79", "effect": "NoSchedule"}


def test_one_tainted_device_limits_only_its_slice() -> None:
    slices = _validated(_build(_devices(200), taints={"gpu-150": [UNHEALTHY]}))
    assert _sizes(slices) == [128, 64, 8]


def test_counters_get_their_own_slices() -> None:
    devices = _devices(70)
    counter_sets = [
        CounterSet(name=f"gpu-{i}-counters", counters={"memory": 80 * 2**30}) for i in range(10)
    ]
    consumes = {
        d.name: [CounterConsumption(counter_set="gpu-0-counters", counters={"memory": 2**30})]
        for d in devices
    }
    slices = _validated(_build(devices, counter_sets=counter_sets, consumes=consumes))
    assert _sizes(slices) == [0, 0, 64, 6]
    first, second = slices[0]["spec"], slices[1]["spec"]
    assert "devices" not in first
    assert len(first["sharedCounters"]) == 8
    assert len(second["sharedCounters"]) == 2
    assert first["sharedCounters"][0] == {
        "name": "gpu-0-counters",
        "counters": {"memory": {"value": "80Gi"}},
    }
    assert slices[2]["spec"]["devices"][0]["consumesCounters"] == [
        {"counterSet": "gpu-0-counters", "counters": {"memory": {"value": "1Gi"}}}
    ]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {4}


def test_consumption_of_unknown_counters_is_rejected() -> None:
    consumes = {"gpu-0": [CounterConsumption(counter_set="nope", counters={"memory": 1})]}
    with pytest.raises(SliceValidationError, match='device "gpu-0": consumesCounters'):
        _build(_devices(1), consumes=consumes)


def test_identical_input_gives_identical_output() -> None:
    devices = _devices(300)
    shuffled = random.Random(7).sample(devices, len(devices))
    taints = {"gpu-7": [UNHEALTHY]}
    first = json.dumps(_build(devices, taints=taints))
    assert json.dumps(_build(shuffled, taints=taints)) == first
    assert json.dumps(_build(list(reversed(devices)), taints=taints)) == first


def test_node_selection_is_exactly_one() -> None:
    selector = {"nodeSelectorTerms": [{"matchLabels": {}}]}
    with pytest.raises(ValueError, match="exactly one"):
        _build(_devices(1), node_selector=selector)
    (obj,) = _validated(_build(_devices(1), node_name=None, all_nodes=True))
    assert obj["spec"]["allNodes"] is True
    assert "nodeName" not in obj["spec"]
    (obj,) = _validated(_build(_devices(1), node_name=None, node_selector=selector))
    assert obj["spec"]["nodeSelector"] == selector


def test_empty_pool_has_one_empty_slice() -> None:
    (obj,) = _validated(_build([]))
    assert obj["spec"]["devices"] == []


@pytest.mark.parametrize(
    ("device", "message"),
    [
        (_device("gpu-0", **{"bad name": 1}), 'device "gpu-0": attribute "bad name"'),
        (_device("gpu-0", **{"a" * 33: 1}), "C identifier of at most 32"),
        (_device("gpu-0", **{"Bad_Domain/x": 1}), "not a DNS subdomain"),
        (_device("gpu-0", notes="x" * 65), 'attribute "notes"'),
        (_device("gpu-0", cc=Version("9.0")), "not a valid semver version"),
        (_device("gpu-0", **{f"a{i}": i for i in range(32)}), "more than 32 attributes"),
        (_device("GPU_0"), 'device "GPU_0": name is not a DNS label'),
    ],
)
def test_invalid_devices_are_rejected(device: Device, message: str) -> None:
    with pytest.raises(SliceValidationError, match=message):
        _build([device])


def test_too_many_taints_and_bad_taints() -> None:
    with pytest.raises(SliceValidationError, match='device "gpu-0": more than 16 taints'):
        _build(_devices(1), taints={"gpu-0": [UNHEALTHY] * 17})
    bad = Taint(key="bad key", effect=TaintEffect.NO_EXECUTE)
    with pytest.raises(SliceValidationError, match='taint "bad key"'):
        _build(_devices(1), taints={"gpu-0": [bad]})
    with pytest.raises(SliceValidationError, match="unknown devices: gpu-9"):
        _build(_devices(1), taints={"gpu-9": [UNHEALTHY]})


def test_duplicate_device_names_are_rejected() -> None:
    with pytest.raises(SliceValidationError, match="more than once: gpu-0"):
        _build([_device("gpu-0"), _device("gpu-0")])


def test_validate_slice_catches_hand_made_mistakes() -> None:
    (obj,) = _build(_devices(2))
    both = copy.deepcopy(obj)
    both["spec"]["sharedCounters"] = [{"name": "c", "counters": {"m": {"value": "1"}}}]
    with pytest.raises(SliceValidationError, match="either devices or sharedCounters"):
        validate_slice(both)
    too_many = copy.deepcopy(obj)
    too_many["spec"]["devices"] = [{"name": f"d-{i}"} for i in range(129)]
    with pytest.raises(SliceValidationError, match="129 devices, more than 128"):
        validate_slice(too_many)
    two_ways = copy.deepcopy(obj)
    two_ways["spec"]["allNodes"] = True
    with pytest.raises(SliceValidationError, match="exactly one of nodeName"):
        validate_slice(two_ways)
    bad_value = copy.deepcopy(obj)
    bad_value["spec"]["devices"][0]["attributes"]["type"] = {"string": "gpu", "int": 1}
    with pytest.raises(SliceValidationError, match="exactly one of int, bool, string, version"):
        validate_slice(bad_value)
    bad_quantity = copy.deepcopy(obj)
    bad_quantity["spec"]["devices"][0]["capacity"]["memory"] = {"value": "lots"}
    with pytest.raises(SliceValidationError, match='capacity "memory"'):
        validate_slice(bad_quantity)


def test_slice_names_stay_valid_and_distinct() -> None:
    assert slice_name(pool="Node_A", driver=DRIVER, index=3) == "node-a-gpu-drasil-dev-3"
    long_a = slice_name(pool="a" * 300 + "x", driver=DRIVER, index=12)
    long_b = slice_name(pool="a" * 300 + "y", driver=DRIVER, index=12)
    for name in (long_a, long_b):
        assert len(name) <= 253
        assert is_dns_subdomain(name)
        assert name.endswith("-12")
    assert long_a != long_b


def test_natural_key() -> None:
    names = ["gpu-10", "gpu-2", "gpu-1-mig-1g5gb-10-0", "gpu-1-mig-1g5gb-9-0", "gpu-1"]
    assert sorted(names, key=natural_key) == [
        "gpu-1",
        "gpu-1-mig-1g5gb-9-0",
        "gpu-1-mig-1g5gb-10-0",
        "gpu-2",
        "gpu-10",
    ]


# -- planning -----------------------------------------------------------------------


class _Server:
    """Stores slices the way the API server does: uid, resourceVersion, server-side
    defaults and canonical quantities, and checks the planner's preconditions."""

    def __init__(self) -> None:
        self.objects: dict[str, JsonDict] = {}
        self._versions = itertools.count(1)
        self.writes = 0

    def _stored(self, body: Mapping[str, Any], uid: str) -> JsonDict:
        obj = copy.deepcopy(dict(body))
        obj["metadata"].update(uid=uid, resourceVersion=str(next(self._versions)))
        for device in obj["spec"].get("devices") or []:
            for taint in device.get("taints", []):
                taint.setdefault("timeAdded", "2026-01-01T00:00:00Z")
        if obj["spec"].get("devices") == []:
            del obj["spec"]["devices"]  # omitempty
        return obj

    def apply(self, plan: PublishPlan) -> None:
        for body in plan.creates:
            name = body["metadata"]["name"]
            assert name not in self.objects
            self.objects[name] = self._stored(body, uid=f"uid-{name}-{next(self._versions)}")
        for body in plan.updates:
            old = self.objects[body["metadata"]["name"]]
            assert body["metadata"]["resourceVersion"] == old["metadata"]["resourceVersion"]
            self.objects[body["metadata"]["name"]] = self._stored(body, uid=old["metadata"]["uid"])
        for deletion in plan.deletes:
            old = self.objects.pop(deletion.name)
            assert old["metadata"]["uid"] == deletion.uid
            assert old["metadata"]["resourceVersion"] == deletion.resource_version
        self.writes += plan.writes

    def list(self) -> list[JsonDict]:
        return copy.deepcopy(list(self.objects.values()))

    def publish(self, desired: list[JsonDict]) -> PublishPlan:
        plan = plan_publish(desired=desired, existing=self.list())
        self.apply(plan)
        return plan


def _generations(server: _Server) -> set[tuple[int, int]]:
    return {
        (s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"])
        for s in server.list()
    }


def test_first_publish_creates_everything() -> None:
    server = _Server()
    plan = server.publish(_build(_devices(200)))
    assert plan.generation == 1
    assert (len(plan.creates), len(plan.updates), len(plan.deletes)) == (2, 0, 0)
    assert _generations(server) == {(1, 2)}


def test_unchanged_pool_means_zero_writes() -> None:
    server = _Server()
    devices = _devices(200)
    server.publish(_build(devices, taints={"gpu-3": [UNHEALTHY]}))
    plan = server.publish(_build(devices, taints={"gpu-3": [UNHEALTHY]}))
    assert plan.empty
    assert plan.writes == 0
    assert plan.generation == 1


def test_canonical_quantities_and_defaults_do_not_count_as_changes() -> None:
    server = _Server()
    desired = _build([_device("gpu-0")], counter_sets=[CounterSet(name="c", counters={"n": 1000})])
    server.publish(desired)
    for obj in server.objects.values():
        for counter_set in obj["spec"].get("sharedCounters", []):
            counter_set["counters"]["n"]["value"] = "1k"  # how the server canonicalises 1000
    assert plan_publish(desired=desired, existing=server.list()).empty
    changed = _build([_device("gpu-0")], counter_sets=[CounterSet(name="c", counters={"n": 999})])
    assert plan_publish(desired=changed, existing=server.list()).writes == 2


def test_growing_bumps_generation_and_creates() -> None:
    server = _Server()
    server.publish(_build(_devices(100)))
    plan = server.publish(_build(_devices(200)))
    assert plan.generation == 2
    assert (len(plan.creates), len(plan.updates), len(plan.deletes)) == (1, 1, 0)
    assert _generations(server) == {(2, 2)}


def test_shrinking_bumps_generation_and_deletes_with_preconditions() -> None:
    server = _Server()
    server.publish(_build(_devices(200)))
    surplus = server.objects["node-a-gpu-drasil-dev-1"]["metadata"]
    plan = server.publish(_build(_devices(100)))
    assert plan.generation == 2
    assert (len(plan.creates), len(plan.updates), len(plan.deletes)) == (0, 1, 1)
    (deletion,) = plan.deletes
    assert (deletion.name, deletion.uid, deletion.resource_version) == (
        "node-a-gpu-drasil-dev-1",
        surplus["uid"],
        surplus["resourceVersion"],
    )
    assert _generations(server) == {(2, 1)}


def test_any_change_rewrites_every_slice_of_the_pool() -> None:
    server = _Server()
    devices = _devices(200)
    server.publish(_build(devices))
    plan = server.publish(_build(devices, taints={"gpu-0": [UNHEALTHY]}))
    # gpu-0's slice now holds at most 64 devices, so the pool has three slices.
    assert (len(plan.creates), len(plan.updates), len(plan.deletes)) == (1, 2, 0)
    assert _generations(server) == {(2, 3)}
    assert server.publish(_build(devices, taints={"gpu-0": [UNHEALTHY]})).empty


def test_half_finished_publish_is_completed_under_a_new_generation() -> None:
    server = _Server()
    server.publish(_build(_devices(200)))
    server.objects["node-a-gpu-drasil-dev-0"]["spec"]["pool"]["generation"] = 7
    plan = server.publish(_build(_devices(200)))
    assert plan.generation == 8
    assert len(plan.updates) == 2
    assert _generations(server) == {(8, 2)}


def test_removing_the_pool_deletes_everything() -> None:
    server = _Server()
    server.publish(_build(_devices(200)))
    plan = server.publish([])
    assert len(plan.deletes) == 2
    assert server.objects == {}


def test_one_pool_at_a_time() -> None:
    with pytest.raises(ValueError, match="one pool at a time"):
        plan_publish(desired=_build(_devices(1)), existing=_build(_devices(1), pool="node-b"))


def _consuming(count: int, counters: int) -> tuple[list[Device], list[CounterSet]]:
    """``count`` devices consuming ``counters`` counters each, over two counter sets."""
    names = [f"c-{i}" for i in range(counters)]
    halves = {"set-a": names[: counters // 2], "set-b": names[counters // 2 :]}
    counter_sets = [CounterSet(n, dict.fromkeys(part, 1000)) for n, part in halves.items()]
    uses = tuple(CounterConsumption(n, dict.fromkeys(part, 1)) for n, part in halves.items())
    devices = [replace(_device(f"gpu-{i}"), consumes_counters=uses) for i in range(count)]
    return devices, counter_sets


def test_slices_keep_to_2048_consumed_counters() -> None:
    devices, counter_sets = _consuming(64, 32)  # 64 * 32 = 2048: one slice
    assert _sizes(_validated(_build(devices, counter_sets=counter_sets))) == [0, 64]
    devices, counter_sets = _consuming(64, 33)  # 62 * 33 = 2046, and 2 more
    assert _sizes(_validated(_build(devices, counter_sets=counter_sets))) == [0, 62, 2]


def test_validation_rejects_a_slice_consuming_too_many_counters() -> None:
    devices, counter_sets = _consuming(64, 32)
    device_slice = copy.deepcopy(_build(devices, counter_sets=counter_sets)[1])
    device_slice["spec"]["devices"][0]["consumesCounters"][0]["counters"]["c-32"] = {"value": "1"}
    with pytest.raises(SliceValidationError, match="consume 2049 counters, more than 2048"):
        validate_slice(device_slice)

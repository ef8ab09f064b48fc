"""The read-only views of object metadata and ResourceClaims (drasil.driver.objects)."""

from __future__ import annotations

from typing import Any

import pytest

from drasil.driver.objects import (
    Consumer,
    DeviceClass,
    ObjectMeta,
    Pod,
    ResourceClaim,
    ResourceSlice,
    condition,
    is_true,
    meta,
    status_of,
)

DRIVER = "gpu.drasil.dev"
OTHER = "net.example.com"


def _result(driver: str, device: str, **extra: Any) -> dict[str, Any]:
    return {"request": "gpu", "driver": driver, "pool": "node-a", "device": device, **extra}


def _claim() -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": "team",
            "name": "train",
            "uid": "uid-1",
            "generation": 3,
            "resourceVersion": "42",
            "labels": {"app": "train"},
            "annotations": {"note": "x"},
        },
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"count": 1}}]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [_result(DRIVER, "gpu-0"), _result(OTHER, "nic-0")],
                    "config": [],
                },
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": []}]},
                "allocationTimestamp": "2025-01-02T03:04:05Z",
            },
            "reservedFor": [
                {"resource": "pods", "name": "train-0", "uid": "pod-uid"},
                {"apiGroup": "batch", "resource": "jobs", "name": "train", "uid": "job-uid"},
            ],
            "devices": [{"driver": DRIVER, "pool": "node-a", "device": "gpu-0"}],
        },
    }


def test_well_formed_claim() -> None:
    claim = ResourceClaim(_claim())
    assert claim.meta == ObjectMeta(
        namespace="team",
        name="train",
        uid="uid-1",
        generation=3,
        resource_version="42",
        labels={"app": "train"},
        annotations={"note": "x"},
    )
    assert claim.meta.ref == "team/train"
    assert [r["name"] for r in claim.requests] == ["gpu"]
    assert claim.allocated
    assert claim.allocation is not None
    assert claim.allocation_timestamp == "2025-01-02T03:04:05Z"
    assert claim.node_selector == {"nodeSelectorTerms": [{"matchFields": []}]}
    assert [d["device"] for d in claim.devices] == ["gpu-0"]


def test_the_view_keeps_the_json_as_given() -> None:
    obj = _claim()
    claim = ResourceClaim(obj)
    assert claim.obj is obj
    assert claim.results()[0] is obj["status"]["allocation"]["devices"]["results"][0]


def test_results_of_two_drivers() -> None:
    claim = ResourceClaim(_claim())
    assert [r["device"] for r in claim.results()] == ["gpu-0", "nic-0"]
    assert [r["device"] for r in claim.results(DRIVER)] == ["gpu-0"]
    assert [r["device"] for r in claim.results(OTHER)] == ["nic-0"]
    assert claim.results("none.example.com") == ()


def test_reserved_for_with_a_consumer_that_is_not_a_pod() -> None:
    pod, job = ResourceClaim(_claim()).reserved_for
    assert pod == Consumer(api_group="", resource="pods", name="train-0", uid="pod-uid")
    assert pod.is_pod
    assert job.name == "train"
    assert job.api_group == "batch"
    assert not job.is_pod
    # A core-group name on another group is not a Pod either.
    assert not Consumer(api_group="example.com", resource="pods", name="p", uid="").is_pod


def test_unallocated_claim() -> None:
    obj = _claim()
    del obj["status"]
    claim = ResourceClaim(obj)
    assert claim.allocation is None
    assert not claim.allocated
    assert claim.results() == ()
    assert claim.results(DRIVER) == ()
    assert claim.node_selector == {}
    assert claim.allocation_timestamp == ""
    assert claim.reserved_for == ()
    assert claim.devices == ()
    assert claim.meta.name == "train"


def test_an_empty_allocation_is_not_allocated() -> None:
    # The scheduler never writes one; the callers always treated {} as absent.
    claim = ResourceClaim({"status": {"allocation": {}}})
    assert claim.allocation == {}
    assert not claim.allocated


def _nothing_allocated(claim: ResourceClaim) -> None:
    assert claim.results() == ()
    assert claim.results(DRIVER) == ()
    assert claim.node_selector == {}
    assert claim.allocation_timestamp == ""
    assert claim.reserved_for == ()
    assert claim.devices == ()


@pytest.mark.parametrize(
    "status",
    [
        None,
        "allocated",
        7,
        ["allocation"],
        {"allocation": "yes", "reservedFor": "pods", "devices": {"gpu-0": {}}},
    ],
)
def test_garbage_status_reads_as_absent(status: object) -> None:
    claim = ResourceClaim({"metadata": {"name": "c"}, "status": status})
    assert not claim.allocated
    _nothing_allocated(claim)


@pytest.mark.parametrize(
    "status",
    [
        {"allocation": {"devices": "all", "nodeSelector": [], "allocationTimestamp": 5}},
        {"allocation": {"devices": {"results": {"0": {}}}}},
        {"allocation": {"devices": None}, "reservedFor": [None, "pod", 3], "devices": [1]},
    ],
)
def test_garbage_inside_an_allocation_reads_as_absent(status: object) -> None:
    # Still allocated (a non-empty allocation), as the callers always read it.
    claim = ResourceClaim({"metadata": {"name": "c"}, "status": status})
    assert claim.allocated
    _nothing_allocated(claim)


def test_garbage_entries_in_lists_are_left_out() -> None:
    obj = _claim()
    status = obj["status"]
    status["allocation"]["devices"]["results"].insert(0, "gpu-9")
    status["reservedFor"].append(None)
    status["devices"].append(["x"])
    obj["spec"]["devices"]["requests"].append(3)
    claim = ResourceClaim(obj)
    assert [r["device"] for r in claim.results()] == ["gpu-0", "nic-0"]
    assert len(claim.reserved_for) == 2
    assert len(claim.devices) == 1
    assert len(claim.requests) == 1


@pytest.mark.parametrize(
    "metadata",
    [
        None,
        "team/train",
        {"name": 5, "namespace": ["a"], "uid": None, "generation": "3"},
        {"generation": True, "labels": "app=x", "annotations": [1]},
    ],
)
def test_garbage_metadata_reads_as_empty(metadata: object) -> None:
    assert meta({"metadata": metadata}) == ObjectMeta()
    assert ResourceClaim({"metadata": metadata, "spec": "x"}).requests == ()


def test_meta_of_any_object() -> None:
    pod = {
        "metadata": {"namespace": "ns", "name": "p", "deletionTimestamp": "2025-01-01T00:00:00Z"}
    }
    assert meta(pod).deletion_timestamp == "2025-01-01T00:00:00Z"
    assert meta({}) == ObjectMeta()


def test_conditions_read_as_written_and_garbage_left_out() -> None:
    entry = {
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "R", "lastTransitionTime": "t"},
            "garbage",
            {"type": "Attached", "status": 1},
        ]
    }

    assert is_true(entry, "Ready")
    assert not is_true(entry, "Attached")  # a status that is not a string is no "True"
    assert not is_true(None, "Ready")
    ready = condition(entry, "Ready")
    assert ready is not None
    assert (ready.reason, ready.last_transition_time) == ("R", "t")
    assert condition({"conditions": "x"}, "Ready") is None


def test_a_pod_view_reads_scheduling_and_claims() -> None:
    pod = Pod(
        {
            "spec": {"nodeName": "n1", "resourceClaims": [{"name": "g"}, 3]},
            "status": {
                "phase": "Running",
                "resourceClaimStatuses": [{"name": "g", "resourceClaimName": "p-g-x"}],
                "conditions": [{"type": "Ready", "status": "False", "message": "m"}],
            },
        }
    )

    assert (pod.node_name, pod.phase) == ("n1", "Running")
    assert pod.resource_claims == ({"name": "g"},)
    assert pod.claim_statuses[0]["resourceClaimName"] == "p-g-x"
    assert [c.message for c in pod.conditions] == ["m"]
    assert Pod({"status": []}).phase == ""


def test_slice_and_class_views() -> None:
    obj = {"spec": {"driver": "d", "pool": {"name": "p"}, "nodeName": "n", "devices": [{}, 1]}}
    view = ResourceSlice(obj)
    assert (view.driver, view.pool, view.node_name, len(view.devices)) == ("d", "p", "n", 1)
    assert ResourceSlice({"spec": "garbage"}).pool == ""

    cls = DeviceClass({"spec": {"selectors": [{"cel": {"expression": "e"}}, {}], "config": [{}]}})
    assert cls.expressions == ("e", "")
    assert len(cls.config) == 1
    assert status_of({"status": "x"}) == {}

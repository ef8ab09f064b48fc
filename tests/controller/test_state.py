"""The in-memory view of the cluster: Pods reduced to their claims, indexes, filters."""

from __future__ import annotations

import copy
from typing import Any

from drasil.controller.state import (
    ClusterView,
    KeptClaim,
    PodRef,
    SharedValues,
    UidIndex,
    kept_claim,
    without_managed_fields,
)

DRIVER = "gpu.drasil.dev"
OUR_CLASS = {
    "metadata": {"name": "gpu.drasil.dev"},
    "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
}
OTHER_CLASS = {
    "metadata": {"name": "nic"},
    "spec": {"selectors": [{"cel": {"expression": 'device.driver == "nic.example.com"'}}]},
}


def pod(
    name: str,
    *,
    claims: list[str] = (),  # type: ignore[assignment]
    templates: list[str] = (),  # type: ignore[assignment]
    generated: list[str] = (),  # type: ignore[assignment]
    node: str | None = None,
    phase: str = "Pending",
) -> dict[str, Any]:
    entries = [{"name": c, "resourceClaimName": c} for c in claims]
    entries += [{"name": t, "resourceClaimTemplateName": t} for t in templates]
    return {
        "metadata": {"namespace": "ml", "name": name, "uid": f"uid-{name}"},
        "spec": {"resourceClaims": entries, **({"nodeName": node} if node else {})},
        "status": {
            "phase": phase,
            "resourceClaimStatuses": [{"name": "x", "resourceClaimName": g} for g in generated],
        },
    }


def claim(name: str, cls: str = "gpu.drasil.dev", **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ml", "name": name, "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": cls}}]}},
        "status": status,
    }


def test_pod_ref_reads_claims_templates_and_generated_claims() -> None:
    ref = PodRef.of(pod("p", claims=["shared"], templates=["t"], generated=["p-t-abc"]))

    assert ref is not None
    assert ref.claims == ("p-t-abc", "shared")  # sorted tuples: smaller than sets
    assert ref.direct == ("shared",)
    assert ref.templates == ("t",)
    assert ref.waiting
    assert ref.ref().kind == "Pod"


def test_pod_ref_waiting_and_pods_without_claims() -> None:
    assert PodRef.of({"metadata": {"name": "plain"}, "spec": {}}) is None
    bound = PodRef.of(pod("p", claims=["c"], node="n1"))
    assert bound is not None
    assert not bound.waiting
    done = PodRef.of(pod("p", claims=["c"], phase="Failed"))
    assert done is not None
    assert not done.waiting


def test_pods_are_indexed_by_claim_and_template_and_unindexed_on_change() -> None:
    view = ClusterView(driver=DRIVER)
    view.put_pod(pod("a", claims=["c1"], templates=["t"]))
    view.put_pod(pod("b", templates=["t2"], generated=["c1"]))

    assert [p.name for p in view.pods_using("ResourceClaim", ("ml", "c1"))] == ["a", "b"]
    assert [p.name for p in view.pods_using("ResourceClaimTemplate", ("ml", "t"))] == ["a"]

    view.put_pod(pod("a", claims=["c2"]))
    assert [p.name for p in view.pods_using("ResourceClaim", ("ml", "c1"))] == ["b"]
    assert view.pods_using("ResourceClaimTemplate", ("ml", "t")) == []

    view.drop_pod(pod("b"))
    assert view.pods_using("ResourceClaim", ("ml", "c1")) == []


def test_unallocated_claims_are_those_of_the_drivers_classes() -> None:
    view = ClusterView(driver=DRIVER)
    view.put_class(OUR_CLASS)
    view.put_class(OTHER_CLASS)
    view.put_claim(claim("pending"))
    view.put_claim(claim("other", cls="nic"))
    view.put_claim(claim("done", allocation={"devices": {"results": []}}))
    view.put_claim(
        {**claim("going"), "metadata": {**claim("going")["metadata"], "deletionTimestamp": "x"}}
    )

    assert view.unallocated_claims() == [("uid-pending", ("ml", "pending"))]

    view.drop_class(OUR_CLASS)
    assert view.unallocated_claims() == []
    view.put_class(OUR_CLASS)
    view.put_claim(claim("pending", allocation={"devices": {"results": []}}))
    assert view.unallocated_claims() == []


def test_a_claim_is_kept_as_what_the_controller_reads_of_it() -> None:
    ours: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": "node-a"}
    ours |= {"device": "gpu-0", "bindingConditions": ["drasil.dev/Attached"]}
    theirs = {"request": "nic", "driver": "nic.example.com", "pool": "node-a", "device": "nic-0"}
    selector = {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name"}]}]}
    allocation = {
        "devices": {"results": [ours, theirs], "config": [{"opaque": {"big": "x" * 1000}}]},
        "nodeSelector": selector,
        "allocationTimestamp": "2026-11-26T10:00:00Z",
    }
    obj = claim("held", allocation=allocation) | {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
    }
    obj["metadata"] |= {"managedFields": [{"manager": "kube-scheduler"}], "labels": {"a": "b"}}
    obj["status"] |= {
        "reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}],
        "devices": [{**ours, "conditions": []}, {**theirs, "conditions": []}],
    }

    kept = kept_claim(obj, driver=DRIVER)

    assert kept == {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "held", "namespace": "ml", "uid": "uid-held"},
        "status": {
            "allocation": {
                "devices": {"results": [ours]},
                "nodeSelector": selector,
                "allocationTimestamp": "2026-11-26T10:00:00Z",
            },
            "devices": [{**ours, "conditions": []}],
        },
    }


def test_objects_are_kept_without_managed_fields() -> None:
    obj = {"metadata": {"name": "s", "managedFields": [{"manager": "x"}]}, "spec": {}}

    assert without_managed_fields(obj) == {"metadata": {"name": "s"}, "spec": {}}
    assert obj["metadata"]["managedFields"]  # the event's object is not changed


def test_where_and_when_are_kept_for_attaches_alone() -> None:
    allocation = {
        "devices": {"results": [{"driver": DRIVER, "pool": "node-a", "device": "gpu-0"}]},
        "nodeSelector": {"nodeSelectorTerms": []},
        "allocationTimestamp": "2026-11-26T10:00:00Z",
    }

    kept = kept_claim(claim("held", allocation=allocation), driver=DRIVER)

    assert set(kept["status"]["allocation"]) == {"devices"}


def gpu_slice(node: str) -> dict[str, Any]:
    def device(i: int) -> dict[str, Any]:
        attributes = {
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
            "index": {"int": i},
            "uuid": {"string": f"GPU-{node}-{i}"},
            "healthy": {"bool": True},
        }
        return {
            "name": f"gpu-{i}",
            "attributes": attributes,
            "capacity": {"memory": {"value": "80Gi"}},
        }

    spec = {"driver": DRIVER, "pool": {"name": node}, "devices": [device(0), device(1)]}
    return {"metadata": {"name": f"{node}-slice"}, "spec": spec}


def test_equal_device_values_of_slices_are_one_object() -> None:
    view = ClusterView(driver=DRIVER)
    a, b = gpu_slice("a"), gpu_slice("b")
    event = copy.deepcopy(a)
    view.put_slice(a)
    view.put_slice(b)

    kept_a, kept_b = view.explain_snapshot().slices
    assert kept_a == a
    assert kept_b == b
    assert a == event
    devices_a, devices_b = kept_a["spec"]["devices"], kept_b["spec"]["devices"]
    for name in ("productName", "healthy"):
        shared = devices_a[0]["attributes"][name]
        assert devices_a[1]["attributes"][name] is shared
        assert devices_b[0]["attributes"][name] is shared
    assert devices_a[1]["attributes"]["index"] is devices_b[1]["attributes"]["index"]
    assert devices_a[0]["attributes"]["uuid"] is not devices_b[0]["attributes"]["uuid"]
    assert devices_a[0]["capacity"]["memory"] is devices_b[1]["capacity"]["memory"]


def test_shared_values_keep_types_apart_and_bound_the_table() -> None:
    shared = SharedValues()
    one, true = shared.value({"int": 1}), shared.value({"int": True})

    assert one == {"int": 1}
    assert true == {"int": True}
    assert one is not true
    nested = {"list": [1]}
    assert shared.value(nested) is nested  # not a scalar: not shared
    assert shared.value({"a": 1, "b": 2}) == {"a": 1, "b": 2}

    shared.MAX = 2
    shared.value({"int": 2})
    assert len(shared) == 1  # full at 2: started over


def test_slices_of_other_drivers_are_not_kept() -> None:
    view = ClusterView(driver=DRIVER)
    view.put_slice({"metadata": {"name": "a"}, "spec": {"driver": DRIVER}})
    view.put_slice({"metadata": {"name": "b"}, "spec": {"driver": "nic.example.com"}})

    assert [s["metadata"]["name"] for s in view.explain_snapshot().slices] == ["a"]
    view.drop_slice({"metadata": {"name": "a"}})
    assert view.explain_snapshot().slices == []


def test_published_pools_and_claims_allocated_from_them() -> None:
    view = ClusterView(driver=DRIVER)
    view.put_pool({"metadata": {"name": "rack-a"}, "spec": {}})
    view.put_pool({"metadata": {"name": "rack-b"}, "spec": {"driver": "other.example.com"}})
    result = {"driver": DRIVER, "pool": "rack-a", "device": "d", "request": "r"}
    view.put_claim(claim("user", allocation={"devices": {"results": [result]}}))
    view.put_claim(claim("idle"))

    assert view.published_pools() == {"rack-a"}
    assert [c["metadata"]["name"] for c in view.claims_allocated_from("rack-a")] == ["user"]


def test_equal_capacities_are_one_object_and_keys_are_interned() -> None:
    view = ClusterView(driver=DRIVER)
    view.put_slice(gpu_slice("a"))
    odd = gpu_slice("b")
    odd["spec"]["devices"][0]["capacity"] = {"memory": {"value": "80Gi", "policy": {}}}
    view.put_slice(odd)

    kept_a, kept_b = view.explain_snapshot().slices
    devices_a, devices_b = kept_a["spec"]["devices"], kept_b["spec"]["devices"]
    assert devices_a[0]["capacity"] is devices_a[1]["capacity"]
    assert devices_a[0]["capacity"] is devices_b[1]["capacity"]
    assert devices_b[0]["capacity"] == {"memory": {"value": "80Gi", "policy": {}}}  # not shared
    [name_a] = [k for k in devices_a[0]["attributes"] if k == "productName"]
    [name_b] = [k for k in devices_b[1]["attributes"] if k == "productName"]
    assert name_a is name_b


def test_a_kept_claim_is_compact_and_gives_its_json_back() -> None:
    result = {"request": "gpu", "driver": DRIVER, "pool": "rack-a", "device": "d"}
    obj = claim("user", allocation={"devices": {"results": [result]}})
    obj["metadata"]["deletionTimestamp"] = "2026-11-26T10:00:00Z"
    kept = KeptClaim.of(obj, driver=DRIVER)

    assert kept.json() == kept_claim(obj, driver=DRIVER)
    assert kept.json()["metadata"]["deletionTimestamp"] == "2026-11-26T10:00:00Z"
    assert kept.ref == "ml/user"
    assert kept.holds_from(DRIVER, "rack-a")
    assert not kept.holds_from(DRIVER, "rack-b")
    assert not kept.holds_from("other.example.com", "rack-a")
    assert "status" not in KeptClaim.of(claim("idle"), driver=DRIVER).json()


def test_the_view_gives_claims_as_json_and_holdings_from_results() -> None:
    view = ClusterView(driver=DRIVER)
    result = {"request": "gpu", "driver": DRIVER, "pool": "rack-a", "device": "d"}
    held = claim("user", allocation={"devices": {"results": [result]}})
    view.put_claim(held)
    view.put_claim(claim("idle"))

    assert view.claim(("ml", "user")) == kept_claim(held, driver=DRIVER)
    assert view.claim(("ml", "gone")) is None
    assert view.holdings() == [("ml/user", (result,))]
    assert len(view.explain_snapshot().claims) == 2
    assert view.explain_snapshot(claims=False).claims == []


def test_a_claim_name_is_one_object_for_the_claim_and_its_pod() -> None:
    def parsed() -> str:  # a new str each time, as each watch event parses its own
        return "".join(["p-gpu-", "abc"])

    assert parsed() is not parsed()
    ref = PodRef.of(pod("p", templates=["t"], generated=[parsed()]))

    assert ref is not None
    [name] = ref.claims
    assert KeptClaim.of(claim(parsed()), driver=DRIVER).name is name


def test_the_uid_index_keeps_one_uid_bare_and_more_in_a_set() -> None:
    index = UidIndex()
    key = ("ml", "shared")

    assert index.get(key) == ()
    index.add(key, "u1")
    index.add(key, "u1")
    assert index.get(key) == ("u1",)
    index.add(key, "u2")
    index.add(key, "u3")
    assert sorted(index.get(key)) == ["u1", "u2", "u3"]
    index.discard(key, "u2")
    index.discard(key, "u3")
    assert index.get(key) == ("u1",)
    index.discard(key, "other")
    assert index.get(key) == ("u1",)
    index.discard(key, "u1")
    assert index.get(key) == ()
    assert len(index) == 0


def test_pod_ref_is_answered_once_the_scheduler_refused_it_or_it_is_in_a_group() -> None:
    """Only queued: no PodScheduled condition. Answered: PodScheduled False (tried and
    unschedulable, or gated), or a Pod of a PodGroup (gangs wait without a condition)."""
    queued = pod("q", claims=["c"])
    refused = pod("r", claims=["c"])
    refused["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    ]
    member = pod("m", claims=["c"])
    member["spec"]["schedulingGroup"] = {"podGroupName": "train"}
    other = pod("o", claims=["c"])
    other["status"]["conditions"] = [{"type": "Initialized", "status": "False"}]

    answered = {n: PodRef.of(p) for n, p in [("q", queued), ("r", refused), ("m", member)]}
    assert {n: r.answered for n, r in answered.items() if r} == {"q": False, "r": True, "m": True}
    other_ref = PodRef.of(other)
    assert other_ref is not None
    assert not other_ref.answered

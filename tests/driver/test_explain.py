"""Pending-claim explanations: counts per stage, the failing selector, taints, holders."""

from __future__ import annotations

from typing import Any

import pytest

from drasil.driver.explain.claims import ClaimExplanation, explain_claim, render_table
from drasil.driver.explain.inventory import build_inventory, is_driver_class, request_classes

DRIVER = "gpu.drasil.dev"
H200 = f'device.attributes["{DRIVER}"].productName == "NVIDIA H200"'
GPU_CLASS = {
    "metadata": {"name": DRIVER},
    "spec": {
        "selectors": [{"cel": {"expression": f'device.attributes["{DRIVER}"].type == "gpu"'}}]
    },
}
OTHER_CLASS = {
    "metadata": {"name": "nic.example.com"},
    "spec": {"selectors": [{"cel": {"expression": 'device.driver == "nic.example.com"'}}]},
}


def device(name: str, product: str = "NVIDIA H100", **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {
            "type": {"string": "gpu"},
            "productName": {"string": product},
            "index": {"int": int(name.rsplit("-", maxsplit=1)[-1])},
        },
        "capacity": {"memory": {"value": "80Gi"}},
        **extra,
    }


def resource_slice(
    pool: str,
    devices: list[dict[str, Any]],
    *,
    generation: int = 1,
    count: int = 1,
    driver: str = DRIVER,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"{pool}-{generation}-{len(devices)}",
            "uid": f"uid-{pool}-{generation}",
        },
        "spec": {
            "driver": driver,
            "pool": {"name": pool, "generation": generation, "resourceSliceCount": count},
            "nodeName": pool,
            "devices": devices,
        },
    }


def claim(
    name: str,
    requests: list[dict[str, Any]],
    *,
    namespace: str = "default",
    results: list[dict[str, Any]] | None = None,
    constraints: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": requests, "constraints": constraints or []}},
    }
    if results is not None:
        obj["status"] = {"allocation": {"devices": {"results": results}}}
    return obj


def exactly(name: str = "gpu", *selectors: str, **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"deviceClassName": DRIVER, **extra}
    if selectors:
        spec["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    return {"name": name, "exactly": spec}


def held(pool: str, *devices: str, request: str = "gpu", **extra: Any) -> list[dict[str, Any]]:
    return [
        {"request": request, "driver": DRIVER, "pool": pool, "device": d, **extra} for d in devices
    ]


def explain(
    target: dict[str, Any],
    slices: list[dict[str, Any]],
    others: list[dict[str, Any]] = (),
    classes: list[dict[str, Any]] | None = None,
) -> ClaimExplanation:  # type: ignore[assignment]
    return explain_claim(
        target,
        slices=slices,
        claims=[target, *others],
        classes=classes if classes is not None else [GPU_CLASS, OTHER_CLASS],
        driver=DRIVER,
    )


def sixteen_with_two_h200() -> list[dict[str, Any]]:
    devices = [device(f"gpu-{i}", "NVIDIA H200" if i < 2 else "NVIDIA H100") for i in range(8)]
    more = [device(f"gpu-{i}") for i in range(8)]
    return [resource_slice("node-a", devices), resource_slice("node-b", more)]


def test_the_issue_example_names_counts_selector_and_holder() -> None:
    train = claim("train-0", [exactly()], results=held("node-a", "gpu-0", "gpu-1"))
    pending = claim("job", [exactly("gpu", H200)])

    result = explain(pending, sixteen_with_two_h200(), [train])

    assert result.unsatisfiable
    assert result.message() == (
        'request "gpu": 16 devices of gpu.drasil.dev; 16 pass class gpu.drasil.dev; '
        f"2 pass selector {H200}; both allocated to default/train-0"
    )


def test_a_selector_that_matches_nothing_is_named_and_ends_the_funnel() -> None:
    wanted = f'device.attributes["{DRIVER}"].productName == "NVIDIA B200"'
    pending = claim("job", [exactly("gpu", H200, wanted)])

    result = explain(pending, sixteen_with_two_h200())

    assert result.message() == (
        'request "gpu": 16 devices of gpu.drasil.dev; 16 pass class gpu.drasil.dev; '
        f"2 pass selector {H200}; 0 pass selector {wanted}"
    )
    stages = result.requests[0].stages
    assert [s.count for s in stages] == [16, 16, 2, 0]


def test_a_missing_attribute_is_a_cel_error_like_the_scheduler_reports() -> None:
    pending = claim("job", [exactly("gpu", f'device.attributes["{DRIVER}"].numaNode == 0')])

    result = explain(pending, sixteen_with_two_h200())

    last = result.requests[0].stages[-1]
    assert last.count == 0
    assert last.note.startswith("CEL error on 16 devices: no such key: numaNode")
    assert "has() macro" in result.message()


def test_one_device_reads_in_the_singular() -> None:
    pending = claim("job", [exactly("gpu", H200, count=3)])
    slices = [resource_slice("node-a", [device("gpu-0", "NVIDIA H200"), device("gpu-1")])]

    text = explain(pending, slices).message()

    assert "1 passes selector" in text
    assert text.endswith("1 free, 3 needed")


def test_taints_that_block_are_named_and_tolerations_let_devices_through() -> None:
    taint = {"key": "gpu.drasil.dev/xid", "value": "79", "effect": "NoSchedule"}
    slices = [
        resource_slice("node-a", [device("gpu-0", taints=[taint]), device("gpu-1", taints=[taint])])
    ]

    blocked = explain(claim("job", [exactly()]), slices)
    assert blocked.message().endswith("2 blocked by taint gpu.drasil.dev/xid=79:NoSchedule")

    toleration = {"key": "gpu.drasil.dev/xid", "operator": "Exists"}
    tolerant = explain(claim("job", [exactly(tolerations=[toleration])]), slices)
    assert not tolerant.unsatisfiable


def test_a_taint_with_effect_none_does_not_block() -> None:
    taint = {"key": "note", "effect": "None"}
    slices = [resource_slice("node-a", [device("gpu-0", taints=[taint])])]

    assert not explain(claim("job", [exactly()]), slices).unsatisfiable


def test_holders_are_listed_with_counts_when_some_devices_are_free() -> None:
    a = claim("a", [exactly()], namespace="ml", results=held("node-a", "gpu-0", "gpu-1"))
    b = claim("b", [exactly()], namespace="ml", results=held("node-a", "gpu-2"))
    slices = [resource_slice("node-a", [device(f"gpu-{i}") for i in range(4)])]

    result = explain(claim("job", [exactly(count=2)]), slices, [a, b])

    assert result.requests[0].held == {"ml/a": 2, "ml/b": 1}
    assert result.message().endswith("3 allocated to ml/a, ml/b; 1 free, 2 needed")


def test_admin_access_may_use_devices_in_use() -> None:
    a = claim("a", [exactly()], results=held("node-a", "gpu-0"))
    slices = [resource_slice("node-a", [device("gpu-0")])]

    assert explain(claim("job", [exactly()]), slices, [a]).unsatisfiable
    assert not explain(claim("job", [exactly(adminAccess=True)]), slices, [a]).unsatisfiable


def test_admin_access_results_hold_nothing() -> None:
    watcher = claim("watch", [exactly()], results=held("node-a", "gpu-0", adminAccess=True))
    slices = [resource_slice("node-a", [device("gpu-0")])]

    assert not explain(claim("job", [exactly()]), slices, [watcher]).unsatisfiable


def test_allocation_mode_all_needs_every_matching_device_free() -> None:
    a = claim("a", [exactly()], results=held("node-a", "gpu-1"))
    slices = [resource_slice("node-a", [device("gpu-0"), device("gpu-1")])]

    result = explain(claim("job", [exactly(allocationMode="All")]), slices, [a])

    assert result.unsatisfiable
    assert result.message().endswith(
        "1 allocated to default/a; 1 free, all 2 needed (allocationMode All)"
    )


def test_first_available_is_satisfiable_when_one_alternative_is() -> None:
    request = {
        "name": "gpu",
        "firstAvailable": [
            {
                "name": "h200",
                "deviceClassName": DRIVER,
                "selectors": [{"cel": {"expression": H200}}],
                "count": 4,
            },
            {"name": "any", "deviceClassName": DRIVER},
        ],
    }

    result = explain(claim("job", [request]), sixteen_with_two_h200())

    assert [e.request for e in result.requests] == ["gpu/h200", "gpu/any"]
    assert result.requests[0].problem
    assert result.requests[1].problem is None
    assert not result.unsatisfiable


def test_first_available_failing_everywhere_reports_every_alternative() -> None:
    request = {
        "name": "gpu",
        "firstAvailable": [
            {"name": "a", "deviceClassName": DRIVER, "count": 9},
            {"name": "b", "deviceClassName": DRIVER, "count": 10},
        ],
    }
    slices = [resource_slice("node-a", [device(f"gpu-{i}") for i in range(8)])]

    text = explain(claim("job", [request]), slices).message()

    assert text == (
        'request "gpu": alternative "a": 8 free, 9 needed; alternative "b": 8 free, 10 needed'
    )


def test_requests_that_fit_alone_but_not_together() -> None:
    slices = [resource_slice("node-a", [device("gpu-0")])]

    result = explain(claim("job", [exactly("one"), exactly("two")]), slices)

    assert all(e.problem is None for e in result.requests)
    assert result.problems == (
        "requests one, two need 2 distinct devices together; the devices they may use cover only 1",
    )


def test_match_attribute_that_cannot_hold() -> None:
    slices = [
        resource_slice("node-a", [device("gpu-0", "NVIDIA H200"), device("gpu-1", "NVIDIA H100")])
    ]
    constraint = {"requests": ["one", "two"], "matchAttribute": f"{DRIVER}/productName"}
    both = claim("job", [exactly("one"), exactly("two")], constraints=[constraint])

    result = explain(both, slices)

    assert len(result.problems) == 1
    assert result.problems[0].startswith(
        f"constraint matchAttribute {DRIVER}/productName on requests one, two cannot hold"
    )


def test_match_attribute_that_holds() -> None:
    slices = [resource_slice("node-a", [device(f"gpu-{i}", "NVIDIA H200") for i in range(2)])]
    constraint = {"matchAttribute": f"{DRIVER}/productName"}

    result = explain(
        claim("job", [exactly("one"), exactly("two")], constraints=[constraint]), slices
    )

    assert not result.unsatisfiable


def test_distinct_attribute_that_cannot_hold() -> None:
    slices = [resource_slice("node-a", [device(f"gpu-{i}", "NVIDIA H200") for i in range(2)])]
    constraint = {"distinctAttribute": f"{DRIVER}/productName"}

    result = explain(
        claim("job", [exactly("one"), exactly("two")], constraints=[constraint]), slices
    )

    assert result.problems
    assert "distinctAttribute" in result.problems[0]


def test_shared_devices_count_the_capacity_other_claims_left() -> None:
    shared = device("gpu-0", allowMultipleAllocations=True)
    slices = [resource_slice("node-a", [shared])]
    used = held("node-a", "gpu-0", shareID="s1", consumedCapacity={"memory": "60Gi"})
    other = claim("other", [exactly()], results=used)

    fits = explain(
        claim("job", [exactly(capacity={"requests": {"memory": "20Gi"}})]), slices, [other]
    )
    too_big = explain(
        claim("job", [exactly(capacity={"requests": {"memory": "30Gi"}})]), slices, [other]
    )

    assert not fits.unsatisfiable
    assert too_big.unsatisfiable
    assert "gpu-0 has 20Gi of memory left; request needs 30Gi" in too_big.message()


def test_only_the_newest_complete_generation_of_a_pool_counts() -> None:
    old = resource_slice("node-a", [device("gpu-0")], generation=1)
    half = resource_slice("node-b", [device("gpu-1")], generation=2, count=2)
    new = resource_slice("node-a", [device("gpu-5"), device("gpu-6")], generation=2)
    other_driver = resource_slice("node-c", [device("gpu-9")], driver="nic.example.com")

    inventory = build_inventory([old, half, new, other_driver], driver=DRIVER)

    assert [d.name for d in inventory.devices] == ["gpu-5", "gpu-6"]
    assert inventory.incomplete_pools == ("node-b (1 of 2 slices)",)
    message = explain(claim("job", [exactly(count=3)]), [old, half, new]).message()
    assert "pool node-b (1 of 2 slices) is incomplete and not used" in message


def test_no_devices_at_all() -> None:
    result = explain(claim("job", [exactly()]), [])

    assert result.message() == 'request "gpu": 0 devices of gpu.drasil.dev'


def test_a_missing_class_is_reported() -> None:
    result = explain(claim("job", [exactly()]), sixteen_with_two_h200(), classes=[])

    assert result.unsatisfiable
    assert "0 pass class gpu.drasil.dev (DeviceClass not found)" in result.message()


def test_a_class_that_rules_out_every_device_names_its_selector() -> None:
    mig_only = {
        "metadata": {"name": DRIVER},
        "spec": {
            "selectors": [{"cel": {"expression": f'device.attributes["{DRIVER}"].type == "mig"'}}]
        },
    }

    result = explain(
        claim("job", [exactly("gpu", H200)]), sixteen_with_two_h200(), classes=[mig_only]
    )

    assert result.requests[0].stages[-1].count == 0
    assert "none passes" in result.message()
    assert "pass selector" not in result.message()


def test_a_whole_gpu_class_on_a_node_of_amd_partitions_says_what_is_published() -> None:
    partitions = [
        {
            "name": f"amdgpu-1-cpx-{i}",
            "attributes": {
                "type": {"string": "amdgpu-partition"},
                "computePartition": {"string": "CPX"},
            },
        }
        for i in range(8)
    ]
    slices = [resource_slice("node-a", [*partitions, device("gpu-0")])]
    amd_class = {
        "metadata": {"name": "amdgpu.drasil.dev"},
        "spec": {
            "selectors": [
                {"cel": {"expression": f'device.attributes["{DRIVER}"].type == "amdgpu"'}}
            ]
        },
    }
    request = {"name": "gpu", "exactly": {"deviceClassName": "amdgpu.drasil.dev"}}

    result = explain(claim("job", [request]), slices, classes=[amd_class])

    assert result.message().endswith(
        '0 pass class amdgpu.drasil.dev (none passes device.attributes["gpu.drasil.dev"]'
        '.type == "amdgpu"; published are 8 amdgpu-partition (compute partition CPX) and 1 gpu)'
    )


def test_a_partition_class_on_whole_amd_gpus_names_their_mode() -> None:
    whole = {
        "name": "amdgpu-1",
        "attributes": {"type": {"string": "amdgpu"}, "computePartition": {"string": "SPX"}},
    }
    slices = [resource_slice("node-a", [whole])]
    expression = f'device.attributes["{DRIVER}"].type == "amdgpu-partition"'
    partition_class = {
        "metadata": {"name": "amdgpu-partition.drasil.dev"},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }
    request = {"name": "part", "exactly": {"deviceClassName": "amdgpu-partition.drasil.dev"}}

    result = explain(claim("job", [request]), slices, classes=[partition_class])

    assert result.message().endswith("published are 1 amdgpu (compute partition SPX))")


def test_requests_of_other_drivers_are_left_out() -> None:
    nic = {"name": "nic", "exactly": {"deviceClassName": "nic.example.com"}}

    result = explain(claim("job", [nic]), sixteen_with_two_h200())

    assert result.requests == ()
    assert not result.unsatisfiable


def test_a_satisfiable_claim_says_so() -> None:
    result = explain(claim("job", [exactly()]), sixteen_with_two_h200())

    assert not result.unsatisfiable
    assert "can be satisfied" in result.message()


def test_render_table_lists_each_stage() -> None:
    train = claim("train-0", [exactly()], results=held("node-a", "gpu-0", "gpu-1"))

    table = render_table(
        explain(claim("job", [exactly("gpu", H200)]), sixteen_with_two_h200(), [train])
    )

    lines = table.splitlines()
    assert lines[0] == "claim default/job (driver gpu.drasil.dev)"
    assert lines[1].split() == ["REQUEST", "DEVICES", "STAGE"]
    assert lines[2].split() == ["gpu", "16", "devices", "of", "gpu.drasil.dev"]
    assert "allocated to default/train-0" in table
    assert lines[-1].startswith('request "gpu": 16 devices')


@pytest.mark.parametrize(
    ("device_class", "ours"),
    [
        (GPU_CLASS, True),
        (OTHER_CLASS, False),
        ({"spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]}}, True),
        ({"spec": {"config": [{"opaque": {"driver": DRIVER, "parameters": {}}}]}}, True),
        ({"spec": {}}, False),
    ],
)
def test_is_driver_class(device_class: dict[str, Any], ours: bool) -> None:
    assert is_driver_class(device_class, DRIVER) is ours


def test_request_classes_include_subrequests() -> None:
    spec = {
        "devices": {
            "requests": [
                {"name": "a", "exactly": {"deviceClassName": "x"}},
                {"name": "b", "firstAvailable": [{"name": "c", "deviceClassName": "y"}]},
            ]
        }
    }
    assert request_classes(spec) == {"x", "y"}


def test_free_devices_spread_over_nodes_do_not_make_one_claim() -> None:
    slices = [
        resource_slice("node-a", [device("gpu-0"), device("gpu-1")]),
        resource_slice("node-b", [device("gpu-0")]),
    ]
    busy = claim("train", [exactly()], results=held("node-a", "gpu-0"))

    result = explain(claim("job", [exactly(count=2)]), slices, [busy])

    assert result.requests[0].problem is None  # two free devices in the cluster
    assert result.unsatisfiable
    assert result.problems == (
        "a claim's devices must all be reachable from the one node its Pod runs on, and no "
        "node has enough: free devices on 2 nodes; node node-a comes closest with 1 of the 2 "
        "needed",
    )
    assert result.problems[0] in render_table(result)


def test_one_node_with_enough_free_devices_satisfies_the_claim() -> None:
    slices = [
        resource_slice("node-a", [device("gpu-0")]),
        resource_slice("node-b", [device("gpu-0"), device("gpu-1")]),
    ]

    result = explain(claim("job", [exactly(count=2)]), slices)

    assert not result.unsatisfiable
    assert result.problems == ()


def test_two_requests_must_be_served_on_the_same_node() -> None:
    slices = [
        resource_slice("node-a", [device("gpu-0")]),
        resource_slice("node-b", [device("gpu-0", "NVIDIA H200")]),
    ]

    result = explain(claim("job", [exactly("any"), exactly("h200", H200)]), slices)

    assert [e.problem for e in result.requests] == [None, None]
    assert len(result.problems) == 1
    assert "node node-a comes closest with 1 of the 2 needed" in result.problems[0]


def test_devices_of_all_nodes_count_on_every_node() -> None:
    shared = resource_slice("fabric", [device("gpu-9")])
    del shared["spec"]["nodeName"]
    shared["spec"]["allNodes"] = True
    slices = [resource_slice("node-a", [device("gpu-0")]), shared]

    result = explain(claim("job", [exactly(count=2)]), slices)

    assert not result.unsatisfiable


def cluster_node(name: str, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def waiting_pod(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "trainer", "namespace": "default"}, "spec": spec}


def explain_for(
    target: dict[str, Any], slices: list[dict[str, Any]], nodes: list[dict[str, Any]], **pod: Any
) -> ClaimExplanation:
    """Explain ``target`` for one waiting Pod with ``pod`` as its spec, on ``nodes``."""
    return explain_claim(
        target,
        slices=slices,
        claims=[],
        classes=[GPU_CLASS],
        driver=DRIVER,
        nodes=nodes,
        pods=[waiting_pod(**pod)],
    )


def test_the_pods_node_selector_rules_out_the_node_with_free_devices() -> None:
    slices = [resource_slice("node-a", [device("gpu-0")])]
    nodes = [cluster_node("node-a", {"gpu": "h100"}), cluster_node("node-b", {"gpu": "h200"})]

    result = explain_for(claim("job", [exactly()]), slices, nodes, nodeSelector={"gpu": "h200"})

    assert result.problems == (
        "the Pod's node constraints rule out every node with free devices: "
        "node-a (nodeSelector gpu=h200)",
    )


def test_nodes_the_pod_may_not_use_are_named_beside_the_closest_one() -> None:
    slices = [
        resource_slice("node-a", [device("gpu-0")]),
        resource_slice("node-b", [device("gpu-0"), device("gpu-1")]),
    ]
    taint = {"key": "maintenance", "effect": "NoSchedule"}
    nodes = [cluster_node("node-a"), cluster_node("node-b", taints=[taint])]

    result = explain_for(claim("job", [exactly(count=2)]), slices, nodes)

    assert result.problems == (
        "a claim's devices must all be reachable from the one node its Pod runs on, and no "
        "node has enough: free devices on 2 nodes; node node-a comes closest with 1 of the 2 "
        "needed; the Pod may not use node-b (taint maintenance:NoSchedule)",
    )


def test_a_tolerating_pod_may_use_the_tainted_node() -> None:
    slices = [resource_slice("node-b", [device("gpu-0"), device("gpu-1")])]
    nodes = [cluster_node("node-b", taints=[{"key": "gpu", "effect": "NoSchedule"}])]
    tolerations = [{"key": "gpu", "operator": "Exists"}]

    result = explain_for(claim("job", [exactly(count=2)]), slices, nodes, tolerations=tolerations)

    assert not result.unsatisfiable


def test_devices_of_all_nodes_need_a_node_the_pod_fits() -> None:
    shared = resource_slice("fabric", [device("gpu-9")])
    del shared["spec"]["nodeName"]
    shared["spec"]["allNodes"] = True

    result = explain_for(
        claim("job", [exactly()]), [shared], [cluster_node("node-a", unschedulable=True)]
    )

    assert result.problems == ("no node fits the Pod: node-a (cordoned: spec.unschedulable)",)


def _costly_selector() -> str:
    # 32 attributes, three nested exists: 32,768 iterations per device.
    attributes = f'device.attributes["{DRIVER}"]'
    body = "v0 == 'none'"
    for level in range(3):
        body = f"{attributes}.exists(v{level}, {body})"
    return body


def _wide(name: str) -> dict[str, Any]:
    extra = {f"a{i}": {"int": i} for i in range(29)}
    wide = device(name)
    wide["attributes"] |= extra
    return wide


def test_a_costly_selector_stops_the_explanation_at_its_budget() -> None:
    slices = [resource_slice("node-a", [_wide(f"gpu-{i}") for i in range(64)])]
    target = claim("costly", [exactly("gpu", _costly_selector())])

    result = explain_claim(
        target, slices=slices, claims=[target], classes=[GPU_CLASS], driver=DRIVER, budget=0.2
    )

    assert result.cut_short.startswith('request "gpu": stopped after 0.2 s: selector ')
    assert result.cut_short.endswith(
        "is too costly to evaluate against 64 devices (the scheduler pays this cost too)"
    )
    assert not result.unsatisfiable
    assert result.summary() == f"could not explain claim default/costly: {result.cut_short}"


def test_a_failing_request_is_reported_with_the_one_cut_short() -> None:
    slices = [resource_slice("node-a", [_wide(f"gpu-{i}") for i in range(64)])]
    target = claim(
        "two",
        [
            exactly("missing", 'device.attributes["gpu.drasil.dev"].productName == "B200"'),
            exactly("costly", _costly_selector()),
        ],
    )

    result = explain_claim(
        target, slices=slices, claims=[target], classes=[GPU_CLASS], driver=DRIVER, budget=0.2
    )

    assert result.unsatisfiable
    message = result.message()
    assert message.startswith('request "missing": ')
    assert 'then the explanation request "costly": stopped after 0.2 s' in message

"""The PodGroups of a pending claim's waiting Pods (drasil.driver.explain.groups)."""

from __future__ import annotations

from typing import Any

from drasil.driver.explain.groups import gang_message, group_waits, pod_groups, with_groups


def _pod(name: str, group: str = "", namespace: str = "ml") -> dict[str, Any]:
    spec: dict[str, Any] = {"schedulingGroup": {"podGroupName": group}} if group else {}
    return {"metadata": {"name": name, "namespace": namespace}, "spec": spec}


def _group(min_count: int | None) -> dict[str, Any]:
    policy = {"gang": {"minCount": min_count}} if min_count is not None else {"basic": {}}
    return {"spec": {"schedulingPolicy": policy}}


def test_the_groups_of_the_pods_once_each() -> None:
    pods = [_pod("a", "train"), _pod("b", "train"), _pod("c"), _pod("d", "train", "other")]
    assert pod_groups(pods) == [("ml", "train"), ("other", "train")]


def test_a_gang_short_of_its_min_count_is_what_the_claim_waits_for() -> None:
    waits = group_waits({("ml", "train"): _group(4)}, {("ml", "train"): 3})
    message = gang_message(waits)
    assert message is not None
    assert message.startswith("devices exist for every request, but kube-scheduler places ")
    assert "PodGroup ml/train (a gang of minCount 4; 3 of its Pods exist)" in message
    assert message.endswith("create the missing Pods or lower minCount")


def test_complete_gangs_basic_groups_and_missing_groups_are_only_named() -> None:
    waits = group_waits(
        {("ml", "full"): _group(2), ("ml", "basic"): _group(None), ("ml", "gone"): None},
        {("ml", "full"): 2, ("ml", "basic"): 1},
    )
    assert gang_message(waits) is None
    assert with_groups("no device fits.", waits) == (
        "no device fits. (Pods in PodGroup ml/basic; PodGroup ml/full (a gang of minCount 2; "
        "2 of its Pods exist); PodGroup ml/gone (not found))"
    )
    assert with_groups("no device fits.", []) == "no device fits."


def test_a_min_count_that_is_no_integer_is_no_gang() -> None:
    [wait] = group_waits(
        {("ml", "x"): {"spec": {"schedulingPolicy": {"gang": {"minCount": "3"}}}}}, {}
    )
    assert wait.min_count is None
    assert not wait.incomplete

"""Which nodes a Pod may go to: nodeName, nodeSelector, node affinity, taints, cordons."""

from __future__ import annotations

from typing import Any

import pytest

from drasil.driver.explain.nodefit import misfit, term_matches, tolerated


def node(name: str, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def pod(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"containers": [], **spec}}


def affinity(*terms: dict[str, Any]) -> dict[str, Any]:
    required = {"nodeSelectorTerms": list(terms)}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}


def expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    return {"matchExpressions": [{"key": key, "operator": operator, "values": list(values)}]}


GPU_NODE = node("gpu-1", {"gpu": "h100", "rack": "a", "cores": "64"})


def test_a_plain_pod_fits_any_node() -> None:
    assert misfit(pod(), GPU_NODE) is None


def test_node_name_and_node_selector() -> None:
    assert misfit(pod(nodeName="gpu-2"), GPU_NODE) == "the Pod is bound to node gpu-2"
    assert misfit(pod(nodeName="gpu-1"), GPU_NODE) is None
    assert misfit(pod(nodeSelector={"gpu": "h200"}), GPU_NODE) == "nodeSelector gpu=h200"
    assert misfit(pod(nodeSelector={"gpu": "h100", "rack": "a"}), GPU_NODE) is None


@pytest.mark.parametrize(
    ("term", "matches"),
    [
        (expr("gpu", "In", "h100", "h200"), True),
        (expr("gpu", "In", "l4"), False),
        (expr("gpu", "NotIn", "l4"), True),
        (expr("zone", "NotIn", "x"), True),
        (expr("rack", "Exists"), True),
        (expr("zone", "Exists"), False),
        (expr("zone", "DoesNotExist"), True),
        (expr("cores", "Gt", "32"), True),
        (expr("cores", "Lt", "32"), False),
        (expr("gpu", "Gt", "1"), False),  # not an integer
        ({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-1"]}]}, True),
        ({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["x"]}]}, False),
        ({}, False),  # an empty term matches no node
    ],
)
def test_node_selector_terms(term: dict[str, Any], matches: bool) -> None:
    assert term_matches(term, GPU_NODE) is matches


def test_required_affinity_terms_are_ored() -> None:
    either = affinity(expr("gpu", "In", "l4"), expr("rack", "In", "a"))
    assert misfit(pod(affinity=either), GPU_NODE) is None
    neither = affinity(expr("gpu", "In", "l4"), expr("rack", "In", "b"))
    assert misfit(pod(affinity=neither), GPU_NODE) == "required node affinity"


def test_taints_need_tolerations() -> None:
    tainted = node("gpu-1", taints=[{"key": "gpu", "value": "broken", "effect": "NoSchedule"}])
    assert misfit(pod(), tainted) == "taint gpu=broken:NoSchedule"
    exists = [{"key": "gpu", "operator": "Exists"}]
    assert misfit(pod(tolerations=exists), tainted) is None
    soft = node("gpu-1", taints=[{"key": "gpu", "effect": "PreferNoSchedule"}])
    assert misfit(pod(), soft) is None


def test_a_cordoned_node_takes_only_pods_that_tolerate_it() -> None:
    cordoned = node("gpu-1", unschedulable=True)
    assert misfit(pod(), cordoned) == "cordoned: spec.unschedulable"
    tolerate = [{"key": "node.kubernetes.io/unschedulable", "operator": "Exists"}]
    assert misfit(pod(tolerations=tolerate), cordoned) is None


def test_toleration_matching() -> None:
    taint = {"key": "k", "value": "v", "effect": "NoExecute"}
    assert tolerated(taint, [{"key": "k", "operator": "Equal", "value": "v"}])
    assert not tolerated(taint, [{"key": "k", "operator": "Equal", "value": "w"}])
    assert not tolerated(taint, [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}])
    assert tolerated(taint, [{"operator": "Exists"}])

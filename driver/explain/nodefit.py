"""Which nodes a Pod may go to, as kube-scheduler's node filters decide it: the part a
pending claim's explanation needs.

A claim is allocated for the node its Pod is scheduled to, so free devices on a node
the Pod cannot use do not help it. Checked here, in the scheduler's terms:
``spec.nodeName``, ``spec.nodeSelector``, required node affinity (``In``, ``NotIn``,
``Exists``, ``DoesNotExist``, ``Gt``, ``Lt``; ``matchFields`` on ``metadata.name``),
the node's ``NoSchedule``/``NoExecute`` taints against the Pod's tolerations, and
``spec.unschedulable``. Not checked: resources other than devices, pod (anti-)affinity
and topology spread. Pure functions over the API server's JSON.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from drasil.driver.objects import JsonObject

BLOCKING_EFFECTS: Final = frozenset({"NoSchedule", "NoExecute"})
# What kubelet's node controller turns spec.unschedulable into (the scheduler checks it
# the same way: a Pod tolerating this taint may go to a cordoned node).
UNSCHEDULABLE_TAINT: Final = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}


def tolerated(taint: JsonObject, tolerations: Sequence[JsonObject]) -> bool:
    """Whether one of ``tolerations`` tolerates ``taint`` (core/v1 semantics)."""
    for toleration in tolerations:
        effect = toleration.get("effect")
        if effect and effect != taint.get("effect"):
            continue
        key = toleration.get("key")
        if toleration.get("operator") == "Exists":
            if not key or key == taint.get("key"):
                return True
        elif key == taint.get("key") and (toleration.get("value") or "") == (
            taint.get("value") or ""
        ):
            return True
    return False


def taint_text(taint: JsonObject) -> str:
    value = f"={taint['value']}" if taint.get("value") else ""
    return f"{taint.get('key')}{value}:{taint.get('effect')}"


def node_name(node: JsonObject) -> str:
    return str((node.get("metadata") or {}).get("name", ""))


def misfit(pod: JsonObject, node: JsonObject) -> str | None:
    """Why ``pod`` cannot go to ``node``, as a short phrase; None when it may."""
    spec = pod.get("spec") or {}
    name = node_name(node)
    bound = spec.get("nodeName")
    if bound and bound != name:
        return f"the Pod is bound to node {bound}"
    labels = (node.get("metadata") or {}).get("labels") or {}
    for key, value in sorted((spec.get("nodeSelector") or {}).items()):
        if labels.get(key) != value:
            return f"nodeSelector {key}={value}"
    if not _affinity_matches(spec, node):
        return "required node affinity"
    tolerations = spec.get("tolerations") or []
    node_spec = node.get("spec") or {}
    if node_spec.get("unschedulable") and not tolerated(UNSCHEDULABLE_TAINT, tolerations):
        return "cordoned: spec.unschedulable"
    for taint in node_spec.get("taints") or []:
        if taint.get("effect") in BLOCKING_EFFECTS and not tolerated(taint, tolerations):
            return f"taint {taint_text(taint)}"
    return None


def _affinity_matches(spec: JsonObject, node: JsonObject) -> bool:
    affinity = (spec.get("affinity") or {}).get("nodeAffinity") or {}
    required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = required.get("nodeSelectorTerms")
    if terms is None:
        return True
    # The terms are ORed; an empty list or an empty term matches no node.
    return any(term_matches(term, node) for term in terms)


def term_matches(term: JsonObject, node: JsonObject) -> bool:
    """One NodeSelectorTerm: every expression and field requirement holds."""
    expressions = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not expressions and not fields:
        return False
    labels = (node.get("metadata") or {}).get("labels") or {}
    if not all(_requirement_holds(r, labels) for r in expressions):
        return False
    names = {"metadata.name": node_name(node)}
    return all(_requirement_holds(r, names) for r in fields)


def _requirement_holds(requirement: JsonObject, values: Mapping[str, str]) -> bool:
    key = str(requirement.get("key", ""))
    operator = str(requirement.get("operator", ""))
    wanted = [str(v) for v in requirement.get("values") or []]
    present = key in values
    value = values.get(key, "")
    checks = {
        "In": lambda: present and value in wanted,
        "NotIn": lambda: not present or value not in wanted,
        "Exists": lambda: present,
        "DoesNotExist": lambda: not present,
        "Gt": lambda: _compare(value, wanted, present, greater=True),
        "Lt": lambda: _compare(value, wanted, present, greater=False),
    }
    check = checks.get(operator)
    return bool(check()) if check is not None else False


def _compare(value: str, wanted: Sequence[str], present: bool, *, greater: bool) -> bool:
    """Gt/Lt: the label and the one value are integers."""
    if not present or len(wanted) != 1:
        return False
    try:
        have, bound = int(value), int(wanted[0])
    except ValueError:
        return False
    return have > bound if greater else have < bound

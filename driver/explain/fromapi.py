"""``drasil explain``: the inputs of an explanation read from the API server."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from drasil.driver.explain.claims import ClaimExplanation, explain_claim
from drasil.driver.kubeapi import ApiError, KubeApi
from drasil.driver.objects import JsonObject, Pod


@dataclass(frozen=True)
class ExplainInputs:
    """What ``explain_claim`` reads, fetched from the API server."""

    claim: JsonObject
    slices: Sequence[JsonObject]
    claims: Sequence[JsonObject]
    classes: Sequence[JsonObject]
    nodes: Sequence[JsonObject] | None = None  # None: not allowed to list them
    pods: Sequence[JsonObject] = ()  # the Pods waiting for the claim
    taint_rules: Sequence[JsonObject] = ()  # DeviceTaintRules


class ClaimNotFound(LookupError):
    """The claim to explain does not exist."""


def _list(api: KubeApi, plural: str, *, field_selector: str = "") -> list[JsonObject]:
    return list(api.list_resources(plural, field_selector=field_selector))


def list_taint_rules(api: KubeApi) -> list[JsonObject]:
    """The DeviceTaintRules, or none when this user may not list them or the cluster
    does not serve them (resource.k8s.io/v1 has them from 1.37): the explanation
    then leaves them out, as it leaves out Nodes it may not read."""
    try:
        return _list(api, "devicetaintrules")
    except ApiError as err:
        if err.status in (403, 404):
            return []
        raise


def fetch_inputs(api: KubeApi, *, namespace: str, name: str, driver: str) -> ExplainInputs:
    """Read the claim, the driver's slices, all claims, DeviceClasses and
    DeviceTaintRules."""
    claim = api.get_claim(namespace, name)
    if claim is None:
        raise ClaimNotFound(f"ResourceClaim {namespace}/{name} not found")
    return ExplainInputs(
        claim=claim,
        slices=_list(api, "resourceslices", field_selector=f"spec.driver={driver}"),
        claims=_list(api, "resourceclaims"),
        classes=_list(api, "deviceclasses"),
        nodes=api.list_nodes(),
        pods=[p for p in unbound_pods(api, namespace) if waits_for(p, name)],
        taint_rules=list_taint_rules(api),
    )


# Only a Pod without a node can wait for a claim (``waits_for``): the API server filters
# by this field selector, so a namespace of thousands of running Pods costs no more than
# the few that wait (docs/scale.md).
UNBOUND = "spec.nodeName="


def unbound_pods(api: KubeApi, namespace: str) -> list[JsonObject]:
    """The namespace's Pods not yet bound to a node; none when this identity may not
    list Pods (the explanation then leaves out their node constraints)."""
    return list(api.list_pods(namespace, field_selector=UNBOUND) or [])


def waits_for(pod: JsonObject, claim_name: str) -> bool:
    """Whether ``pod`` is not yet scheduled and uses the claim ``claim_name``."""
    view = Pod(pod)
    if view.node_name:
        return False
    entries = [*view.resource_claims, *view.claim_statuses]
    return any(e.get("resourceClaimName") == claim_name for e in entries)


def explain_from_api(api: KubeApi, *, namespace: str, name: str, driver: str) -> ClaimExplanation:
    """``drasil explain``: fetch and explain one claim; raises ``ClaimNotFound``."""
    return explain_fetched(
        fetch_inputs(api, namespace=namespace, name=name, driver=driver), driver=driver
    )


def explain_fetched(inputs: ExplainInputs, *, driver: str) -> ClaimExplanation:
    """Explain what ``fetch_inputs`` read (the two halves are timed apart in bench.scale)."""
    return explain_claim(
        inputs.claim,
        slices=inputs.slices,
        claims=inputs.claims,
        classes=inputs.classes,
        driver=driver,
        nodes=inputs.nodes,
        pods=inputs.pods,
        taint_rules=inputs.taint_rules,
    )

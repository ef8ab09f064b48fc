"""Gang-scheduled PodGroups with a group claim, on the real node.

``scheduling.k8s.io/v1beta1`` PodGroups (feature gates ``GenericWorkload``, which
turns on kube-scheduler's gang scheduling, and ``DRAWorkloadResourceClaims``) may
hold ResourceClaims for the whole group: the control plane makes one claim from the
group's template, reserves it for the PodGroup rather than for each Pod, and every
member Pod that names the same claim gets its devices. The node's plugin is asked to
prepare that claim once per Pod; it prepares it once and answers the others from its
checkpoint. A gang that cannot be placed leaves every member Pending, and drasil's
controller (under the chart's RBAC) says in a ``GangIncomplete`` Event that the wait is
the gang's, naming the group.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.harness.chart import chart_controller
from e2e.harness.cluster.node import Node
from e2e.harness.controllerproc import ControllerProcess
from e2e.harness.kube import RESOURCE, Kube, NotYet, wait_for
from e2e.harness.pluginproc import DRIVER
from e2e.harness.pods import (
    cdi_spec,
    checkpoint,
    container_env,
    drain_namespace,
    pod,
    template,
    visible_uuids,
    wait_running,
)
from e2e.test_controller import wait_event

GROUP_API = "scheduling.k8s.io/v1beta1"


@pytest.fixture(scope="module")
def controller(
    kube: Kube, kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControllerProcess]:
    """drasil-controller for the node's driver, explaining its pending claims."""
    with chart_controller(
        kube,
        kubeconfig,
        release=f"pg-{secrets.token_hex(3)}",
        driver=DRIVER,
        directory=tmp_path_factory.mktemp("controller"),
    ) as proc:
        yield proc


@pytest.fixture
def groups(kube: Kube, ns: str, node: Node) -> Iterator[list[str]]:
    """The test's PodGroups, deleted after its Pods (whose claims the node unprepares
    first), so that the group's claim, reserved for the group, can go too."""
    made: list[str] = []
    yield made
    drain_namespace(kube, node, ns)
    for name in made:
        kube.delete(GROUP_API, "PodGroup", name, ns)


def _group(
    groups: list[str], kube: Kube, namespace: str, name: str, *, min_count: int, template: str
) -> None:
    groups.append(name)
    kube.create(
        {
            "apiVersion": GROUP_API,
            "kind": "PodGroup",
            "metadata": {"name": name},
            "spec": {
                "schedulingPolicy": {"gang": {"minCount": min_count}},
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
            },
        },
        namespace,
    )


def _member(kube: Kube, namespace: str, node: Node, group: str, claim_template: str) -> str:
    """A Pod of the group on the node, naming the group's claim exactly as the group does."""
    name = f"{group}-{secrets.token_hex(3)}"
    return pod(kube, namespace, node, template_name=claim_template, name=name, pod_group=group)


def _group_claim(kube: Kube, namespace: str, group: str) -> Any:
    """The claim the control plane made for the group, once allocated."""
    status = kube.get(GROUP_API, "PodGroup", group, namespace).get("status") or {}
    names = [s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or []]
    if not names or not names[0]:
        return NotYet(status)
    claim = kube.get(RESOURCE, "ResourceClaim", names[0], namespace)
    return claim if (claim.get("status") or {}).get("allocation") else NotYet(claim)


def test_a_group_claim_is_prepared_once_for_every_pod_of_the_group(
    kube: Kube, ns: str, node: Node, groups: list[str]
) -> None:
    claim_template = template(kube, ns)
    _group(groups, kube, ns, "train", min_count=2, template=claim_template)
    members = [_member(kube, ns, node, "train", claim_template) for _ in range(2)]
    for name in members:
        wait_running(kube, ns, name)
    seen = [visible_uuids(container_env(kube, ns, name)) for name in members]
    assert len(seen[0]) == 1, seen
    assert seen[0] == seen[1], "both Pods of the group see the group's one GPU"

    claim = wait_for(lambda: _group_claim(kube, ns, "train"), timeout=60, what="the group claim")
    consumers = [(r.get("resource"), r.get("name")) for r in claim["status"]["reservedFor"]]
    assert consumers == [("podgroups", "train")], "reserved for the group, not for each Pod"
    uid = claim["metadata"]["uid"]
    held = {u: c for u, c in checkpoint(node).items() if c.get("namespace") == ns}
    assert list(held) == [uid], held
    assert cdi_spec(node, uid).is_file()


def test_a_gang_that_cannot_be_placed_starts_none_of_its_pods(
    kube: Kube, ns: str, node: Node, groups: list[str], controller: ControllerProcess
) -> None:
    """minCount 3 with two members: the scheduler admits none, so the group's claim is
    not allocated and the node prepares nothing; the third member lets the whole gang
    start, all three on the group's one GPU."""
    claim_template = template(kube, ns)
    _group(groups, kube, ns, "gang", min_count=3, template=claim_template)
    members = [_member(kube, ns, node, "gang", claim_template) for _ in range(2)]

    def claimed() -> Any:
        # The group's claim exists and both members name it: the control plane has
        # seen them; kube-scheduler holds them before their scheduling cycle.
        pods = [kube.get("v1", "Pod", name, ns) for name in members]
        named = [(p.get("status") or {}).get("resourceClaimStatuses") for p in pods]
        return named if all(named) else NotYet(named)

    named = wait_for(claimed, timeout=60, what="both members to name the group's claim")
    assert not [p for p in members if kube.get("v1", "Pod", p, ns)["spec"].get("nodeName")]
    claims = kube.resource(RESOURCE, "ResourceClaim").get(namespace=ns).items
    assert [c.metadata.name for c in claims if (c.status or {}).get("allocation")] == []
    assert not [c for c in checkpoint(node).values() if c.get("namespace") == ns]
    claim = kube.get(RESOURCE, "ResourceClaim", named[0][0]["resourceClaimName"], ns)
    event = wait_event(kube, ns, claim["metadata"]["uid"], "GangIncomplete", timeout=60)
    assert f"PodGroup {ns}/gang (a gang of minCount 3; 2 of its Pods exist)" in event.message
    members.append(_member(kube, ns, node, "gang", claim_template))
    for name in members:
        wait_running(kube, ns, name)
    seen = {tuple(visible_uuids(container_env(kube, ns, name))) for name in members}
    assert len(seen) == 1, seen

"""The scale benchmark's path, small (docs/scale.md): 20 KWOK nodes, 100 Pods.

One run of ``bench.scale.run_fleet`` on a cluster of its own (``up --fake-nodes 20``),
4 GPUs a node. 80 Pods with one-GPU claims in two waves, drasil's class and a minimal
one, fill every GPU; then 20 Pods the full fleet cannot serve, an explain, one health
flip, a short idle window. The tests check what a user of a fleet relies on, not how
fast it went.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from bench.scale import Params, PodTimes, allocation_problems, run_fleet
from drasil.driver.slices.validate import validate_slice
from e2e.harness.cluster.control_plane import Cluster
from e2e.harness.cluster.fleet import DRIVER, fleet_nodes, published_slices
from e2e.harness.kube import Kube

NODES = 20
GPUS = 4  # per node: the 4 Pods per node fill the fleet, so the probes must wait
PARAMS = Params(
    nodes=NODES,
    profile=f"h100-80gb:{GPUS}",
    pods_per_node=GPUS,
    probes=20,
    idle_minutes=0.25,
    explain_runs=1,
)


@dataclass
class Seen:
    """What the checks inside the run saw while the cluster was up."""

    slices: list[dict[str, Any]] = field(default_factory=list)
    node_uids: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    bound: dict[str, str] = field(default_factory=dict)


@pytest.fixture(scope="module")
def run() -> tuple[dict[str, Any], Seen]:
    seen = Seen()

    def inspect(cluster: Cluster, times: PodTimes) -> None:
        kube = Kube(cluster.kubeconfig)
        seen.slices = published_slices(kube)
        seen.node_uids = {n["metadata"]["name"]: n["metadata"]["uid"] for n in fleet_nodes(kube)}
        seen.problems = allocation_problems(kube, times)
        seen.bound = dict(times.nodes)

    # run_fleet takes its cluster down again, also when it fails.
    return run_fleet(PARAMS, inspect=inspect), seen


def test_every_pod_is_scheduled_on_a_fleet_node(run: tuple[dict[str, Any], Seen]) -> None:
    result, seen = run
    fleet_pods = NODES * PARAMS.pods_per_node
    assert result["pods"] == fleet_pods + PARAMS.burst
    assert result["scheduling"]["drasil"]["pods"] == fleet_pods // 2
    assert result["scheduling"]["minimal"]["pods"] == fleet_pods // 2
    assert len(seen.bound) == fleet_pods, "the probes must stay pending: the fleet is full"
    assert set(seen.bound.values()) <= set(seen.node_uids)


def test_claims_are_allocated_on_their_pods_nodes(run: tuple[dict[str, Any], Seen]) -> None:
    _, seen = run
    assert seen.problems == []


def test_the_fleet_publishes_one_valid_pool_per_node(run: tuple[dict[str, Any], Seen]) -> None:
    _, seen = run
    assert len(seen.node_uids) == NODES
    by_pool = {s["spec"]["pool"]["name"]: s for s in seen.slices}
    assert sorted(by_pool) == sorted(seen.node_uids)
    for name, obj in by_pool.items():
        validate_slice(obj)
        assert obj["spec"]["driver"] == DRIVER
        assert obj["spec"]["nodeName"] == name
        assert len(obj["spec"]["devices"]) == GPUS
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("Node", name, seen.node_uids[name])


def test_one_health_flip_is_one_slice_write(run: tuple[dict[str, Any], Seen]) -> None:
    result, _ = run
    flip = result["health_flip"]
    for step in ("unhealthy", "healthy_again"):
        assert flip[step]["publisher_writes"] == 1, flip
        assert flip[step]["audit_fleet_writes"] == {"update resourceslices": 1}, flip


def test_the_controller_explains_every_unsatisfiable_claim(
    run: tuple[dict[str, Any], Seen],
) -> None:
    result, _ = run
    assert result["controller"]["create_to_unsatisfiable_event_s"]["count"] == PARAMS.burst
    # One Event on each probe's claim and one on the Pod; none repeated since.
    assert result["controller"]["events_since_probes"] == 2 * PARAMS.burst
    assert result["explain"]["output_first_line"].startswith("claim scale/probe-0-gpu-")
    # Only unbound Pods are read (a field selector), and the waiting one is among them.
    assert result["explain"]["inputs"]["pods"] == 1


def test_drasil_writes_nothing_but_its_lease_when_idle(run: tuple[dict[str, Any], Seen]) -> None:
    result, _ = run
    assert result["idle"]["drasil_writes_per_minute_without_leader_lease"] == 0, result["idle"]

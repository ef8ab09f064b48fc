"""`drasil migrate check`'s judgement (drasil.driver.nvidia.migration): the plan from
chart values, the device plugin's sharing config, each kind of workload's verdict, and
the node pools to move first."""

from __future__ import annotations

from typing import Any

import pytest

from drasil.driver.nvidia.migration import (
    BLOCKED,
    CHANGE,
    UNCHANGED,
    Plan,
    check,
    check_all,
    plan_from,
    pools,
    sharing_config,
)

MIGRATE_VALUES = {
    "deviceClasses": {
        "extendedResourceName": "nvidia.com/gpu",
        "migProfiles": ["1g.10gb", "1g.10gb+me"],
        "migExtendedResourcePrefix": "nvidia.com/mig-",
    },
    "nodeLabels": {"names": "gfd"},
}
TIME_SLICING = """
version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""


def _container(limits: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"name": "c", "resources": {"limits": limits or {}}, **extra}


def _spec(*containers: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"containers": list(containers), **extra}


def test_the_plan_follows_the_values_and_the_clusters_classes() -> None:
    existing = {"metadata": {"name": "a"}, "spec": {"extendedResourceName": "example.com/fpga"}}
    plan = plan_from(MIGRATE_VALUES, [existing], [])
    assert plan.extended == {
        "example.com/fpga": "a",
        "nvidia.com/gpu": "gpu.drasil.dev",
        "nvidia.com/mig-1g.10gb": "mig-1g.10gb.drasil.dev",
        "nvidia.com/mig-1g.10gb.me": "mig-1g.10gb.me.drasil.dev",
    }
    assert plan.gfd_labels
    defaults = plan_from({}, [], [])
    assert defaults.extended == {"drasil.dev/gpu": "gpu.drasil.dev"}
    assert not defaults.gfd_labels
    no_classes = plan_from({"deviceClasses": {"create": False}}, [], [])
    assert no_classes.extended == {}


def test_the_device_plugins_sharing_is_read_from_its_config_map() -> None:
    maps = [
        {"data": {"any": TIME_SLICING}},
        {
            "data": {
                "mps": "sharing:\n  mps:\n    resources:\n"
                "    - {name: nvidia.com/gpu.shared, replicas: 2}\n"
            }
        },
        {"data": {"other": "sharing: &a [*a]"}},  # an alias: not read, no error
        {"data": {"huge": "sharing:" + "x" * 70_000}},
        {"data": None},
    ]
    assert sharing_config(maps) == {"nvidia.com/gpu": 4, "nvidia.com/gpu.shared": 2}


PLAN = plan_from(MIGRATE_VALUES, [], [{"data": {"config": TIME_SLICING}}])
DEFAULT_PLAN = plan_from({}, [], [])


@pytest.mark.parametrize(
    ("spec", "plan", "verdict", "why"),
    [
        pytest.param(
            _spec(_container({"nvidia.com/gpu": 8})), PLAN, UNCHANGED,
            "was 1/4 of a GPU", id="training-8-gpus-time-sliced-cluster",
        ),
        pytest.param(
            _spec(_container({"nvidia.com/gpu": 1})), DEFAULT_PLAN, CHANGE,
            "deviceClasses.extendedResourceName", id="gpu-without-the-mapping",
        ),
        pytest.param(
            _spec(_container({"nvidia.com/mig-1g.10gb": 1})), PLAN, UNCHANGED, "", id="mig-mapped",
        ),
        pytest.param(
            _spec(_container({"nvidia.com/mig-3g.40gb": 1})), PLAN, CHANGE,
            "add 3g.40gb to deviceClasses.migProfiles", id="mig-profile-not-listed",
        ),
        pytest.param(
            _spec(_container({"nvidia.com/gpu.shared": 1})), PLAN, CHANGE,
            "shared.drasil.dev", id="renamed-shared-resource",
        ),
        pytest.param(
            _spec(_container({"nvidia.com/vgpu": 1})), PLAN, BLOCKED,
            "nvidia.com/vgpu, which drasil does not serve", id="vgpu",
        ),
        pytest.param(
            _spec(_container(env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}])),
            PLAN, BLOCKED, "NVIDIA_VISIBLE_DEVICES", id="monitoring-agent-all-gpus",
        ),
        pytest.param(
            _spec(_container({"nvidia.com/gpu": 1}),
                  nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}),
            PLAN, UNCHANGED, "", id="product-selector-with-gfd-names",
        ),
        pytest.param(
            _spec(_container({"nvidia.com/gpu": 1}),
                  nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}),
            plan_from({"deviceClasses": {"extendedResourceName": "nvidia.com/gpu"}}, [], []),
            CHANGE, "nodeLabels.names to gfd", id="product-selector-without-gfd-names",
        ),
        pytest.param(
            _spec(_container({"nvidia.com/gpu": 1}), affinity={"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "nvidia.com/gpu.clique", "operator": "Exists"}]}
                ]}}}),
            PLAN, CHANGE, "a label drasil does not write", id="affinity-on-a-label-drasil-lacks",
        ),
        pytest.param(
            _spec({"name": "c", "resources": {"requests": {"nvidia.com/gpu": 1}}}), PLAN,
            UNCHANGED, "", id="requests-only",
        ),
        pytest.param(
            _spec(_container({"nvidia.com/gpu": 1}),
                  initContainers=[_container({"nvidia.com/vgpu": 1})]),
            PLAN, BLOCKED, "nvidia.com/vgpu", id="init-container-counts",
        ),
    ],
)  # fmt: skip
def test_verdicts(spec: dict[str, Any], plan: Plan, verdict: str, why: str) -> None:
    found = check("Pod", {"namespace": "ns", "name": "p"}, spec, plan)
    assert found is not None
    assert found.verdict == verdict, found.reasons
    assert why in "; ".join(found.reasons)


def test_a_workload_without_gpus_gets_no_verdict() -> None:
    assert check("Pod", {}, _spec(_container({"cpu": "1"})), PLAN) is None


def test_owned_pods_are_judged_through_their_controller_blocked_first() -> None:
    bare = {
        "metadata": {"namespace": "a", "name": "bare"},
        "spec": _spec(_container({"nvidia.com/vgpu": 1})),
    }
    owned = {
        "metadata": {"namespace": "a", "name": "web-1", "ownerReferences": [{"controller": True}]},
        "spec": _spec(_container({"nvidia.com/gpu": 1})),
    }
    deployment = {
        "metadata": {"namespace": "a", "name": "web"},
        "spec": {"template": {"spec": _spec(_container({"nvidia.com/gpu": 1}))}},
    }
    verdicts = check_all([bare, owned], {"Deployment": [deployment]}, PLAN)
    assert [(v.ref, v.verdict) for v in verdicts] == [
        ("Pod a/bare", BLOCKED),
        ("Deployment a/web", UNCHANGED),
    ]


def _node(name: str, pool: str, gpus: str = "8") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"pool": pool}},
        "status": {"allocatable": {"cpu": "64", "nvidia.com/gpu": gpus}},
    }


def test_pools_that_move_cleanly_come_first() -> None:
    nodes = [_node("a1", "a"), _node("b1", "b"), _node("c1", "c", gpus="0"), _node("b2", "b")]
    pods = [
        {"metadata": {}, "spec": {"nodeName": "a1", **_spec(_container({"nvidia.com/vgpu": 1}))}},
        {"metadata": {}, "spec": {"nodeName": "b1", **_spec(_container({"nvidia.com/gpu": 1}))}},
        {"metadata": {}, "spec": {"nodeName": "b2", **_spec(_container({"cpu": "1"}))}},
    ]
    found = pools(nodes, pods, PLAN, pool_label="pool")
    assert [(p.name, p.nodes, dict(p.pods), p.moves_cleanly) for p in found] == [
        ("b", 2, {UNCHANGED: 1}, True),
        ("a", 1, {BLOCKED: 1}, False),
    ]

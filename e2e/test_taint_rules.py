"""DeviceTaintRules (KEP-5055, resource.k8s.io/v1, GA in 1.37) against the real
kube-scheduler and drasil-controller.

An operator drains one GPU with a rule, without touching the driver's slices: the
scheduler keeps a claim that can only use that GPU pending, and the controller's
Unsatisfiable Event (and `drasil explain`) names the rule. Deleting the rule lets the
claim be allocated. The controller runs with the chart's RBAC, so a missing
permission on devicetaintrules would show as an Event that does not name the rule.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from drasil.driver.explain.fromapi import explain_from_api
from drasil.driver.kubeapi import KubeApi
from e2e.harness.chart import chart_controller
from e2e.harness.controllerproc import ControllerProcess
from e2e.harness.kube import RESOURCE, Kube, NotYet, gone, pending_pod, wait_for

TOKEN = secrets.token_hex(3)
DRIVER = f"taint-{TOKEN}.drasil.dev"  # ours alone: other tests' slices never count here
RULE = f"drain-gpu-3-{TOKEN}"
ONLY_GPU_3 = f'device.attributes["{DRIVER}"].index == 3'


@pytest.fixture(scope="module")
def device_class(kube: Kube) -> Iterator[str]:
    selector = {"cel": {"expression": f'device.driver == "{DRIVER}"'}}
    kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "DeviceClass",
            "metadata": {"name": DRIVER},
            "spec": {"selectors": [selector]},
        }
    )
    yield DRIVER
    kube.delete(RESOURCE, "DeviceClass", DRIVER)


@pytest.fixture(scope="module")
def controller(
    kube: Kube, kubeconfig: Path, device_class: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControllerProcess]:
    """The controller for DRIVER under the chart's RBAC, leading its own Lease."""
    with chart_controller(
        kube,
        kubeconfig,
        release=f"taint-{TOKEN}",
        driver=DRIVER,
        directory=tmp_path_factory.mktemp("controller"),
    ) as proc:
        yield proc


@pytest.fixture
def drain_rule(kube: Kube) -> Iterator[str]:
    """The rule an operator writes to drain gpu-3 of this driver's pool (docs/controller.md)."""
    kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "DeviceTaintRule",
            "metadata": {"name": RULE},
            "spec": {
                "deviceSelector": {"driver": DRIVER, "device": "gpu-3"},
                "taint": {"key": "drasil.dev/drain", "effect": "NoSchedule"},
            },
        }
    )
    yield RULE
    kube.delete(RESOURCE, "DeviceTaintRule", RULE)


def _gpu(index: int) -> dict[str, Any]:
    return {"name": f"gpu-{index}", "attributes": {"index": {"int": index}}}


def _node_slice(node: dict[str, Any]) -> dict[str, Any]:
    """Four GPUs on a Node, published as a node's plugin would."""
    name, uid = node["metadata"]["name"], node["metadata"]["uid"]
    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceSlice",
        "metadata": {
            "name": f"{name}-{DRIVER}",
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": uid}],
        },
        "spec": {
            "driver": DRIVER,
            "nodeName": name,
            "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
            "devices": [_gpu(i) for i in range(4)],
        },
    }


def _template(name: str) -> dict[str, Any]:
    request = {"deviceClassName": DRIVER, "selectors": [{"cel": {"expression": ONLY_GPU_3}}]}
    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}}},
    }


def _claim_of(kube: Kube, namespace: str, pod: str) -> Any:
    statuses = kube.get("v1", "Pod", pod, namespace).get("status", {}).get("resourceClaimStatuses")
    names = [s["resourceClaimName"] for s in statuses or [] if s.get("resourceClaimName")]
    return kube.get(RESOURCE, "ResourceClaim", names[0], namespace) if names else NotYet(statuses)


def _event(kube: Kube, namespace: str, uid: str) -> Any:
    selector = f"involvedObject.uid={uid},reason=Unsatisfiable"
    found = kube.core.list_namespaced_event(namespace, field_selector=selector).items
    return found[0] if found else NotYet(f"no Unsatisfiable Event for {uid}")


def _allocation(kube: Kube, namespace: str, name: str) -> Any:
    claim = kube.get(RESOURCE, "ResourceClaim", name, namespace)
    return (claim.get("status") or {}).get("allocation") or NotYet(claim.get("status"))


def test_a_rule_draining_the_only_fitting_gpu_is_named_and_undone_by_deleting_it(
    kube: Kube,
    namespace: str,
    controller: ControllerProcess,
    make_node: Callable[..., dict[str, Any]],
    drain_rule: str,
) -> None:
    node = make_node(f"e2e-taint-{TOKEN}")
    kube.create(_node_slice(node))
    kube.create(_template("gpu-3"), namespace)
    kube.create(pending_pod("trainer", template="gpu-3"), namespace)
    claim = wait_for(lambda: _claim_of(kube, namespace, "trainer"), timeout=30, what="the claim")
    uid, name = claim["metadata"]["uid"], claim["metadata"]["name"]

    # --explain-after is 10 s; the scheduler has kept the claim unallocated meanwhile.
    event = wait_for(lambda: _event(kube, namespace, uid), timeout=40, what="Unsatisfiable")

    wanted = f"gpu-3 tainted by DeviceTaintRule {drain_rule} (NoSchedule)"
    assert event.message.endswith(wanted), event.message
    assert not (kube.get(RESOURCE, "ResourceClaim", name, namespace).get("status") or {}).get(
        "allocation"
    )
    cli = explain_from_api(KubeApi(kube.api), namespace=namespace, name=name, driver=DRIVER)
    assert cli.message() == event.message

    kube.delete(RESOURCE, "DeviceTaintRule", drain_rule)
    wait_for(lambda: gone(kube, RESOURCE, "DeviceTaintRule", drain_rule), timeout=30, what="gone")
    allocation = wait_for(
        lambda: _allocation(kube, namespace, name), timeout=60, what="the claim allocated"
    )
    assert [r["device"] for r in allocation["devices"]["results"]] == ["gpu-3"]

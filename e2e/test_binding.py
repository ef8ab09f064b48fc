"""Binding conditions (KEP-5007) of DevicePool devices, against the real scheduler.

A DevicePool device with ``bindingConditions`` is published with them; kube-scheduler
allocates it and holds the Pod before binding until the controller, playing the
(simulated) fabric, says the device is attached in the claim's ``status.devices``.
A failed attach makes the scheduler un-allocate and pick another device, which it
can because the controller taints the failed one first. The controller runs with the
chart's RBAC, as in e2e/test_controller.py (whose CRD fixture and helpers are reused).
"""

from __future__ import annotations

import functools
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from drasil.api.devicepool import API_VERSION as POOL_API
from e2e.harness.chart import chart_controller
from e2e.harness.controllerproc import ControllerProcess
from e2e.harness.kube import RESOURCE, Kube, NotYet, pending_pod, wait_for
from e2e.test_controller import RACK_A, crd, gpu, pod_claim, pool_slices

__all__ = ["crd"]  # the CRD fixture, shared with e2e/test_controller.py

TOKEN = secrets.token_hex(3)
DRIVER = f"bind-{TOKEN}.drasil.dev"
ATTACHED = "drasil.dev/Attached"
FAILED = "drasil.dev/AttachFailed"


@pytest.fixture(scope="module")
def device_class(kube: Kube) -> Iterator[str]:
    body = {
        "apiVersion": RESOURCE,
        "kind": "DeviceClass",
        "metadata": {"name": DRIVER},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    }
    kube.create(body)
    yield DRIVER
    kube.delete(RESOURCE, "DeviceClass", DRIVER)


@pytest.fixture(scope="module")
def controller(
    crd: None,
    device_class: str,
    kube: Kube,
    kubeconfig: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ControllerProcess]:
    """The controller for DRIVER under the chart's RBAC, leading its own Lease."""
    with chart_controller(
        kube,
        kubeconfig,
        release=f"bind-{TOKEN}",
        driver=DRIVER,
        directory=tmp_path_factory.mktemp("controller"),
    ) as proc:
        yield proc


@pytest.fixture
def pool(kube: Kube, make_node: Callable[..., dict[str, Any]]) -> Iterator[Callable[..., None]]:
    """make(name, fabric, *devices): a node in rack a and a DevicePool of attachable
    devices; deleted after."""
    made: list[str] = []
    make_node(f"e2e-bind-{secrets.token_hex(3)}", labels={"rack": "a"})

    def make(name: str, fabric: dict[str, Any], *devices: str) -> None:
        made.append(name)
        attachable: dict[str, Any] = {"bindsToNode": True, "bindingConditions": [ATTACHED]}
        body = {
            "apiVersion": POOL_API,
            "kind": "DevicePool",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": RACK_A,
                "devices": [
                    gpu(d, **attachable, bindingFailureConditions=[FAILED]) for d in devices
                ],
                "simulatedFabric": fabric,
            },
        }
        kube.create(body)

    yield make
    for name in made:
        kube.delete(POOL_API, "DevicePool", name)


def _template(kube: Kube, namespace: str) -> None:
    request = {"name": "gpu", "exactly": {"deviceClassName": DRIVER}}
    body = {
        "apiVersion": RESOURCE,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "fabric-gpu"},
        "spec": {"spec": {"devices": {"requests": [request]}}},
    }
    kube.create(body, namespace)


def _allocated(kube: Kube, namespace: str, pod: str) -> Any:
    claim = pod_claim(kube, namespace, pod)
    return claim if claim and (claim.get("status") or {}).get("allocation") else NotYet(claim)


def _node_name(kube: Kube, namespace: str, pod: str) -> str:
    return str((kube.get("v1", "Pod", pod, namespace).get("spec") or {}).get("nodeName") or "")


def _conditions(claim: Any) -> dict[str, tuple[str, str]]:
    """{device: {type: status}} flattened to (device, type) -> (status, reason)."""
    return {
        f"{e['device']}:{c['type']}": (c["status"], c["reason"])
        for e in (claim.get("status") or {}).get("devices") or []
        for c in e.get("conditions") or []
    }


def _attached_at(claim: Any, device: str) -> str:
    """When the device's binding condition turned True (RFC 3339, sortable)."""
    entries = (claim.get("status") or {}).get("devices") or []
    entry = next(e for e in entries if e["device"] == device)
    return str(next(c for c in entry["conditions"] if c["type"] == ATTACHED)["lastTransitionTime"])


def _scheduled_at(kube: Kube, namespace: str, pod: str) -> str:
    conditions = kube.get("v1", "Pod", pod, namespace)["status"].get("conditions") or []
    return str(next(c for c in conditions if c["type"] == "PodScheduled")["lastTransitionTime"])


def _explain(kubeconfig: Path, namespace: str, claim: str) -> str:
    args = [sys.executable, "-m", "drasil.driver.cli", "explain", claim, "-n", namespace]
    args += ["--driver-name", DRIVER, "--kubeconfig", str(kubeconfig)]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False).stdout


def test_the_pod_is_bound_only_once_the_device_is_attached(
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    controller: ControllerProcess,
    pool: Callable[..., None],
) -> None:
    pool("fabric-a", {"attachSeconds": 12}, "fab-0", "fab-1")
    wait_for(lambda: pool_slices(kube, "fabric-a", DRIVER) or NotYet([]), timeout=30, what="slices")
    [device] = pool_slices(kube, "fabric-a", DRIVER)[0]["spec"]["devices"][:1]
    assert device["bindsToNode"] is True
    assert device["bindingConditions"] == [ATTACHED]
    assert device["bindingFailureConditions"] == [FAILED]

    _template(kube, namespace)
    kube.create(pending_pod("attached", template="fabric-gpu"), namespace)
    claim = wait_for(
        functools.partial(_allocated, kube, namespace, "attached"), timeout=60, what="allocation"
    )
    [result] = claim["status"]["allocation"]["devices"]["results"]
    assert result["bindingConditions"] == [ATTACHED]
    assert claim["status"]["allocation"].get("nodeSelector"), "bindsToNode: limited to one node"

    # While the fabric attaches, the Pod has no node and the claim says why.
    attaching = (f"{result['device']}:{ATTACHED}", ("False", "Attaching"))

    def waiting() -> Any:
        seen = pod_claim(kube, namespace, "attached")
        unbound = _node_name(kube, namespace, "attached") == ""
        state = _conditions(seen).get(attaching[0])
        return seen if unbound and state == attaching[1] else NotYet((unbound, state))

    claim = wait_for(waiting, timeout=30, what="the claim attaching while the Pod waits")
    states = _conditions(claim)
    assert states[f"{result['device']}:Ready"] == ("False", "Attaching")
    text = _explain(kubeconfig, namespace, claim["metadata"]["name"])
    assert f"waiting for attach of fabric-a/{result['device']} (" in text, text

    node = wait_for(
        lambda: _node_name(kube, namespace, "attached") or NotYet("unbound"),
        timeout=60,
        what="the Pod to be bound after the attach",
    )
    # Bound only after the attach: the scheduler's binding follows the condition.
    assert _attached_at(pod_claim(kube, namespace, "attached"), result["device"]) <= (
        _scheduled_at(kube, namespace, "attached")
    )
    assert node.startswith("e2e-bind-")
    claim = pod_claim(kube, namespace, "attached")
    states = _conditions(claim)
    assert states[f"{result['device']}:{ATTACHED}"] == ("True", "Attached")
    assert states[f"{result['device']}:Ready"] == ("True", "DevicePoolDevice")


def test_a_failed_attach_makes_the_scheduler_take_another_device(
    kube: Kube,
    namespace: str,
    controller: ControllerProcess,
    pool: Callable[..., None],
) -> None:
    pool("fabric-b", {"attachSeconds": 1, "failDevices": ["fab-0"]}, "fab-0", "fab-1")
    wait_for(lambda: pool_slices(kube, "fabric-b", DRIVER) or NotYet([]), timeout=30, what="slices")
    _template(kube, namespace)
    kube.create(pending_pod("retried", template="fabric-gpu"), namespace)

    seen: set[tuple[str, str, str]] = set()

    def bound() -> Any:
        claim = pod_claim(kube, namespace, "retried")
        for key, (status, _) in _conditions(claim or {}).items():
            seen.add((*key.split(":", 1), status))  # type: ignore[arg-type]
        return _node_name(kube, namespace, "retried") or NotYet(sorted(seen))

    wait_for(bound, timeout=120, what="the Pod to be bound to another device", interval=0.2)
    claim = pod_claim(kube, namespace, "retried")
    [result] = claim["status"]["allocation"]["devices"]["results"]
    assert result["device"] == "fab-1"
    assert ("fab-0", FAILED, "True") in seen, sorted(seen)
    assert _conditions(claim)[f"fab-1:{ATTACHED}"] == ("True", "Attached")
    [failed] = [
        d
        for d in pool_slices(kube, "fabric-b", DRIVER)[0]["spec"]["devices"]
        if d["name"] == "fab-0"
    ]
    assert [t["key"] for t in failed.get("taints") or []] == ["drasil.dev/attach-failed"]

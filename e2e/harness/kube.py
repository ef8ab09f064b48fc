"""What e2e tests use to talk to the cluster: real API clients, polling with a deadline,
and schedulable Node objects without a kubelet."""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client, config, dynamic
from kubernetes.client.exceptions import ApiException

T = TypeVar("T")
# Seconds for one API request of the helpers below: a stalled API server fails the
# test with an error instead of hanging it until CI's own limit.
REQUEST_TIMEOUT = 30
# The API group/version of every DRA object the harness makes or reads.
RESOURCE = "resource.k8s.io/v1"

# Taints that admission (TaintNodesByCondition) or the node-lifecycle controller put on
# a Node whose kubelet has not reported Ready.
NOT_READY_TAINTS = frozenset({"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"})


class WaitTimeout(AssertionError):
    """A wait_for deadline passed; says what was awaited and the last state seen."""


class NotYet:
    """Falsy result of a wait_for predicate that carries the state seen, for the error."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return _describe(self.state)


def _describe(state: Any, limit: int = 2000) -> str:
    if isinstance(state, NotYet):
        return repr(state)
    if isinstance(state, dict | list):
        text = json.dumps(state, default=str, sort_keys=True)
    else:
        text = repr(state)
    return text if len(text) <= limit else text[:limit] + "..."


def wait_for(
    predicate: Callable[[], T | NotYet], *, timeout: float, what: str, interval: float = 0.2
) -> T:
    """Call `predicate` until it returns something truthy, and return that.

    Return `NotYet(state)` from the predicate to have `state` in the timeout error. API
    errors (e.g. 404 before an object exists) count as "not yet" and are reported too.
    """
    deadline = time.monotonic() + timeout
    last: Any = "(predicate never returned)"
    while True:
        try:
            result = predicate()
        except (ApiException, OSError) as e:
            last = f"{type(e).__name__}: {getattr(e, 'status', '')} {getattr(e, 'reason', e)}"
        else:
            if result and not isinstance(result, NotYet):
                return result
            last = result
        if time.monotonic() >= deadline:
            raise WaitTimeout(
                f"timed out after {timeout:g}s waiting for {what}; last seen: {_describe(last)}"
            )
        time.sleep(interval)


def gone(kube: Kube, api_version: str, kind: str, name: str, namespace: str | None = None) -> Any:
    """For wait_for: True once the object does not exist, else NotYet(its metadata)."""
    try:
        obj = kube.get(api_version, kind, name, namespace)
    except ApiException as e:
        if e.status == 404:
            return True
        raise
    return NotYet(obj.get("metadata"))


def pending_pod(
    name: str, *, template: str | None = None, claim: str | None = None
) -> dict[str, Any]:
    """A Pod for the Nodes of `Kube.make_node`, with one claim `gpu` (from `template`,
    else the claim `claim`): it is scheduled and bound, never run, so its image is
    never pulled."""
    source = {"resourceClaimTemplateName": template} if template else {"resourceClaimName": claim}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "main",
                    "image": "registry.invalid/never-pulled:1",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
            "resourceClaims": [{"name": "gpu", **source}],
        },
    }


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Kube:
    """API clients for one cluster, from the `kubernetes` package (nothing mocked)."""

    kubeconfig: Path
    api: client.ApiClient = field(init=False)
    core: client.CoreV1Api = field(init=False)
    dyn: dynamic.DynamicClient = field(init=False)

    def __post_init__(self) -> None:
        self.api = config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(self.kubeconfig), persist_config=False
        )
        self.core = client.CoreV1Api(self.api)
        self.dyn = dynamic.DynamicClient(self.api)  # type: ignore[no-untyped-call]

    def resource(self, api_version: str, kind: str) -> Any:
        """A dynamic resource, e.g. resource("resource.k8s.io/v1", "ResourceClaim")."""
        return self.dyn.resources.get(api_version=api_version, kind=kind)

    def create(self, obj: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
        """Create a plain-dict object; returns the stored object as a dict."""
        res = self.resource(obj["apiVersion"], obj["kind"])
        created = res.create(
            body=obj,
            namespace=namespace if res.namespaced else None,
            _request_timeout=REQUEST_TIMEOUT,
        )
        return dict(created.to_dict())

    def get(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> dict[str, Any]:
        res = self.resource(api_version, kind)
        got = res.get(
            name=name,
            namespace=namespace if res.namespaced else None,
            _request_timeout=REQUEST_TIMEOUT,
        )
        return dict(got.to_dict())

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> None:
        """Delete, ignoring an object that is already gone."""
        res = self.resource(api_version, kind)
        try:
            res.delete(
                name=name,
                namespace=namespace if res.namespaced else None,
                _request_timeout=REQUEST_TIMEOUT,
            )
        except ApiException as e:
            if e.status != 404:
                raise

    def make_node(
        self,
        name: str,
        *,
        labels: dict[str, str] | None = None,
        cpu: str = "8",
        memory: str = "32Gi",
        pods: str = "110",
        extended: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> dict[str, Any]:
        """A Node the scheduler accepts pods for: Ready, with allocatable cpu/memory/pods
        (and `extended` resources, as a device plugin would advertise them) and no
        not-ready taint. No kubelet runs for it; pods bound to it stay Pending."""
        all_labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **(labels or {}),
        }
        self.core.create_node(
            client.V1Node(metadata=client.V1ObjectMeta(name=name, labels=all_labels))
        )
        resources = {"cpu": cpu, "memory": memory, "pods": pods, **(extended or {})}
        now = _now()
        # Status is only writable through the status subresource.
        self.core.patch_node_status(
            name,
            {
                "status": {
                    "capacity": resources,
                    "allocatable": resources,
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True",
                            "reason": "KubeletReady",
                            "message": "e2e test node without a kubelet",
                            "lastHeartbeatTime": now,
                            "lastTransitionTime": now,
                        }
                    ],
                }
            },
        )

        def schedulable() -> Any:
            node = self.get("v1", "Node", name)
            taints = node["spec"].get("taints") or []
            kept = [t for t in taints if t["key"] not in NOT_READY_TAINTS]
            if len(kept) != len(taints):
                # Admission tainted the new Node not-ready; the node-lifecycle controller
                # would lift it too, but not before it next looks.
                self.core.patch_node(name, {"spec": {"taints": kept or None}})
                return NotYet({"taints": taints})
            ready = [
                c
                for c in node["status"].get("conditions") or []
                if c["type"] == "Ready" and c["status"] == "True"
            ]
            return node if ready and not node["spec"].get("unschedulable") else NotYet(node)

        result: dict[str, Any] = wait_for(
            schedulable, timeout=timeout, what=f"Node {name} to be Ready without taints"
        )
        return result


@contextmanager
def device_classes(kube: Kube, specs: Mapping[str, Any]) -> Iterator[None]:
    """DeviceClasses ``name: spec``, each made anew (one left by an earlier run is
    replaced), deleted on the way out."""
    for name, spec in specs.items():
        kube.delete(RESOURCE, "DeviceClass", name)
        kube.create(
            {
                "apiVersion": RESOURCE,
                "kind": "DeviceClass",
                "metadata": {"name": name},
                "spec": spec,
            }
        )
    try:
        yield
    finally:
        for name in specs:
            kube.delete(RESOURCE, "DeviceClass", name)

"""Pods on the real node of e2e.harness.cluster, as a user makes and reads them: create a Pod
that prints its env, wait until it runs, read what the container saw, delete it."""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from e2e.harness import versions
from e2e.harness.cluster.node import Node
from e2e.harness.kube import RESOURCE, Kube, NotYet, gone, wait_for
from e2e.harness.pluginproc import DRIVER, checkpoint_claims

# Prints the env, then waits; exits at once on SIGTERM (a shell as PID 1 ignores it,
# which would make every deletion take the whole grace period).
COMMAND = "env | sort; trap 'exit 0' TERM; sleep 3600 & wait"
POD_TIMEOUT = 120
NODE_GPU_SELECTOR = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpu"'
EXTENDED_CLASS = f"extended.{DRIVER}"
EXTENDED_RESOURCE = "drasil.dev/gpu"


def template(
    kube: Kube,
    namespace: str,
    *,
    config: dict[str, Any] | None = None,
    device_class: str = DRIVER,
    name: str | None = None,
    requests: list[dict[str, Any]] | None = None,
    configs: list[dict[str, Any]] | None = None,
) -> str:
    """A ResourceClaimTemplate; its name. By default one request "gpu" for a device of
    `device_class` (gpu.drasil.dev), with `config` as its opaque GpuConfig parameters;
    `requests` and `configs` replace those with the claim's own lists."""
    devices: dict[str, Any] = {
        "requests": requests or [{"name": "gpu", "exactly": {"deviceClassName": device_class}}]
    }
    if config is not None:
        devices["config"] = [
            {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": config}}
        ]
    if configs:
        devices["config"] = configs
    name = name or f"gpu-{secrets.token_hex(3)}"
    kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name},
            "spec": {"spec": {"devices": devices}},
        },
        namespace,
    )
    return name


def pod(
    kube: Kube,
    namespace: str,
    node: Node | str,
    *,
    template_name: str | None = None,
    claim_name: str | None = None,
    limits: dict[str, Any] | None = None,
    name: str | None = None,
    command: str = COMMAND,
    node_selector: dict[str, str] | None = None,
    pod_group: str | None = None,
) -> str:
    """A Pod on the node (a Node, or the name of a node without kubelet, where it
    is only scheduled) running the test image; its container uses the claim.
    `node_selector` adds to the node's hostname; `pod_group` schedules it in that
    PodGroup (spec.schedulingGroup)."""
    name = name or f"pod-{secrets.token_hex(3)}"
    container: dict[str, Any] = {
        "name": "c",
        "image": versions.TEST_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", command],
    }
    spec: dict[str, Any] = {
        "nodeSelector": {
            "kubernetes.io/hostname": node if isinstance(node, str) else node.name,
            **(node_selector or {}),
        },
        "restartPolicy": "Never",
        "dnsPolicy": "Default",
        "terminationGracePeriodSeconds": 5,
        "containers": [container],
    }
    if template_name or claim_name:
        source = (
            {"resourceClaimTemplateName": template_name}
            if template_name
            else {"resourceClaimName": claim_name}
        )
        spec["resourceClaims"] = [{"name": "gpu", **source}]
        container["resources"] = {"claims": [{"name": "gpu"}]}
    if limits:
        container["resources"] = {"limits": limits}
    if pod_group:
        spec["schedulingGroup"] = {"podGroupName": pod_group}
    kube.create(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}, namespace
    )
    return name


def wait_running(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    def running() -> Any:
        p = kube.get("v1", "Pod", name, namespace)
        statuses = p.get("status", {}).get("containerStatuses") or []
        if p["status"].get("phase") == "Running" and statuses and statuses[0].get("ready"):
            return p
        return NotYet({"status": p.get("status"), "events": events(kube, namespace, name)})

    result: dict[str, Any] = wait_for(
        running, timeout=POD_TIMEOUT, what=f"Pod {namespace}/{name} running"
    )
    return result


def container_env(
    kube: Kube, namespace: str, name: str, *, container: str = "c", timeout: float = 60
) -> dict[str, str]:
    """The env the container printed at start (its log)."""

    def printed() -> Any:
        log = kube.core.read_namespaced_pod_log(
            name, namespace, container=container, _request_timeout=30
        )
        return log if "PATH=" in log else NotYet(log)

    log: str = wait_for(printed, timeout=timeout, what=f"the env in the log of {namespace}/{name}")
    return dict(line.split("=", 1) for line in log.splitlines() if "=" in line)


_DEVICE_VARIABLE = re.compile(r"DRASIL_DEVICE_[A-Z0-9_]+")


def visible_uuids(env: dict[str, str]) -> list[str]:
    """The device UUIDs a container was given (its ``DRASIL_DEVICE_<NAME>`` variables),
    sorted; settings variables hold no UUID."""
    return sorted(
        value
        for name, value in env.items()
        if _DEVICE_VARIABLE.fullmatch(name) and value.startswith(("GPU-", "MIG-"))
    )


def device_variable(device: str) -> str:
    """``gpu-3`` -> ``DRASIL_DEVICE_GPU_3``, as the CDI spec names it."""
    return "DRASIL_DEVICE_" + re.sub(r"[^A-Za-z0-9_]", "_", device).upper()


def events(kube: Kube, namespace: str, name: str) -> list[str]:
    items = kube.core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}", _request_timeout=30
    ).items
    return [f"{e.reason}: {e.message}" for e in items]


def node_events(
    kube: Kube, node: str, reason: str, *, containing: str = "", timeout: float = 60.0
) -> list[str]:
    """The messages of the Events of `reason` about Node `node` (the plugin posts them
    in `default`), once at least one holds `containing`."""

    def posted() -> Any:
        items = kube.core.list_event_for_all_namespaces(
            field_selector=f"involvedObject.name={node},reason={reason}", _request_timeout=30
        ).items
        messages = [e.message or "" for e in items]
        return messages if any(containing in m for m in messages) else NotYet(messages)

    found: list[str] = wait_for(posted, timeout=timeout, what=f"a {reason} Event of {node}")
    return found


def device_uuids(kube: Kube, node: Node) -> dict[str, str]:
    """Device name -> uuid attribute, as the node's plugin (driver gpu.drasil.dev)
    published them (a dynamic MIG placement has none: no instance exists yet)."""
    slices = kube.resource(RESOURCE, "ResourceSlice").get(
        field_selector=f"spec.nodeName={node.name},spec.driver={DRIVER}"
    )
    return {
        d["name"]: str(d["attributes"]["uuid"]["string"])
        for s in slices.items
        for d in s.to_dict()["spec"].get("devices") or []
        if "uuid" in d["attributes"]
    }


def device_uuid(kube: Kube, node: Node, device: str) -> str:
    """The device's uuid attribute as published in the node's ResourceSlice."""
    uuids = device_uuids(kube, node)
    if device not in uuids:
        raise AssertionError(f"device {device} not published for {node.name}")
    return uuids[device]


def delete_pod(kube: Kube, namespace: str, name: str, *, wait: bool = True) -> None:
    """A graceful delete, as a user does it: kubelet stops the container and then
    unprepares the claims."""
    try:
        kube.core.delete_namespaced_pod(name, namespace)
    except ApiException as e:
        if e.status != 404:
            raise
    if wait:
        wait_for(
            lambda: gone(kube, "v1", "Pod", name, namespace),
            timeout=POD_TIMEOUT,
            what=f"Pod {namespace}/{name} deleted",
        )


# --- what the node holds -----------------------------------------------------------


def checkpoint(node: Node) -> dict[str, Any]:
    return checkpoint_claims(node.plugin.state_dir)


def cdi_spec(node: Node, uid: str) -> Path:
    return node.cdi_dir / f"k8s.{DRIVER}-claim_{uid}.json"


def drain_namespace(kube: Kube, node: Node, namespace: str) -> None:
    """Delete every Pod of `namespace` and wait until the node unprepared every claim
    of it: no CDI spec, no checkpoint entry left."""
    pods = kube.core.list_namespaced_pod(namespace, _request_timeout=30).items
    for item in pods:
        assert item.metadata is not None
        assert item.metadata.name is not None
        delete_pod(kube, namespace, item.metadata.name)
    wait_for(
        lambda: NotYet(prepared_in(node, namespace)) if prepared_in(node, namespace) else True,
        timeout=POD_TIMEOUT,
        what=f"the node to unprepare every claim of {namespace}",
    )


def prepared_in(node: Node, namespace: str) -> dict[str, Any]:
    """Claims of `namespace` the node still holds: checkpoint entries and CDI files."""
    held = {
        uid: c.get("state")
        for uid, c in checkpoint(node).items()
        if c.get("namespace") == namespace
    }
    for spec in node.cdi_dir.glob("*.json"):
        data = json.loads(spec.read_text())
        if data.get("annotations", {}).get("drasil.dev/claim-namespace") == namespace:
            held[spec.name] = "CDI spec"
    return held

"""MPS control daemons in Pods of their own: the launcher the chart's plugin uses.

A daemon that is a process of the plugin's container shares its PID namespace and
cgroup, so a restart, an OOM kill or a rolling update of the plugin Pod would end it
and every client would lose MPS. Under the chart (``--mps-daemon-image``) each daemon
runs instead in a Pod the plugin creates on its own node, as NVIDIA's DRA driver
does, which outlives the plugin Pod:

- ``nodeName`` this node, one Pod per GPU, named ``drasil-mps-<node>-<hash>`` (the
  hash of the driver and the GPU's UUID, so two drivers' daemons never share a name),
  in the plugin's namespace, labelled ``app.kubernetes.io/component=mps-daemon`` and
  ``drasil.dev/driver=<driver>``, the GPU's UUID in the annotation ``drasil.dev/gpu``;
  no owner: it must outlive the plugin Pod, and the plugin stops it after the last
  share, or sweeps it when no prepared share needs it;
- the plugin's image, the same ``mpsview`` command line the process launcher runs
  but with ``-f``, so the container lives exactly as long as the control daemon; the
  state dir and the driver root mounted at the paths the plugin sees them at, so
  every path in that command line is the same (the state dir with HostToContainer
  propagation: the tmpfs the plugin mounts there reaches the Pod);
- privileged (mounts, ``chroot``) with ``hostPID`` (the MPS server finds its own
  process through ``/proc``; the pid file then names a pid of the node);
  ``restartPolicy: Never``: a daemon that died is seen within seconds by the watch
  (``drasil.kubeletplugin.vendors.nvidia.mps.watch``, one list of the node's Pods a
  look), replaced at the next call, and given its limits again.

The plugin still owns the directories, the tmpfs, the record and the limits
(``MpsDaemons``); this module only creates, finds, watches and deletes Pods, through
the plugin's own API client (``KubeApi``, whose every request has a timeout).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

from drasil.driver.kubeapi import ApiError, KubeApi
from drasil.driver.objects import Pod
from drasil.kubeletplugin.options import MPS_DAEMON_CONTAINER_FIELDS, MPS_DAEMON_POD_FIELDS
from drasil.kubeletplugin.vendors.nvidia.mps.daemons import (
    DAEMON_CALL_BUDGET,
    PID_FILE,
    DaemonSpot,
    Launched,
    MpsError,
    read_pid,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")

NAME_PREFIX: Final = "drasil-mps-"
COMPONENT: Final = "mps-daemon"
COMPONENT_LABEL: Final = "app.kubernetes.io/component"
DRIVER_LABEL: Final = "drasil.dev/driver"
GPU_ANNOTATION: Final = "drasil.dev/gpu"
CONTAINER: Final = "mps-control"
# A call's time for the daemon (daemons.DAEMON_CALL_BUDGET, derived from kubelet's
# call timeout; the wait for the GPU's lock is taken from it): a Pod slower than that
# (an image still being pulled, a node short of Pods) fails the claim's prepare with
# the Pod's state, and kubelet's retry finds the same Pod and waits for it again.
POD_START_TIMEOUT: Final = DAEMON_CALL_BUDGET
POD_STOP_TIMEOUT: Final = 10.0
GRACE_SECONDS: Final = 5
# What a Pod may take from the plugin's configuration; the rest is the launcher's.
POD_FIELDS: Final = frozenset(MPS_DAEMON_POD_FIELDS)
CONTAINER_FIELDS: Final = frozenset(MPS_DAEMON_CONTAINER_FIELDS)
_POLL: Final = 0.2
_FINISHED: Final = ("Succeeded", "Failed")


class PodApi(Protocol):
    """The Pod calls the launcher makes (``KubePods`` over the plugin's ``KubeApi``)."""

    def get_pod(self, namespace: str, name: str) -> Mapping[str, Any] | None: ...

    def list_pods(
        self, namespace: str, *, field_selector: str = ""
    ) -> Sequence[Mapping[str, Any]] | None: ...

    def create_pod(self, namespace: str, pod: Mapping[str, Any]) -> Mapping[str, Any]: ...

    def delete_pod(self, namespace: str, name: str, *, uid: str, grace_seconds: int) -> None: ...


class KubePods:
    """``PodApi`` on the plugin's ``KubeApi``: its reads, and its client for the writes
    (so the same timeouts); objects stay plain JSON."""

    def __init__(self, api: KubeApi) -> None:
        self.api = api

    def get_pod(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        return self.api.get_pod(namespace, name)

    def list_pods(
        self, namespace: str, *, field_selector: str = ""
    ) -> Sequence[Mapping[str, Any]] | None:
        return self.api.list_pods(namespace, field_selector=field_selector)

    def create_pod(self, namespace: str, pod: Mapping[str, Any]) -> Mapping[str, Any]:
        return self._send("POST", f"/api/v1/namespaces/{namespace}/pods", dict(pod))

    def delete_pod(self, namespace: str, name: str, *, uid: str, grace_seconds: int) -> None:
        # The UID precondition: a Pod made again under the name since is not ours to end.
        body = {"gracePeriodSeconds": grace_seconds, "preconditions": {"uid": uid}}
        try:
            self._send("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", body)
        except ApiError as err:
            if err.status not in (404, 409):  # gone already, or another Pod by now
                raise

    def _send(self, method: str, path: str, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """A write as plain JSON through the client's request building (its auth, and
        the timeout ``with_timeouts`` puts on every request), not through its models."""
        client = self.api.api_client
        request = client.param_serialize(
            method,
            path,
            header_params={"Content-Type": "application/json", "Accept": "application/json"},
            body=dict(body),
            auth_settings=["BearerToken"],
        )
        response = client.call_api(*request)
        data = bytes(response.response.data)
        if not 200 <= response.status < 300:
            raise ApiError(
                status=response.status, reason=response.reason, body=data.decode(errors="replace")
            )
        answer: Mapping[str, Any] = json.loads(data)
        return answer


@dataclass(frozen=True)
class DaemonPods:
    """What every daemon Pod of this plugin shares: where, which image, which paths."""

    namespace: str
    node: str
    driver: str
    image: str
    state_dir: Path
    # The driver root as the node has it and where the plugin (so the Pod) sees it.
    driver_root_host: str = "/"
    driver_root_local: Path = Path("/")
    # From the chart: tolerations, priorityClassName, imagePullSecrets (POD_FIELDS),
    # imagePullPolicy and resources (CONTAINER_FIELDS).
    overrides: Mapping[str, Any] = field(default_factory=dict)


def pod_name(node: str, driver: str, gpu_uuid: str) -> str:
    """The GPU's daemon Pod: the node for people, a hash of driver and GPU for
    uniqueness, at most 63 characters (the Pod's hostname is taken from it)."""
    digest = hashlib.sha256(f"{driver}/{gpu_uuid}".encode()).hexdigest()[:12]
    room = 63 - len(NAME_PREFIX) - 1 - len(digest)
    # A node name is a DNS subdomain: cut short it may end in "." or "-", which a
    # name part must not.
    node_part = node[:room].rstrip(".-")
    return f"{NAME_PREFIX}{node_part}-{digest}" if node_part else f"{NAME_PREFIX}{digest}"


def daemon_pod(
    pods: DaemonPods, gpu_uuid: str, command: Sequence[str], env: Mapping[str, str]
) -> dict[str, Any]:
    """The manifest of the GPU's daemon Pod, running ``command`` with ``env``."""
    mounts: list[dict[str, Any]] = [
        {
            "name": "state-dir",
            "mountPath": str(pods.state_dir),
            "mountPropagation": "HostToContainer",
        }
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "state-dir", "hostPath": {"path": str(pods.state_dir), "type": "Directory"}}
    ]
    if pods.driver_root_local != Path("/"):
        mounts.append(
            {
                "name": "driver-root",
                "mountPath": str(pods.driver_root_local),
                "readOnly": True,
                "mountPropagation": "HostToContainer",
            }
        )
        host = {"path": pods.driver_root_host, "type": "Directory"}
        volumes.append({"name": "driver-root", "hostPath": host})
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": pods.image,
        "command": list(command),
        "env": [{"name": name, "value": value} for name, value in sorted(env.items())],
        "securityContext": {"privileged": True, "runAsUser": 0, "runAsGroup": 0},
        "volumeMounts": mounts,
    }
    container |= {k: v for k, v in pods.overrides.items() if k in CONTAINER_FIELDS}
    spec: dict[str, Any] = {
        "nodeName": pods.node,
        "hostPID": True,
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": GRACE_SECONDS,
        "containers": [container],
        "volumes": volumes,
    }
    spec |= {k: v for k, v in pods.overrides.items() if k in POD_FIELDS}
    labels = {
        "app.kubernetes.io/name": "drasil",
        COMPONENT_LABEL: COMPONENT,
        DRIVER_LABEL: pods.driver,
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(pods.node, pods.driver, gpu_uuid),
            "namespace": pods.namespace,
            "labels": labels,
            "annotations": {GPU_ANNOTATION: gpu_uuid},
        },
        "spec": spec,
    }


def describe(pod: Mapping[str, Any]) -> str:
    """What a person needs to see why a daemon Pod is not running: its phase, its
    container's state, the conditions that are not true (e.g. not scheduled)."""
    view = Pod(pod)
    parts = [f"phase {view.phase or 'unknown'}"]
    for container in view.container_statuses:
        for state, detail in (container.get("state") or {}).items():
            if not detail:
                continue
            said = [str(detail[key]) for key in ("reason", "exitCode", "message") if key in detail]
            parts.append(f"container {state}" + (f": {' '.join(said)}" if said else ""))
    for condition in view.conditions:
        if not condition.true and condition.message:
            parts.append(f"{condition.type}: {condition.message}")
    return "; ".join(parts)


class PodLauncher:
    """Each daemon in a Pod of its own on this node (``DaemonLauncher``)."""

    foreground = True

    def __init__(
        self,
        api: PodApi,
        pods: DaemonPods,
        *,
        start_timeout: float = POD_START_TIMEOUT,
        stop_timeout: float = POD_STOP_TIMEOUT,
        poll: float = _POLL,
    ) -> None:
        self.api = api
        self.pods = pods
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.poll = poll

    # ---- DaemonLauncher -----------------------------------------------------------------

    def launch(self, spot: DaemonSpot, command: Sequence[str], env: Mapping[str, str]) -> Launched:
        manifest = daemon_pod(self.pods, spot.gpu_uuid, command, env)
        name = manifest["metadata"]["name"]
        try:
            created = self._call("create", name, lambda: self.api.create_pod(self.ns, manifest))
        except _Exists:  # made by a call that crashed before it could wait for it
            found = self._get(name)
            if found is None:
                raise MpsError(f"MPS daemon Pod {self.ns}/{name}: deleted while starting") from None
            created = found
        log.info("MPS daemon Pod created", extra={"gpu": spot.gpu_uuid, "pod": name})
        return self._wait_ready(spot, name, str(created["metadata"]["uid"]))

    def adopt(self, spot: DaemonSpot, *, ready: bool = True) -> Launched | None:
        """The GPU's Pod if it runs or is starting (waited for, if ``ready``); a
        finished or terminating one is deleted first, so a new one can take the name."""
        name = self._name(spot.gpu_uuid)
        pod = self._get(name)
        if pod is None:
            return None
        uid = str(pod["metadata"]["uid"])
        phase = Pod(pod).phase
        if pod["metadata"].get("deletionTimestamp") or phase in _FINISHED:
            log.info(
                "MPS daemon Pod ended; replacing it",
                extra={"gpu": spot.gpu_uuid, "pod": name, "state": describe(pod)},
            )
            self._delete(name, uid)
            if not self._wait_gone(name, uid, self.stop_timeout + GRACE_SECONDS):
                raise MpsError(f"MPS daemon Pod {self.ns}/{name} is still terminating; try again")
            return None
        if not ready:
            return Launched(read_pid(spot.pipe_dir / PID_FILE) or 0, 0, name, uid)
        return self._wait_ready(spot, name, uid)

    def alive(self, launched: Launched) -> bool:
        """The recorded Pod (same UID) still runs: with ``restartPolicy: Never`` its
        container is the control daemon, so a running Pod is a running daemon."""
        if launched.pod is None:
            return False
        pod = self._get(launched.pod)
        return (
            pod is not None
            and pod["metadata"].get("uid") == launched.pod_uid
            and not pod["metadata"].get("deletionTimestamp")
            and Pod(pod).phase == "Running"
        )

    def alive_all(self, launched: Sequence[Launched]) -> list[bool]:
        """``alive`` of each from one list of this node's Pods (the watch looks every
        few seconds: one request per look, not one per GPU)."""
        if not launched:
            return []
        selector = f"spec.nodeName={self.pods.node}"
        found = self._call("list", "", lambda: self.api.list_pods(self.ns, field_selector=selector))
        if found is None:  # may not list: read each
            return [self.alive(one) for one in launched]
        running = {
            (str(meta.get("name")), str(meta.get("uid")))
            for pod in found
            if not (meta := pod.get("metadata") or {}).get("deletionTimestamp")
            and Pod(pod).phase == "Running"
        }
        return [(one.pod, one.pod_uid) in running for one in launched]

    def end(self, spot: DaemonSpot, launched: Launched) -> None:
        """After ``quit`` the container exits on its own; the Pod is deleted either way
        (a daemon that ignored ``quit`` ends with the grace period) and waited for."""
        if launched.pod is None or launched.pod_uid is None:
            return
        name, uid = launched.pod, launched.pod_uid
        self._wait_finished(name, uid)
        self._delete(name, uid)
        if not self._wait_gone(name, uid, self.stop_timeout + GRACE_SECONDS):
            # The API server has the deletion; kubelet finishes it when it can.
            log.warning("MPS daemon Pod not gone yet", extra={"gpu": spot.gpu_uuid, "pod": name})

    def others(self) -> list[str]:
        """GPUs of this driver's daemon Pods on this node."""
        selector = f"spec.nodeName={self.pods.node}"
        found = self._call("list", "", lambda: self.api.list_pods(self.ns, field_selector=selector))
        if found is None:
            log.warning("may not list Pods: daemon Pods not swept", extra={"namespace": self.ns})
            return []
        gpus = []
        for pod in found:
            meta = pod.get("metadata") or {}
            labels = meta.get("labels") or {}
            gpu = (meta.get("annotations") or {}).get(GPU_ANNOTATION)
            ours = labels.get(COMPONENT_LABEL) == COMPONENT
            if ours and labels.get(DRIVER_LABEL) == self.pods.driver and gpu:
                gpus.append(str(gpu))
        return sorted(gpus)

    # ---- waiting ------------------------------------------------------------------------

    def _wait_ready(self, spot: DaemonSpot, name: str, uid: str) -> Launched:
        """Until the Pod runs and its daemon answers a control command (bounded)."""
        bound = spot.bound(self.start_timeout)
        deadline = time.monotonic() + bound
        pod: Mapping[str, Any] | None = None
        while pod is None or time.monotonic() < deadline:  # looked at once at least
            pod = self._get(name)
            if pod is None or pod["metadata"].get("uid") != uid:
                raise MpsError(f"MPS daemon Pod {self.ns}/{name} of GPU {spot.gpu_uuid} vanished")
            phase = Pod(pod).phase
            if phase in _FINISHED:
                raise MpsError(
                    f"MPS daemon Pod {self.ns}/{name} of GPU {spot.gpu_uuid} ended: "
                    f"{describe(pod)}; see {spot.log_dir}"
                )
            pid = read_pid(spot.pipe_dir / PID_FILE)
            if phase == "Running" and pid is not None and spot.answers():
                return Launched(pid, 0, name, uid)
            time.sleep(max(0.0, min(self.poll, deadline - time.monotonic())))
        raise MpsError(
            f"MPS daemon Pod {self.ns}/{name} of GPU {spot.gpu_uuid} not answering within "
            f"{bound:.3g}s: {describe(pod)}; it is left starting; see {spot.log_dir} and "
            f"`kubectl -n {self.ns} describe pod {name}`"
        )

    def _wait_finished(self, name: str, uid: str) -> None:
        deadline = time.monotonic() + self.stop_timeout
        while time.monotonic() < deadline:
            pod = self._get(name)
            if pod is None or pod["metadata"].get("uid") != uid:
                return
            if Pod(pod).phase in _FINISHED:
                return
            time.sleep(self.poll)
        log.warning("MPS daemon Pod did not quit; deleting it", extra={"pod": name})

    def _wait_gone(self, name: str, uid: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while (pod := self._get(name)) is not None and pod["metadata"].get("uid") == uid:
            if time.monotonic() > deadline:
                return False
            time.sleep(self.poll)
        return True

    # ---- calls --------------------------------------------------------------------------

    @property
    def ns(self) -> str:
        return self.pods.namespace

    def _name(self, gpu_uuid: str) -> str:
        return pod_name(self.pods.node, self.pods.driver, gpu_uuid)

    def _get(self, name: str) -> Mapping[str, Any] | None:
        return self._call("read", name, lambda: self.api.get_pod(self.ns, name))

    def _delete(self, name: str, uid: str) -> None:
        self._call(
            "delete",
            name,
            lambda: self.api.delete_pod(self.ns, name, uid=uid, grace_seconds=GRACE_SECONDS),
        )

    def _call(self, verb: str, name: str, call: Callable[[], _T]) -> _T:
        """An API call whose failure is the claim's error (kubelet retries), with the Pod
        and what the API server said."""
        try:
            return call()
        except ApiError as err:
            if verb == "create" and err.status == 409:
                raise _Exists from err
            hint = ""
            if err.status == 403:
                hint = f" (the plugin's Role in namespace {self.ns} must allow it)"
            raise MpsError(
                f"MPS daemon Pod {self.ns}/{name}: {verb}: {err.status} {err.reason}{hint}"
            ) from err
        except Exception as err:  # the client's transport errors come in several types
            raise MpsError(f"MPS daemon Pod {self.ns}/{name}: {verb}: {err}") from err


class _Exists(Exception):
    """create: a Pod of that name exists already."""

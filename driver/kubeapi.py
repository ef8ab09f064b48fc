"""The Kubernetes API calls drasil makes, on plain JSON objects.

The kubernetes v37 models drop fields they do not know when they deserialize
(docs/design.md#decisions), so everything here goes through the custom-objects API and
returns the server's JSON as dicts: nothing is lost, and nothing we do not own is
ever read-modified-replaced.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import ssl
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final, TypeAlias, cast
from urllib.parse import urlencode

import urllib3
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException
from kubernetes.config import ConfigException

from drasil.api.devicepool import GROUP as DEVICEPOOL_GROUP
from drasil.api.devicepool import PLURAL as DEVICEPOOL_PLURAL
from drasil.api.devicepool import VERSION as DEVICEPOOL_VERSION
from drasil.driver.apierrors import ApiUnavailable, ConflictError, InvalidName
from drasil.driver.keptalive import KeptAliveGets
from drasil.driver.objects import JsonDict

log = logging.getLogger(__name__)

__all__ = ["ApiError", "ApiUnavailable", "ConflictError", "InvalidName", "KubeApi"]

# The client's names the rest of drasil needs, so that this module stays the one
# importer of ``kubernetes`` (an import-linter contract in pyproject.toml).
ApiClient: TypeAlias = client.ApiClient
ApiError = ApiException
"""An API call that failed; ``.status`` is the HTTP status."""
KubeconfigError = ConfigException
"""No usable kubeconfig (or in-cluster service account)."""

RESOURCE_GROUP = "resource.k8s.io"
RESOURCE_VERSION = "v1"
# PodGroups (Workload API, feature gate GenericWorkload; beta in 1.37).
POD_GROUP_API = "scheduling.k8s.io/v1beta1"
LEASE_API: Final = ("coordination.k8s.io", "v1", "leases")


def _leases(namespace: str) -> tuple[str, str, str, str]:
    """The custom-objects API's (group, version, namespace, plural) of Leases."""
    group, version, plural = LEASE_API
    return group, version, namespace, plural


API_TIMEOUT: Final = (5.0, 20.0)
"""Seconds to connect and between two reads of a response, for every request that
does not set its own (watches do): a hung API server must cost a caller one timeout,
never a thread forever."""

KEPT_CONNECTIONS: Final = 32
"""Kept-alive connections to the API server, at least: one per gRPC thread of the
kubelet plugin's DRA socket (``drasil.kubeletplugin.sockets``)."""

# The same bounds as API_TIMEOUT and with_timeouts' retries, for the plain GETs.
_GET_TIMEOUT: Final = urllib3.Timeout(connect=API_TIMEOUT[0], read=API_TIMEOUT[1])
_GET_RETRIES: Final = urllib3.Retry(total=2, read=0)

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


_TIMED: weakref.WeakSet[Any] = weakref.WeakSet()  # REST clients already wrapped


def _unavailable(host: str, err: Exception) -> ApiUnavailable:
    # urllib3 wraps the cause in .reason; an ssl error's .reason is only its code.
    reason = err if isinstance(err, ssl.SSLError) else getattr(err, "reason", None) or err
    if "timed out" in str(reason).lower():
        return ApiUnavailable(
            f"the API server at {host} did not answer within {API_TIMEOUT[1]:g} s"
        )
    return ApiUnavailable(f"the API server at {host} cannot be reached: {reason}")


def with_timeouts(api_client: client.ApiClient) -> client.ApiClient:
    """``api_client`` with ``API_TIMEOUT`` on every request that sets no timeout.

    The generated client sends a request without any timeout unless each call passes
    ``_request_timeout``; wrapping its one request method covers every call, including
    those made by code we do not own (the Lease and status calls of the controller).
    """
    rest = api_client.rest_client
    if rest in _TIMED:
        return api_client
    request: Callable[..., Any] = rest.request

    def timed(*args: Any, _request_timeout: Any = None, **kwargs: Any) -> Any:
        return request(*args, _request_timeout=_request_timeout or API_TIMEOUT, **kwargs)

    rest.request = timed  # type: ignore[method-assign]
    # urllib3 retries a timed-out read of a GET three times: four timeouts in a row
    # would outlast kubelet's 45 s deadline. Connections are still retried.
    rest.pool_manager.connection_pool_kw["retries"] = urllib3.Retry(total=2, read=0)
    # The client keeps 5 connections per CPU; past that many concurrent callers each
    # further request opens, TLS-handshakes and discards a connection of its own (a
    # burst of prepares on a 2-CPU node paid a handshake a claim).
    kept = rest.pool_manager.connection_pool_kw.get("maxsize") or 1
    rest.pool_manager.connection_pool_kw["maxsize"] = max(kept, KEPT_CONNECTIONS)
    rest.pool_manager.clear()  # pools made before this get the new size when remade
    _TIMED.add(rest)
    return api_client


def load_api_client(kubeconfig: str | None) -> client.ApiClient:
    """An API client from a kubeconfig file, or the in-cluster service account."""
    if kubeconfig:
        api: client.ApiClient = config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig
        )
        return with_timeouts(api)
    config.load_incluster_config()  # type: ignore[no-untyped-call]
    return with_timeouts(client.ApiClient())


def load_user_api_client(kubeconfig: str | None) -> client.ApiClient:
    """A person at a terminal: ``kubeconfig``, else ``$KUBECONFIG`` or ``~/.kube/config``.

    Never the in-cluster service account, even inside a Pod.
    """
    api: client.ApiClient = config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=kubeconfig
    )
    return with_timeouts(api)


def checked_name(value: str, *, what: str, label: bool = False) -> str:
    """``value`` if it can name a Kubernetes object (DNS subdomain; namespaces: DNS
    label), else ``InvalidName``: such text must never become part of a URL path."""
    limit, pattern = (63, _DNS_LABEL) if label else (253, _DNS_SUBDOMAIN)
    if not (0 < len(value) <= limit and pattern.fullmatch(value)):
        kind = "DNS label" if label else "DNS subdomain"
        raise InvalidName(
            f"{what} {value!r} is not a valid name: a {kind} of at most {limit} "
            "characters (lower-case letters, digits, '-'" + ("" if label else ", '.'") + ")"
        )
    return value


def _or_none(err: ApiException) -> None:
    if err.status != 404:
        raise err


class KubeApi:
    """Typed wrappers over the few endpoints the daemons use."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = with_timeouts(api_client)
        self._pool = self.api_client.rest_client.pool_manager
        gets = KeptAliveGets(
            self.api_client.configuration,
            connect_timeout=API_TIMEOUT[0],
            read_timeout=API_TIMEOUT[1],
        )
        self._gets = gets if gets.usable else None
        # The generated clients stay inside: callers get typed methods, so every call
        # drasil makes is listed here (and its timeout is ``with_timeouts``').
        self._custom = client.CustomObjectsApi(api_client)
        self._core = client.CoreV1Api(api_client)

    # ---- ResourceClaims ---------------------------------------------------------

    def get_claim(
        self, namespace: str, name: str, *, cached: bool = False
    ) -> Mapping[str, Any] | None:
        """The claim as JSON, or None. ``cached`` reads the API server's watch cache
        (``resourceVersion=0``): about a millisecond faster, possibly a moment old.
        Raises ``InvalidName`` for names no claim can have."""
        checked_name(namespace, what="namespace", label=True)
        checked_name(name, what="ResourceClaim name")
        path = (
            f"/apis/{RESOURCE_GROUP}/{RESOURCE_VERSION}/namespaces/{namespace}"
            f"/resourceclaims/{name}"
        )
        return self._get_json(path, query=[("resourceVersion", "0")] if cached else [])

    def _get_json(self, path: str, *, query: list[tuple[str, str]]) -> JsonDict | None:
        # A plain GET, not the generated client's request building: this is on
        # kubelet's prepare path. Over this thread's own kept-alive connection
        # (``drasil.driver.keptalive``), or the client's pool when there is a proxy.
        path += f"?{urlencode(query)}" if query else ""
        status, reason, data = self._get(path)
        if status == 404:
            return None
        if status >= 300:
            raise ApiException(status=status, reason=reason)
        return cast(JsonDict, json.loads(data))

    def _get(self, path: str) -> tuple[int, str, bytes]:
        host = self.api_client.configuration.host
        if self._gets is not None:
            try:
                answer = self._gets.get(path, self._headers())
            except (OSError, http.client.HTTPException) as err:
                raise _unavailable(host, err) from None
            return answer.status, answer.reason, answer.data
        try:
            response = self._pool.request(
                "GET",
                host + path,
                headers=self._headers(),
                timeout=_GET_TIMEOUT,
                retries=_GET_RETRIES,
                preload_content=True,
            )
        except urllib3.exceptions.HTTPError as err:
            raise _unavailable(host, err) from None
        return response.status, str(response.reason), bytes(response.data)

    def _headers(self) -> dict[str, str]:
        """Accept and, when the identity is a token, Authorization (read per call: a
        kubeconfig's exec plugin or the service account may rotate it)."""
        headers = {"Accept": "application/json"}
        for auth in self.api_client.configuration.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                headers[auth["key"]] = auth["value"]
        return headers

    # ---- ResourceSlices ---------------------------------------------------------

    def list_slices(self, *, driver: str, pool: str) -> list[JsonDict]:
        """The slices of one pool of one driver (field selectors, server-side)."""
        result = self._custom.list_cluster_custom_object(
            RESOURCE_GROUP,
            RESOURCE_VERSION,
            "resourceslices",
            field_selector=f"spec.driver={driver},spec.pool.name={pool}",
        )
        return list(cast(JsonDict, result).get("items", []))

    def watch_slices(self, *, field_selector: str, timeout_seconds: int) -> Iterator[str]:
        """Event types (ADDED, MODIFIED, DELETED) of the selected slices, until the
        server ends the watch after about ``timeout_seconds``."""
        stream = watch.Watch().stream(  # type: ignore[no-untyped-call]
            self._custom.list_cluster_custom_object,
            RESOURCE_GROUP,
            RESOURCE_VERSION,
            "resourceslices",
            field_selector=field_selector,
            timeout_seconds=timeout_seconds,
            # The server ends the watch; a hung one must not hold the thread past it.
            _request_timeout=(API_TIMEOUT[0], timeout_seconds + API_TIMEOUT[1]),
        )
        for event in stream:
            yield str(event["type"])

    def create_slice(self, obj: Mapping[str, Any]) -> JsonDict:
        return self._write(
            lambda: self._custom.create_cluster_custom_object(
                RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices", dict(obj)
            )
        )

    def replace_slice(self, obj: Mapping[str, Any]) -> JsonDict:
        """PUT with the resourceVersion the planner copied in: fails on a concurrent write."""
        name = obj["metadata"]["name"]
        return self._write(
            lambda: self._custom.replace_cluster_custom_object(
                RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices", name, dict(obj)
            )
        )

    def delete_slice(self, name: str, *, uid: str, resource_version: str) -> None:
        body = client.V1DeleteOptions(
            preconditions=client.V1Preconditions(uid=uid, resource_version=resource_version)
        )
        try:
            self._custom.delete_cluster_custom_object(
                RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices", name, body=body
            )
        except ApiException as err:
            if err.status == 404:
                return  # already gone: the goal of a delete
            if err.status in (409, 412):
                raise ConflictError(f"ResourceSlice {name} changed: {err.reason}") from err
            raise

    def dry_run_slice(self, obj: Mapping[str, Any], *, create: bool) -> None:
        """Create (or replace) the slice as a server-side dry run: ``ApiError`` 422
        says what the API server would reject, and nothing is written."""
        group, version, plural = RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices"
        if create:
            self._custom.create_cluster_custom_object(
                group, version, plural, dict(obj), dry_run="All"
            )
            return
        name = str(obj["metadata"]["name"])
        self._custom.replace_cluster_custom_object(
            group, version, plural, name, dict(obj), dry_run="All"
        )

    # ---- resource.k8s.io lists and claim status ---------------------------------

    def list_resources(
        self, plural: str, *, field_selector: str = "", label_selector: str = ""
    ) -> list[JsonDict]:
        """Every object of a cluster-wide list of resource.k8s.io/v1 (``plural``:
        ``resourceslices``, ``resourceclaims``, ``deviceclasses``, ...)."""
        result = self._custom.list_cluster_custom_object(
            RESOURCE_GROUP,
            RESOURCE_VERSION,
            plural,
            field_selector=field_selector or None,
            label_selector=label_selector or None,
        )
        return list(cast(JsonDict, result).get("items") or [])

    def apply_claim_device_status(
        self, namespace: str, name: str, entries: Sequence[Mapping[str, Any]], *, manager: str
    ) -> None:
        """Server-side apply of the claim's ``status.devices`` holding exactly
        ``entries`` under field manager ``manager`` (other writers' entries stay)."""
        body = {
            "apiVersion": f"{RESOURCE_GROUP}/{RESOURCE_VERSION}",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "status": {"devices": list(entries)},
        }
        self._custom.patch_namespaced_custom_object_status(
            RESOURCE_GROUP,
            RESOURCE_VERSION,
            namespace,
            "resourceclaims",
            name,
            body,
            field_manager=manager,
            force=True,
            _content_type="application/apply-patch+yaml",
        )

    # ---- DevicePools (drasil.dev/v1alpha1) --------------------------------------

    def get_device_pool(self, name: str) -> JsonDict | None:
        """A DevicePool as JSON from the watch cache, or None (no such pool, or the CRD
        is not installed). Raises ``InvalidName`` for names no object can have."""
        checked_name(name, what="DevicePool name")
        path = f"/apis/{DEVICEPOOL_GROUP}/{DEVICEPOOL_VERSION}/{DEVICEPOOL_PLURAL}/{name}"
        return self._get_json(path, query=[("resourceVersion", "0")])

    def patch_devicepool_status(self, name: str, patch: Mapping[str, Any]) -> bool:
        """Merge-patch a DevicePool's status; False when the pool is gone."""
        try:
            self._custom.patch_cluster_custom_object_status(
                DEVICEPOOL_GROUP, DEVICEPOOL_VERSION, DEVICEPOOL_PLURAL, name, dict(patch)
            )
        except ApiException as err:
            _or_none(err)
            return False
        return True

    # ---- Leases (coordination.k8s.io/v1) ----------------------------------------

    def get_lease(self, namespace: str, name: str, *, timeout: float) -> JsonDict | None:
        try:
            lease = self._custom.get_namespaced_custom_object(
                *_leases(namespace), name, _request_timeout=timeout
            )
        except ApiException as err:
            _or_none(err)
            return None
        return cast(JsonDict, lease)

    def create_lease(self, namespace: str, body: Mapping[str, Any], *, timeout: float) -> None:
        self._custom.create_namespaced_custom_object(
            *_leases(namespace), dict(body), _request_timeout=timeout
        )

    def replace_lease(
        self, namespace: str, name: str, body: Mapping[str, Any], *, timeout: float
    ) -> None:
        """PUT with the body's resourceVersion: a concurrent write is ``ApiError`` 409."""
        self._custom.replace_namespaced_custom_object(
            *_leases(namespace), name, dict(body), _request_timeout=timeout
        )

    def _write(self, call: Any) -> JsonDict:
        try:
            return cast(JsonDict, call())
        except ApiException as err:
            if err.status in (409, 412):
                raise ConflictError(f"{err.status} {err.reason}") from err
            raise

    # ---- Nodes, Pods and Events -------------------------------------------------

    def list_nodes(self) -> list[JsonDict] | None:
        """Every Node (from the API server's watch cache), or None when this identity
        may not list them."""
        return self._list_json("/api/v1/nodes", query=[("resourceVersion", "0")])

    def get_pod_group(self, namespace: str, name: str) -> JsonDict | None:
        """A PodGroup as JSON from the watch cache, or None (none of that name, or the
        API is not served). Raises ``InvalidName`` for names no object can have."""
        checked_name(namespace, what="namespace", label=True)
        checked_name(name, what="PodGroup name")
        path = f"/apis/{POD_GROUP_API}/namespaces/{namespace}/podgroups/{name}"
        return self._get_json(path, query=[("resourceVersion", "0")])

    def get_pod(self, namespace: str, name: str) -> JsonDict | None:
        checked_name(namespace, what="namespace", label=True)
        checked_name(name, what="Pod name")
        return self._get_json(f"/api/v1/namespaces/{namespace}/pods/{name}", query=[])

    def list_pods(self, namespace: str, *, field_selector: str = "") -> list[JsonDict] | None:
        """The namespace's Pods (those matching ``field_selector``, filtered by the API
        server), or None when this identity may not list them."""
        checked_name(namespace, what="namespace", label=True)
        query = [("fieldSelector", field_selector)] if field_selector else []
        return self._list_json(f"/api/v1/namespaces/{namespace}/pods", query=query)

    def list_everywhere(self, path: str, *, page: int = 500) -> list[JsonDict] | None:
        """Every object of a list path (``/apis/apps/v1/deployments``: all namespaces),
        read in pages of `page`; None when this identity may not list them."""
        items: list[JsonDict] = []
        token = ""
        while True:
            query = [("limit", str(page))] + ([("continue", token)] if token else [])
            try:
                data = self._get_json(path, query=query) or {}
            except ApiException as err:
                if err.status == 403:
                    return None
                raise
            items.extend(data.get("items") or [])
            token = str((data.get("metadata") or {}).get("continue") or "")
            if not token:
                return items

    def _list_json(self, path: str, *, query: list[tuple[str, str]]) -> list[JsonDict] | None:
        # Optional reads (explanations): a user's RBAC may not allow them.
        try:
            data = self._get_json(path, query=query)
        except ApiException as err:
            if err.status == 403:
                return None
            raise
        return list((data or {}).get("items") or [])

    def get_node_uid(self, name: str) -> str | None:
        try:
            node = self._core.read_node(name)
        except ApiException as err:
            _or_none(err)
            return None
        return node.metadata.uid if node.metadata else None

    def get_node_allocatable(self, name: str) -> dict[str, str] | None:
        """The Node's ``status.allocatable`` (resource -> quantity), or None when there
        is no such Node."""
        try:
            node = self._core.read_node(name)
        except ApiException as err:
            _or_none(err)
            return None
        status = node.status
        return {k: str(v) for k, v in (status.allocatable or {}).items()} if status else {}

    def patch_node_labels(self, name: str, labels: Mapping[str, str | None]) -> bool:
        """Merge-patch the Node's labels (None removes one); False when it is gone."""
        try:
            self._core.patch_node(name, {"metadata": {"labels": dict(labels)}})
        except ApiException as err:
            _or_none(err)
            return False
        return True

    def get_node_labels(self, name: str) -> dict[str, str] | None:
        """The Node's labels, or None when there is no such Node."""
        try:
            node = self._core.read_node(name)
        except ApiException as err:
            _or_none(err)
            return None
        return dict(node.metadata.labels or {}) if node.metadata else {}

    def post_event(
        self,
        *,
        involved: Mapping[str, str],
        reason: str,
        message: str,
        event_type: str = "Warning",
        component: str = "drasil",
        name: str | None = None,
    ) -> bool:
        """A core/v1 Event about ``involved`` (kind, name, namespace, uid, apiVersion);
        whether it was created. With ``name`` the Event is posted once under that name:
        an Event already there (another process posted it) is left as it is."""
        namespace = involved.get("namespace") or "default"
        now = datetime.now(UTC)
        meta = (
            client.V1ObjectMeta(name=name)
            if name
            else client.V1ObjectMeta(generate_name=f"{involved['name']}.")
        )
        event = client.CoreV1Event(
            metadata=meta,
            involved_object=client.V1ObjectReference(**_reference(involved)),
            reason=reason,
            message=message[:1024],
            type=event_type,
            source=client.V1EventSource(component=component),
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        try:
            self._core.create_namespaced_event(namespace, event)
        except ApiException as err:  # events are best effort; never fail the caller
            if err.status == 409 and name:
                log.debug("event already posted", extra={"reason": reason, "event": name})
            else:
                log.warning("could not post event", extra={"reason": reason, "error": str(err)})
            return False
        return True


def _reference(involved: Mapping[str, str]) -> dict[str, str]:
    keys = {"kind": "kind", "name": "name", "namespace": "namespace", "uid": "uid"}
    keys["apiVersion"] = "api_version"
    return {ours: involved[theirs] for theirs, ours in keys.items() if involved.get(theirs)}

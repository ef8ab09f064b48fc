"""kopf is configured so that it never writes onto the objects it watches."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, cast

import kopf
from kubernetes import client

from drasil.controller.controller import Controller
from drasil.controller.kopfstorage import (
    EventOnlyMemories,
    MemoryDiffBaseStorage,
    MemoryProgressStorage,
)
from drasil.controller.metrics import ControllerMetrics
from drasil.controller.operator import FINALIZER, connection_info, registry, settings
from drasil.controller.options import parse_options
from drasil.driver.kubeapi import KubeApi


def api_client() -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = "https://127.0.0.1:6443"
    configuration.ssl_ca_cert = "/ca.crt"
    configuration.cert_file = "/admin.crt"
    configuration.key_file = "/admin.key"
    configuration.api_key = {"BearerToken": "abc"}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    return client.ApiClient(configuration)


def test_settings_keep_state_in_memory_and_post_nothing() -> None:
    s = settings()

    assert isinstance(s.persistence.progress_storage, MemoryProgressStorage)
    assert isinstance(s.persistence.diffbase_storage, MemoryDiffBaseStorage)
    assert s.persistence.finalizer == FINALIZER == "drasil.dev/controller"
    assert s.posting.enabled is False
    assert s.peering.standalone is True
    assert s.queueing.idle_timeout == 0.1  # workers do not hold their last event for long
    assert s.watching.chunk_size == 100  # lists are read a page at a time


def test_only_pods_that_wait_to_be_scheduled_are_watched() -> None:
    """The API server filters bound Pods out of the controller's Pod watch and list;
    no other kind is filtered."""
    s = settings()
    pods = kopf.Resource("", "v1", "pods", kind="Pod", namespaced=True)
    claims = kopf.Resource("resource.k8s.io", "v1", "resourceclaims", kind="ResourceClaim")

    assert s.watching.field_selectors.collect(pods) == ["spec.nodeName="]
    assert s.watching.field_selectors.collect(claims) == []
    assert s.watching.label_selectors.collect(pods) == []


def test_only_event_handlers_are_registered() -> None:
    opts = parse_options(["--kubeconfig=/dev/null"], env={})
    controller = Controller(api=KubeApi(api_client()), options=opts, metrics=ControllerMetrics())

    r = registry(controller, api_client())

    watching = [h.id for h in r._watching.get_all_handlers()]
    assert sorted(watching) == sorted(
        [
            "devicepools",
            "resourceclaims",
            "resourceclaimtemplates",
            "resourceslices",
            "deviceclasses",
            "devicetaintrules",
            "pods",
        ]
    )
    # Change handlers, daemons and timers are what make kopf persist state and add
    # finalizers; there must be none. They are also the only readers of the essence
    # that kopfstorage.MemoryDiffBaseStorage.build leaves empty: adding one means
    # removing that override first.
    assert list(r._changing.get_all_handlers()) == []
    assert list(r._spawning.get_all_handlers()) == []


def test_connection_info_comes_from_our_kubeconfig() -> None:
    info = connection_info(api_client())

    assert info.server == "https://127.0.0.1:6443"
    assert (info.ca_path, info.certificate_path, info.private_key_path) == (
        "/ca.crt",
        "/admin.crt",
        "/admin.key",
    )
    assert (info.scheme, info.token) == ("Bearer", "abc")


def _body(uid: str) -> kopf.Body:
    return kopf.Body({"metadata": {"uid": uid}})


def test_memory_progress_storage_round_trip_and_never_touches() -> None:
    storage = MemoryProgressStorage()
    patch = kopf.Patch()
    record: Any = {"started": "t", "retries": 1}

    storage.store(key=kopf.HandlerId("h"), record=record, body=_body("u1"), patch=patch)
    assert storage.fetch(key=kopf.HandlerId("h"), body=_body("u1")) == record
    assert storage.fetch(key=kopf.HandlerId("h"), body=_body("u2")) is None
    storage.touch(body=_body("u1"), patch=patch, value="x")
    storage.purge(key=kopf.HandlerId("h"), body=_body("u1"), patch=patch)
    assert storage.fetch(key=kopf.HandlerId("h"), body=_body("u1")) is None
    assert not patch


def test_memory_diffbase_storage_round_trip() -> None:
    storage = MemoryDiffBaseStorage()
    patch = kopf.Patch()
    essence: Any = {"spec": {"a": 1}}

    storage.store(body=_body("u1"), patch=patch, essence=essence)

    assert storage.fetch(body=_body("u1")) == essence
    assert storage.fetch(body=_body("u2")) is None
    assert len(storage) == 1
    assert not patch


def test_no_essence_is_built_from_an_event() -> None:
    # kopf deep-copies each event's object into an essence for change handlers'
    # diffs; there are none, so the copy is not made.
    body = kopf.Body({"metadata": {"uid": "u1", "labels": {"a": "b"}}, "spec": {"x": [1]}})

    assert MemoryDiffBaseStorage().build(body=body) == {}


def test_kopf_keeps_no_memory_per_object_between_events() -> None:
    memories = EventOnlyMemories()
    body = cast(kopf.RawBody, {"metadata": {"uid": "u1", "name": "p", "namespace": "ns"}})

    async def recall_twice() -> tuple[object, object]:
        first = await memories.recall(body, noticed_by_listing=True)
        return first, await memories.recall(body)

    first, second = asyncio.run(recall_twice())

    assert first is not second
    assert list(memories.iter_all_memories()) == []
    # run_operator hands it to kopf.operator, which must still take it.
    assert "memories" in inspect.signature(kopf.operator).parameters

"""kopf, configured so that it only watches: event handlers, memory storage, no posting.

kopf is the controller's watch machinery (list, watch, re-list, per-object queues).
It is kept from writing anything onto the objects it watches (docs/design.md#decisions):

- only ``@kopf.on.event`` handlers are registered: no change handlers, daemons or
  timers, so kopf has no progress to persist and no reason to add a finalizer;
- progress and diff-base storage live in memory (``kopfstorage``), should that ever
  change; the finalizer name is ours, so a stray one would at least say who added it;
- kopf's own Events about handler runs are off (``posting.enabled``): the controller
  posts its own, deduplicated;
- no KopfPeering: the Lease in ``leader`` decides which replica runs kopf at all.

kopf logs in with the same kubeconfig (or service account) as the rest of the
controller, not with whatever its default discovery finds.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from drasil.api.devicepool import API_VERSION as DEVICEPOOL_API
from drasil.api.devicepool import PLURAL as DEVICEPOOL_PLURAL
from drasil.controller.controller import Controller
from drasil.controller.kopfstorage import (
    EventOnlyMemories,
    MemoryDiffBaseStorage,
    MemoryProgressStorage,
)
from drasil.driver.kubeapi import ApiClient

FINALIZER = "drasil.dev/controller"
RESOURCE_API = "resource.k8s.io/v1"
LIST_CHUNK = 100  # objects per page of kopf's lists (settings: why)
UNSCHEDULED_PODS = "spec.nodeName="  # the Pods the controller watches (settings: why)


def settings() -> kopf.OperatorSettings:
    s = kopf.OperatorSettings()
    s.persistence.finalizer = FINALIZER
    s.persistence.progress_storage = MemoryProgressStorage()
    s.persistence.diffbase_storage = MemoryDiffBaseStorage()
    s.posting.enabled = False
    s.peering.standalone = True
    s.peering.mandatory = False
    # A stuck shutdown should not outlive a Pod's grace period by ten minutes.
    s.process.ultimate_exiting_timeout = 60.0
    # Every request and watch ends in bounded time, even against a hung API server.
    s.networking.connect_timeout = 10.0
    s.networking.request_timeout = 60.0
    s.watching.connect_timeout = 10.0
    s.watching.server_timeout = 300
    s.watching.client_timeout = 330
    # kopf runs one worker task per object with events, and a worker waits this long
    # for the object's next event before it ends, holding the last event it handled:
    # a whole parsed Pod or claim (10 to 20 KiB). Its default of 5 s keeps thousands of
    # them alive through a burst of Pods, and even 1 s kept the parsed slices of the
    # first list and the events of a wave long enough to leave pymalloc arenas partly
    # used for good: at 500 nodes 0.1 s took the RSS after scheduling from 125 to 108
    # MiB, for a new worker per event of an object whose events come further apart
    # (docs/scale.md, "A worker per event").
    s.queueing.idle_timeout = 0.1
    # kopf lists every kind before it watches it, at start and again whenever a watch
    # has fallen too far behind. Listed whole, 500 ResourceSlices or 4,000 Pods are one
    # response of megabytes parsed at once, tens of MiB of Python objects for a moment;
    # the pages they took stay the process's long after (what is kept later lands
    # between them). In chunks, kopf hands one chunk's objects to their workers while
    # it asks for the next, and holds one chunk at a time.
    s.watching.chunk_size = LIST_CHUNK
    # Pods matter to the controller while they wait to be scheduled: it explains their
    # claims and warns them of bad configs. The API server filters the rest out, so
    # the controller parses no event of a bound Pod (kubelet's status updates, a Pod's
    # whole life on its node) and keeps nothing of it: its Pod events and memory follow
    # the Pods that wait, not the cluster's size. A Pod that gets a node leaves the
    # watch with a DELETED event, as if it were gone.
    s.watching.field_selectors["v1", "pods"] = UNSCHEDULED_PODS
    return s


def connection_info(api_client: ApiClient) -> kopf.ConnectionInfo:
    """kopf credentials from a configured kubernetes client (as kopf.login_via_client)."""
    cfg = api_client.configuration
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix(
        "authorization"
    )
    parts = header.split(" ", 1) if header else []
    scheme, token = (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0] if parts else None)
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        scheme=scheme,
        token=token,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


def registry(controller: Controller, api_client: ApiClient) -> kopf.OperatorRegistry:
    """The handlers: one event handler per watched kind, and the login."""
    r = kopf.OperatorRegistry()

    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(api_client)

    kopf.on.login(registry=r, id="login")(login)
    watched = (
        (DEVICEPOOL_API, DEVICEPOOL_PLURAL, controller.on_pool),
        (RESOURCE_API, "resourceclaims", controller.on_claim),
        (RESOURCE_API, "resourceclaimtemplates", controller.on_template),
        (RESOURCE_API, "resourceslices", controller.on_slice),
        (RESOURCE_API, "deviceclasses", controller.on_class),
        (RESOURCE_API, "devicetaintrules", controller.on_taint_rule),
        ("v1", "pods", controller.on_pod),
    )
    for api_version, plural, handler in watched:
        kopf.on.event(api_version, plural, registry=r, id=plural)(handler)
    return r


async def run_operator(
    controller: Controller, *, api_client: ApiClient, stop: asyncio.Event
) -> None:
    """kopf plus the controller's housekeeping, until ``stop`` is set or kopf ends."""
    housekeeping = asyncio.create_task(controller.run(stop), name="drasil housekeeping")
    try:
        await kopf.operator(
            registry=registry(controller, api_client),
            settings=settings(),
            clusterwide=True,
            standalone=True,
            stop_flag=stop,
            memories=EventOnlyMemories(),
        )
    finally:
        stop.set()
        await housekeeping


def quiet_kopf(verbosity: int) -> None:
    """kopf logs every watch and handler at INFO; keep that for ``-v 2`` and up."""
    level = logging.DEBUG if verbosity >= 5 else logging.INFO if verbosity >= 2 else logging.WARNING
    logging.getLogger("kopf").setLevel(level)

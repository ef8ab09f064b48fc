"""The node's pool: its devices, tainted where unhealthy, kept published.

Runs in its own thread: publishes at start, again whenever device health changes,
when someone deletes one of its slices (kubelet wipes a node's slices every time it
starts), when kubelet registers the plugin, and every ``resync`` seconds. Failures
(API server away) are retried with exponential backoff; on a clean stop the slices
stay, because kubelet removes them when no plugin instance is connected long enough.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from drasil.driver.devices import CounterSet, Device
from drasil.driver.health import HealthTracker
from drasil.driver.kubeapi import KubeApi
from drasil.driver.objects import JsonDict
from drasil.driver.slices.build import OwnerRef, Taint, build_slices
from drasil.driver.slices.plan import PublishPlan
from drasil.driver.slices.publisher import PoolPublisher
from drasil.driver.slices.validate import TaintEffect

log = logging.getLogger(__name__)

BACKOFF_START = 0.5
BACKOFF_MAX = 30.0


def unhealthy_taint_key(driver: str) -> str:
    return f"{driver}/unhealthy"


class NodeSlices:
    """The node's pool: ``devices`` (tainted where unhealthy) and the ``counter_sets``
    they consume (``--mig-mode dynamic``; ``NodeRuntime.counter_sets``)."""

    def __init__(
        self,
        api: KubeApi,
        *,
        driver: str,
        node_name: str,
        devices: Sequence[Device],
        health: HealthTracker,
        publisher: PoolPublisher,
        resync: float = 300.0,
        counter_sets: Sequence[CounterSet] = (),
    ) -> None:
        self.api = api
        self.driver = driver
        self.node_name = node_name
        self.devices = devices
        self.counter_sets = counter_sets
        self.health = health
        self.publisher = publisher
        self.resync = resync
        self.published = threading.Event()  # set after the first success
        self.last_error = ""
        self._owner: OwnerRef | None = None
        self._poke = threading.Event()
        # Devices left out of the slices while another device plugin serves them
        # (doublebooking.py); None: none.
        self._withheld: Callable[[Device], bool] | None = None

    def withhold(self, withheld: Callable[[Device], bool] | None) -> None:
        """Leave the devices `withheld` selects out of the slices (None: publish all),
        and publish so now."""
        self._withheld = withheld
        self.poke()

    def offered(self) -> list[Device]:
        """The devices the slices offer now."""
        withheld = self._withheld
        return [d for d in self.devices if withheld is None or not withheld(d)]

    def poke(self) -> None:
        """Publish again now (e.g. kubelet registered us: it may have wiped our slices)."""
        self._poke.set()

    def desired(self) -> list[JsonDict]:
        taint = unhealthy_taint_key(self.driver)
        taints = {
            name: [Taint(key=taint, value="true", effect=TaintEffect.NO_SCHEDULE)]
            for name in self.health.tainted()
        }
        return build_slices(
            driver=self.driver,
            pool=self.node_name,
            devices=self.offered(),
            node_name=self.node_name,
            taints=taints,
            counter_sets=self.counter_sets,
            generation=1,
            owner=self._node_owner(),
        )

    def _node_owner(self) -> OwnerRef | None:
        # Owned by the Node so that deleting the Node garbage-collects its slices.
        if self._owner is None:
            uid = self.api.get_node_uid(self.node_name)
            if uid is not None:
                self._owner = OwnerRef.node(name=self.node_name, uid=uid)
        return self._owner

    def publish_once(self) -> PublishPlan:
        plan = self.publisher.publish(self.desired())
        self.published.set()
        self.last_error = ""
        return plan

    def run(self, stop: threading.Event) -> None:
        backoff = BACKOFF_START
        seen = -1
        while not stop.is_set():
            seen = self.health.version
            try:
                self.publish_once()
            except Exception as err:  # any failure: keep the node serving, retry later
                self.last_error = str(err)
                log.warning(
                    "publishing ResourceSlices failed; retrying",
                    extra={"node": self.node_name, "retryIn": backoff, "error": str(err)},
                )
                stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            backoff = BACKOFF_START
            self._wait(stop, seen)

    def _wait(self, stop: threading.Event, seen: int) -> None:
        """Until health changes, the resync period passes, or we are stopped."""
        waited = 0.0
        while not stop.is_set() and waited < self.resync:
            if self._poke.is_set():
                self._poke.clear()
                return
            if self.health.wait_for_change(seen, timeout=0.5) != seen:
                return
            waited += 0.5

    def watch_deletions(self, stop: threading.Event) -> None:
        """Poke the publisher whenever one of our slices is deleted by someone else."""
        selector = f"spec.nodeName={self.node_name},spec.driver={self.driver}"
        while not stop.is_set():
            try:
                for event in self.api.watch_slices(field_selector=selector, timeout_seconds=30):
                    if event == "DELETED":
                        log.info("a ResourceSlice of this node was deleted; publishing again")
                        self.poke()
                    if stop.is_set():
                        return
            except Exception as err:  # API server away: the resync still covers us
                log.debug("slice watch ended", extra={"error": str(err)})
                stop.wait(BACKOFF_MAX / 6)

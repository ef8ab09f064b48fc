"""Leader election on a ``coordination.k8s.io/v1`` Lease, the way client-go does it.

Only the holder of the Lease runs the controller; other replicas stand by. Rules
(client-go's ``leaderelection``):

- A Lease held by someone else counts as expired only when this replica has seen
  its record (holder, renewTime) unchanged for ``leaseDurationSeconds`` by its *own*
  clock, so clocks that disagree cannot make two leaders.
- Every write carries the Lease's resourceVersion: of two candidates taking over at
  once, one gets 409 and stays a follower.
- The leader renews every ``retry_period``; when it has not managed to for
  ``renew_deadline`` (< lease duration), it gives up before anyone may take over,
  and the process exits so that a fresh one stands by with empty memory.
- On a clean shutdown the leader releases the Lease (empty holder), so a standby
  takes over within one retry period instead of a whole lease duration.

The Lease is read and written as JSON through the custom-objects API, so no field
of it is lost to a client model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from datetime import UTC, datetime
from enum import Enum
from typing import Any

from drasil.controller.options import LeaderElection
from drasil.driver.kubeapi import ApiError, KubeApi

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "coordination.k8s.io", "v1", "leases"


class Attempt(Enum):
    LEADER = "leader"
    FOLLOWER = "follower"  # someone else holds a live Lease
    FAILED = "failed"  # the API did not answer, or a write lost a race


def micro_time(moment: datetime) -> str:
    """A metav1.MicroTime."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    """One candidate for one Lease; ``attempt`` is a single acquire-or-renew step."""

    def __init__(
        self,
        api: KubeApi,
        config: LeaderElection,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.config = config
        self.clock = clock
        self._observed: tuple[str, str] | None = None
        self._observed_at = 0.0

    @property
    def identity(self) -> str:
        return self.config.identity

    def _timeout(self) -> float:
        return max(self.config.retry_period, 1.0)

    def _get(self) -> dict[str, Any] | None:
        return self.api.get_lease(self.config.namespace, self.config.name, timeout=self._timeout())

    def _spec(self, old: dict[str, Any], now: datetime) -> dict[str, Any]:
        spec = dict(old)
        ours = spec.get("holderIdentity") == self.identity
        spec.update(
            holderIdentity=self.identity,
            leaseDurationSeconds=math.ceil(self.config.lease_duration),
            renewTime=micro_time(now),
        )
        if not ours:
            spec["acquireTime"] = micro_time(now)
            spec["leaseTransitions"] = int(old.get("leaseTransitions") or 0) + (1 if old else 0)
        return spec

    def _expired(self, spec: dict[str, Any]) -> bool:
        record = (str(spec.get("holderIdentity") or ""), str(spec.get("renewTime") or ""))
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()
        duration = float(spec.get("leaseDurationSeconds") or self.config.lease_duration)
        return self.clock() >= self._observed_at + duration

    def attempt(self) -> Attempt:
        """Acquire or renew once; API errors are reported as FAILED, never raised."""
        try:
            return self._attempt()
        except ApiError as err:
            if err.status != 409:
                log.warning("lease request failed", extra={"error": f"{err.status} {err.reason}"})
            return Attempt.FAILED
        except Exception as err:  # network errors surface as urllib3/OSError types
            log.warning("lease request failed", extra={"error": repr(err)})
            return Attempt.FAILED

    def _attempt(self) -> Attempt:
        lease = self._get()
        now = datetime.now(UTC)
        if lease is None:
            self._create(now)
            return Attempt.LEADER
        spec = dict(lease.get("spec") or {})
        holder = spec.get("holderIdentity") or ""
        if holder and holder != self.identity and not self._expired(spec):
            return Attempt.FOLLOWER
        lease["spec"] = self._spec(spec, now)
        self._replace(lease)
        return Attempt.LEADER

    def _create(self, now: datetime) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "Lease",
            "metadata": {"name": self.config.name, "namespace": self.config.namespace},
            "spec": self._spec({}, now),
        }
        self.api.create_lease(self.config.namespace, body, timeout=self._timeout())

    def _replace(self, lease: dict[str, Any]) -> None:
        # The body keeps metadata.resourceVersion: a concurrent write makes this a 409.
        self.api.replace_lease(
            self.config.namespace, self.config.name, lease, timeout=self._timeout()
        )

    def release(self) -> None:
        """Give the Lease up (best effort), so a standby need not wait for it to expire."""
        try:
            lease = self._get()
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            now = micro_time(datetime.now(UTC))
            lease["spec"] = {
                **lease["spec"],
                "holderIdentity": None,
                "leaseDurationSeconds": 1,
                "renewTime": now,
                "acquireTime": now,
            }
            self._replace(lease)
            log.info("released the leader lease", extra={"identity": self.identity})
        except Exception as err:
            log.warning("could not release the lease", extra={"error": repr(err)})


async def pause(stop: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds`` or until ``stop`` is set, whichever comes first."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)


async def acquire(elector: LeaseElector, stop: asyncio.Event) -> bool:
    """Wait until this replica leads (True) or ``stop`` is set (False)."""
    logged = False
    while not stop.is_set():
        result = await asyncio.to_thread(elector.attempt)
        if result is Attempt.LEADER:
            return True
        if not logged:
            log.info("standing by for the leader lease", extra={"identity": elector.identity})
            logged = True
        await pause(stop, elector.config.retry_period)
    return False


async def hold(elector: LeaseElector, stop: asyncio.Event) -> bool:
    """Renew until ``stop`` (returns True) or leadership is lost (returns False)."""
    renewed = elector.clock()
    while True:
        await pause(stop, elector.config.retry_period)
        if stop.is_set():
            return True
        result = await asyncio.to_thread(elector.attempt)
        if result is Attempt.LEADER:
            renewed = elector.clock()
        elif result is Attempt.FOLLOWER:
            log.error("another replica took the leader lease", extra={"identity": elector.identity})
            return False
        elif elector.clock() - renewed > elector.config.renew_deadline:
            log.error(
                "could not renew the leader lease in time",
                extra={"deadline": elector.config.renew_deadline},
            )
            return False

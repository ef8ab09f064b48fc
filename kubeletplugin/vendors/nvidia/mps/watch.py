"""MPS daemons that die under their clients: found within seconds, and said.

A control daemon can die while claims still use it: its process killed or OOM-killed,
its Pod failed, evicted or deleted by someone else. Its clients then hold a pipe to
nothing: every CUDA context through it is gone, and a new one fails while the GPU is
in EXCLUSIVE_PROCESS. The plugin cannot mend that for a running container, so it says
so where people and controllers look:

- the claims' devices are reported unhealthy on the health stream (source ``mps``,
  KEP-4680: the Pods' ``status.containerStatuses[].allocatedResourcesStatus``) for as
  long as any claim prepared before the death is still prepared; the source does not
  taint (``HealthTracker.report(taint=False)``): the GPU is sound and a new claim on it
  gets a new daemon;
- one Node Event (``MpsDaemonDied``) names the GPU, the daemon and the claims, and one
  Event on each of the claims' Pods tells what to do: restart the Pod (its claim's next
  prepare starts a new daemon);
- the next prepare on the GPU finds the recorded daemon not running and starts a new
  one, with the limits the checkpoint keeps for it. Its pipe directory and ``/dev/shm``
  are emptied by that start, or by the stop after the last claim (with the compute mode
  put back then), so nothing it held is leaked.

Each GPU is looked at under its lock, taken without waiting: a GPU being changed (a
daemon starting or stopping) is looked at next time, never taken for dead halfway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Protocol

from drasil.driver.health import HealthTracker
from drasil.kubeletplugin.vendors.nvidia.mps.shares import (
    EventPoster,
    GpuEffects,
    MpsClient,
    tell_pods,
)

log = logging.getLogger(__name__)

SOURCE: Final = "mps"
INTERVAL: Final = 2.0
DIED_REASON: Final = "MpsDaemonDied"


class ClaimApi(EventPoster, Protocol):
    """Reads a claim (for its Pods) and posts Events: the plugin's KubeApi."""

    def get_claim(
        self, namespace: str, name: str, *, cached: bool = False
    ) -> Mapping[str, Any] | None: ...


@dataclass(frozen=True)
class Death:
    """A daemon found dead: when, and the claims' devices it served then."""

    gpu: str
    pid: int  # the recorded daemon's (said once: a new daemon has another)
    when: str  # RFC 3339, for people
    what: str  # the daemon, as a person finds it (its Pod, or its process)
    clients: tuple[MpsClient, ...]

    def why(self) -> str:
        return (
            f"the MPS daemon of GPU {self.gpu} ({self.what}) died at {self.when}; "
            "restart the Pod: its claim's next prepare starts a new daemon"
        )


class DaemonWatch:
    """Looks at every running daemon each ``interval`` seconds (``run``, a health loop)."""

    def __init__(
        self,
        effects: GpuEffects,
        health: HealthTracker,
        *,
        node_event: Callable[[str, str], None],
        api: ClaimApi | None = None,
        interval: float = INTERVAL,
    ) -> None:
        self.effects = effects
        self.health = health
        self.node_event = node_event
        self.api = api
        self.interval = interval
        self._deaths: dict[str, Death] = {}

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval):
            try:
                self.poll()
            except Exception as err:  # a failed look must not end the watch
                log.warning("MPS daemon watch failed", extra={"error": str(err)})

    def poll(self) -> list[Death]:
        """One look: the deaths found now; the health of every death's claims reported."""
        found = []
        served = self.effects.clients()
        # Asked of the launcher at once; a GPU that seems dead is asked again, alone,
        # under its lock.
        alive = self.effects.daemons.running_of(sorted(served)) if served else {}
        for gpu, clients in sorted(served.items()):
            if alive.get(gpu, True):
                continue  # running (or being started: no record yet)
            death = self._look(gpu, clients)
            if death is not None:
                found.append(death)
                self._deaths[gpu] = self._with_earlier(death)
                self._tell(death)
        self._report()
        return found

    def _with_earlier(self, death: Death) -> Death:
        """A second death on one GPU keeps the first one's clients (still unhealthy)."""
        earlier = self._deaths.get(death.gpu)
        if earlier is None:
            return death
        clients = {(c.claim_uid, c.device): c for c in (*earlier.clients, *death.clients)}
        return Death(death.gpu, death.pid, death.when, death.what, tuple(clients.values()))

    def _look(self, gpu: str, clients: list[MpsClient]) -> Death | None:
        daemons = self.effects.daemons
        with daemons.hold(gpu, wait=False) as held:
            if not held:  # being started or stopped: looked at next time
                return None
            with self.effects.state_lock():
                record = self.effects.store.gpus().get(gpu)
            if record is None or record.mps is None or daemons.running(gpu) is not None:
                return None
            said = self._deaths.get(gpu)
            if said is not None and said.pid == record.mps.pid:
                return None  # this daemon's death is said already
            what = daemons.describe(gpu) or f"pid {record.mps.pid}"
        when = datetime.now(UTC).isoformat(timespec="seconds")
        log.error(
            "MPS daemon died under its clients",
            extra={"gpu": gpu, "daemon": what, "claims": [_claim(c) for c in clients]},
        )
        return Death(gpu, record.mps.pid, when, what, tuple(clients))

    def _report(self) -> None:
        """The devices of claims a dead daemon served, while they are still prepared."""
        with self.effects.state_lock():
            prepared = {uid: r.updated_at for uid, r in self.effects.store.claims().items()}
        unhealthy: dict[str, str] = {}
        for gpu, death in list(self._deaths.items()):
            left = [c for c in death.clients if prepared.get(c.claim_uid) == c.since]
            if not left:
                del self._deaths[gpu]
                continue
            for client in left:
                unhealthy[client.device] = death.why()
        self.health.report(SOURCE, unhealthy, taint=False)

    def _tell(self, death: Death) -> None:
        claims = ", ".join(sorted({_claim(c) for c in death.clients}))
        self.node_event(DIED_REASON, f"{death.why()}. Claims it served: {claims}")
        if self.api is not None:
            threading.Thread(
                target=self._tell_pods, args=(death,), name="mps-died", daemon=True
            ).start()

    def _tell_pods(self, death: Death) -> None:
        """An Event on each Pod of the claims (best effort: read from the API)."""
        assert self.api is not None
        stamp = int(time.time())
        for namespace, name in sorted({(c.namespace, c.name) for c in death.clients}):
            try:
                claim = self.api.get_claim(namespace, name)
            except Exception as err:  # the Node Event and the Pod's status say it too
                log.warning(
                    "MPS death not told to the claim's Pods",
                    extra={"claim": f"{namespace}/{name}", "error": str(err)},
                )
                continue
            if claim is not None:
                message, event = death.why(), f"mps-died-{stamp}"
                tell_pods(self.api, claim, reason=DIED_REASON, message=message, name=event)


def _claim(client: MpsClient) -> str:
    return f"{client.namespace}/{client.name}"

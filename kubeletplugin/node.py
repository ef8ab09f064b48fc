"""What both node daemons share: discovery, device health, HTTP endpoints, threads, signals.

The hardware is the vendors' (``kubeletplugin.vendors``): this module asks each for
its devices, health sources, spec-wide edits and readiness, and names none of them.

``dra/plugin.py`` (``KubeletPlugin``, DRA mode) and ``deviceplugin/plugin.py``
(``DevicePluginServer``, device-plugin mode) each own one ``NodeRuntime`` and put
their kubelet sockets on top of it; ``main.py`` starts either under
``signals_for_the_main_thread`` and waits on ``stop_on_signals``.

Stopping is the same in both modes: SIGTERM or SIGINT sets an event the main thread
waits on, the main thread then calls the daemon's ``stop()``, which tells the loops
to end, stops the daemon's kubelet sockets, the HTTP servers, and joins the threads.
Nothing is undone on the way out: in DRA mode the checkpoint and the CDI specs of
prepared claims stay, so the next instance (or kubelet's next call) carries on.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Protocol

from prometheus_client import CollectorRegistry, Gauge

from drasil.api.kubelet import names
from drasil.driver.devices import CounterSet, Device, Vendor, VendorError
from drasil.driver.endpoints import HealthCheck, serve_http
from drasil.driver.health import FAULT_FILE, FaultFileWatcher, HealthTracker
from drasil.kubeletplugin.options import PluginOptions
from drasil.kubeletplugin.vendors.seam import EditsSource, NodeVendor, ReadinessCheck

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Listener(Protocol):
    """A kubelet-facing socket of a daemon (its ``stop`` also removes the socket file)."""

    def stop(self) -> None: ...


class NodeDaemon(Protocol):
    """What ``main`` runs: a started daemon it can name the sockets of and stop."""

    @property
    def sockets(self) -> Sequence[Path]: ...

    def stop(self) -> None: ...


class NodeRuntime:
    """Discovery, health sources, HTTP servers and background threads of one daemon,
    over the node's vendors (``kubeletplugin.vendors``)."""

    def __init__(
        self,
        opts: PluginOptions,
        *,
        vendors: Sequence[NodeVendor],
        devices_gauge: Gauge,
    ) -> None:
        self.opts = opts
        self.vendors = tuple(vendors)
        self.stop_event = threading.Event()
        self._devices_gauge = devices_gauge
        # The shared counters the devices consume (``--mig-mode dynamic``), set by discover.
        self.counter_sets: tuple[CounterSet, ...] = ()
        self._threads: list[threading.Thread] = []
        self._http: list[ThreadingHTTPServer] = []

    def discover(self) -> list[Device]:
        """The node's devices; a device discovery could not read is logged and left out.

        With ``--mig-mode dynamic`` or ``--amd-partition-mode dynamic`` the shared
        counters they consume are kept in ``counter_sets``, to be published with them.
        Raises ``HardwareError`` when a vendor's library cannot be used (NVML).
        """
        found = [vendor.discover(dra=self.opts.mode == "dra") for vendor in self.vendors]
        devices = [d for f in found for d in f.devices]
        self.counter_sets = tuple(c for f in found for c in f.counter_sets)
        for skipped in (s for f in found for s in f.skipped):
            log.error("device skipped: %s", skipped)
        log.info(
            "discovered devices",
            extra={"count": len(devices), "devices": [d.name for d in devices]},
        )
        return devices

    def watch_health(self, devices: Sequence[Device], *, fault_poll: float) -> HealthTracker:
        """A tracker fed by each vendor's health sources and the fault file, counted
        by the gauge."""
        health = HealthTracker(devices)
        # The fault file sits in the DRA state dir, so `drasil fault` works in both modes
        # and on both backends: on a real node it takes a GPU out of scheduling by hand.
        self.opts.state_dir.mkdir(parents=True, exist_ok=True)
        watcher = FaultFileWatcher(self.opts.state_dir / FAULT_FILE, health, interval=fault_poll)
        watcher.poll()  # faults injected before start count from the first publish
        self.thread("faults", watcher.run)
        # Each vendor's sources see its own devices only.
        for vendor in self.vendors:
            own = [d for d in devices if d.vendor == vendor.vendor]
            for name, loop in vendor.health_sources(own, health):
                self.thread(name, loop)
        total = len(devices)
        gauge = self._devices_gauge
        gauge.labels(names.HEALTHY).set_function(lambda: total - len(health.unhealthy()))
        gauge.labels(names.UNHEALTHY).set_function(lambda: len(health.unhealthy()))
        return health

    def common_edits(self, *, device_plugin: bool = False) -> tuple[Vendor, EditsSource] | None:
        """The spec-wide edits specs of one vendor's devices get (NVIDIA's driver files),
        and whose they are; None: no vendor has any. Two vendors with such edits are
        refused (``VendorError``): a spec holds one vendor's."""
        found = [
            (v.vendor, edits)
            for v in self.vendors
            if (edits := v.container_edits(device_plugin=device_plugin)) is not None
        ]
        if len(found) > 1:
            raise VendorError(
                "two vendors' spec-wide container edits on one node: "
                + ", ".join(vendor.value for vendor, _ in found)
                + "; serve them on different nodes (--vendors)"
            )
        return found[0] if found else None

    def readiness(self) -> list[ReadinessCheck]:
        """What a real GPU container would miss here, each check logged; the failed ones."""
        checks = [c for v in self.vendors for c in v.readiness()]
        for check in checks:
            level = logging.INFO if check.ok else logging.ERROR
            log.log(level, "node check %s: %s", check.name, check.detail)
        return [c for c in checks if not c.ok]

    def thread(
        self, name: str, target: Callable[[threading.Event], None], *, join: bool = True
    ) -> None:
        """Run ``target(stop_event)`` in a daemon thread that ``stop`` joins.

        ``join=False`` for a thread that may sit in a blocking read (an API watch waits
        up to its timeout for the next event) and holds nothing to finish: waiting for
        it would add seconds to every stop, a rolling update's included."""
        thread = threading.Thread(target=target, args=(self.stop_event,), name=name, daemon=True)
        thread.start()
        if join:
            self._threads.append(thread)

    def serve_http(self, *, registry: CollectorRegistry, check: HealthCheck) -> None:
        """``/metrics`` on ``--metrics-addr``; the probes there and on ``--health-addr``."""
        for addr in dict.fromkeys([self.opts.metrics_addr, self.opts.health_addr]):
            server = serve_http(
                addr, registry=registry if addr == self.opts.metrics_addr else None, health=check
            )
            if server is not None:
                self._http.append(server)

    def stop(self, listeners: Iterable[Listener]) -> None:
        """Stop the loops, then ``listeners``, then HTTP; safe to call more than once."""
        self.stop_event.set()  # first: streams and loops end instead of holding a server
        for listener in listeners:
            listener.stop()
        for server in self._http:
            server.shutdown()
            server.server_close()
        self._http = []
        for thread in self._threads:
            thread.join(timeout=5)
        for vendor in self.vendors:  # NVML's reference goes last: its threads are done
            vendor.close()


# ---- signals -----------------------------------------------------------------------------


@contextmanager
def signals_for_the_main_thread() -> Iterator[None]:
    """Threads started inside (and theirs, gRPC's included) never take SIGTERM or SIGINT.

    Python runs signal handlers in the main thread only, and a main thread blocked in
    ``Event.wait()`` wakes only if the kernel delivers the signal to it; with the
    signal open in a dozen gRPC and helper threads the kernel may pick one of those,
    and the daemon then ignores SIGTERM until kubelet kills it. Threads inherit the
    mask of the thread that creates them, so blocking here is enough. A signal that
    comes while the block is in place waits, and is delivered when it ends.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # a non-main caller (a test's thread) has no handlers to protect
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def stop_on_signals() -> threading.Event:
    """An event that SIGTERM and SIGINT set (call from the main thread)."""
    stopped = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("stopping", extra={"signal": signal.Signals(signum).name})
        stopped.set()

    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)
    return stopped

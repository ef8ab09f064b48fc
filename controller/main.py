"""Entry point of ``drasil-controller``.

The process serves ``/metrics`` and ``/healthz`` from the start, waits for the
leader Lease (``--leader-elect``, on by default), then runs kopf and the controller
until SIGTERM or until it loses the Lease. A clean stop releases the Lease and exits
0; a lost Lease exits 1, so that the Pod restarts into a standby with empty memory
rather than acting on state another leader has moved on from.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from drasil.api.limits import allow_nesting
from drasil.controller.controller import Controller
from drasil.controller.heap import start_from_env as trace_heap
from drasil.controller.heap import tune_malloc
from drasil.controller.leader import LeaseElector, acquire, hold, pause
from drasil.controller.metrics import ControllerMetrics
from drasil.controller.operator import quiet_kopf, run_operator
from drasil.controller.options import ControllerOptions, OptionsError, parse_options
from drasil.driver.endpoints import serve_http
from drasil.driver.kubeapi import KubeApi, load_api_client
from drasil.driver.logs import setup_logging

log = logging.getLogger("drasil.controller")

HEARTBEAT_PERIOD = 1.0
HEARTBEAT_STALE = 30.0  # the event loop has not run for this long: report unhealthy


class Liveness:
    """``/healthz``: the event loop keeps beating, and whether this replica leads."""

    def __init__(self) -> None:
        self.beat = time.monotonic()
        self.role = "starting"

    def check(self) -> tuple[bool, str]:
        age = time.monotonic() - self.beat
        if age > HEARTBEAT_STALE:
            return False, f"event loop stalled for {age:.0f}s"
        return True, self.role


async def _heartbeat(liveness: Liveness, stop: asyncio.Event) -> None:
    while not stop.is_set():
        liveness.beat = time.monotonic()
        await pause(stop, HEARTBEAT_PERIOD)


def _serve(opts: ControllerOptions, metrics: ControllerMetrics, liveness: Liveness) -> None:
    if opts.metrics_addr == opts.health_addr:
        serve_http(opts.metrics_addr, registry=metrics.registry, health=liveness.check)
        return
    serve_http(opts.metrics_addr, registry=metrics.registry)
    serve_http(opts.health_addr, health=liveness.check)


async def _lead(
    opts: ControllerOptions,
    *,
    api: KubeApi,
    elector: LeaseElector | None,
    metrics: ControllerMetrics,
    stop: asyncio.Event,
) -> int:
    """Run the controller while leading; the exit code (1: Lease lost or kopf failed)."""
    kopf_stop = asyncio.Event()
    watchers: list[asyncio.Task[Any]] = [asyncio.create_task(stop.wait(), name="signal")]
    renewer = asyncio.create_task(hold(elector, stop), name="lease") if elector else None
    if renewer is not None:
        watchers.append(renewer)
    controller = Controller(api=api, options=opts, metrics=metrics)
    operator = asyncio.create_task(
        run_operator(controller, api_client=api.api_client, stop=kopf_stop), name="operator"
    )
    await asyncio.wait([operator, *watchers], return_when=asyncio.FIRST_COMPLETED)
    lost = renewer is not None and renewer.done() and renewer.result() is False
    kopf_stop.set()
    [failure] = await asyncio.gather(operator, return_exceptions=True)
    for task in watchers:
        task.cancel()
    metrics.leader.set(0)
    if isinstance(failure, BaseException):
        log.error("the operator failed", exc_info=failure)
    if elector is not None and not lost:
        await asyncio.to_thread(elector.release)
    if lost:
        log.error("lost the leader lease; exiting so that a fresh replica stands by")
    return 1 if lost or isinstance(failure, BaseException) else 0


async def run(opts: ControllerOptions, *, metrics: ControllerMetrics, liveness: Liveness) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    beating = asyncio.create_task(_heartbeat(liveness, stop), name="heartbeat")
    api = KubeApi(load_api_client(opts.kubeconfig))
    # DRASIL_TRACEMALLOC (controller.heap), off unless asked for. Started only now: the
    # generated client's API modules, imported lazily by KubeApi, take minutes to
    # import while every allocation records its traceback.
    heap_report = trace_heap()
    if heap_report is not None:
        log.info("tracing the heap; SIGUSR1 writes a report", extra={"path": str(heap_report)})
    elector = LeaseElector(api, opts.leader) if opts.leader.enabled else None
    if elector is not None:
        liveness.role = "standby"
        if not await acquire(elector, stop):
            return 0
        log.info("leading", extra={"identity": elector.identity, "lease": opts.leader.name})
    liveness.role = "leader"
    metrics.leader.set(1)
    code = await _lead(opts, api=api, elector=elector, metrics=metrics, stop=stop)
    stop.set()
    await beating
    log.info("stopped", extra={"exit_code": code})
    return code


def main(argv: Sequence[str] | None = None) -> int:
    try:
        opts = parse_options(sys.argv[1:] if argv is None else argv)
    except OptionsError as err:
        print(f"drasil-controller: {err}", file=sys.stderr)
        return 2
    setup_logging(log_format=opts.log_format, verbosity=opts.verbosity)
    allow_nesting()  # objects users write may nest thousands of levels deep
    quiet_kopf(opts.verbosity)
    # What the imports made (modules, functions, pydantic's and the client's models:
    # about half the objects the collector tracks) lives as long as the process; frozen,
    # the collector's full passes, which come more often as watch events pour in, no
    # longer walk it each time.
    gc.freeze()
    tune_malloc()  # before any worker thread: glibc keeps less free memory (heap)
    metrics = ControllerMetrics()
    liveness = Liveness()
    try:
        _serve(opts, metrics, liveness)
    except OSError as err:
        log.error("cannot serve HTTP: %s", err)
        return 1
    log.info(
        "starting",
        extra={"driver": opts.driver_name, "leader_elect": opts.leader.enabled},
    )
    return asyncio.run(run(opts, metrics=metrics, liveness=liveness))


if __name__ == "__main__":
    sys.exit(main())

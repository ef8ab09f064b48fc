"""python -m tools.fleet: one process that publishes the pools of many fake (KWOK) nodes.

Each node's pool is what the kubelet plugin would publish for it: simulated GPUs of
``--profile`` discovered for that node name, ``NodeSlices.desired()`` (owner: the Node,
the unhealthy taint on unhealthy devices) written through ``PoolPublisher``, with the
credentials it is given (the chart's kubelet-plugin service account, see
``e2e.harness.cluster.fleet``). One process instead of N plugins: what the API server and the
scheduler see is the same, what the host pays is one Python.

It publishes every node once, then again every ``--resync`` seconds (a list per pool, no
write while nothing changed, like the plugin's resync). Unlike the plugin it does not
hold one slice watch per node.

A small HTTP server on 127.0.0.1 (its port in ``--port-file``) lets a benchmark look and
flip a device's health:

- ``GET /status``: ``{"nodes": N, "published": n, "writes": {"create": ...}, "errors": [...]}``
- ``POST /flip`` with ``{"node": ..., "device": ..., "healthy": false}``: reports the device
  (un)healthy and publishes that node's pool at once, as the plugin's health loop does;
  answers the writes that took (``{"writes": 1, "verbs": {"update": 1}}``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kubernetes import client, config

from drasil.driver.health import HealthTracker
from drasil.driver.kubeapi import KubeApi
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.simulated.nvml import simulated_library
from drasil.driver.slices.publisher import PoolPublisher
from drasil.kubeletplugin.dra.nodeslices import NodeSlices

log = logging.getLogger("tools.fleet")

USER_AGENT = "drasil-fleet-publisher"
FLIP_SOURCE = "fleet-flip"  # the HealthTracker source of flips made over HTTP
WORKERS = 8  # pools published at once (each is a list and a write or two)


class FleetError(ValueError):
    """A request the fleet publisher cannot serve (unknown node or device)."""


@dataclass
class FleetNode:
    name: str
    health: HealthTracker
    slices: NodeSlices


class FleetPublisher:
    """Every fake node's ``NodeSlices``, published with one API client."""

    def __init__(self, api: KubeApi, *, driver: str, profile: str, nodes: Sequence[str]) -> None:
        self.api = api
        self.driver = driver
        self.writes: Counter[str] = Counter()
        self.errors: list[str] = []
        self.published: set[str] = set()
        self._lock = threading.Lock()
        self.nodes = {name: self._node(name, profile) for name in nodes}

    def _node(self, name: str, profile: str) -> FleetNode:
        devices = discover(simulated_library(profile, node_name=name), node_name=name).devices
        health = HealthTracker(devices)
        publisher = PoolPublisher(self.api, driver=self.driver, pool=name, on_write=self._count)
        slices = NodeSlices(
            self.api,
            driver=self.driver,
            node_name=name,
            devices=devices,
            health=health,
            publisher=publisher,
        )
        return FleetNode(name, health, slices)

    def _count(self, verb: str, ok: bool) -> None:
        with self._lock:
            self.writes[verb if ok else f"{verb}-failed"] += 1

    def publish(self, name: str) -> int:
        """Publish one node's pool now; returns the writes it took."""
        node = self.nodes[name]
        plan = node.slices.publish_once()
        with self._lock:
            self.published.add(name)
        return plan.writes

    def _publish_safely(self, name: str) -> None:
        try:
            self.publish(name)
        except Exception as err:  # the next resync tries again, as the plugin would
            with self._lock:
                self.errors = [*self.errors[-19:], f"{name}: {err}"]
            log.warning("publishing %s failed: %s", name, err)

    def publish_all(self) -> None:
        with ThreadPoolExecutor(WORKERS) as pool:
            list(pool.map(self._publish_safely, self.nodes))

    def flip(self, node: str, device: str, *, healthy: bool) -> dict[str, Any]:
        """Report ``device`` of ``node`` (un)healthy and publish that pool."""
        found = self.nodes.get(node)
        if found is None:
            raise FleetError(f"node {node!r} is not in the fleet")
        if device not in found.health.snapshot():
            raise FleetError(f"node {node} has no device {device!r}")
        before = Counter(self.writes)
        unhealthy = {} if healthy else {device: "health flipped by the fleet's /flip"}
        found.health.report(FLIP_SOURCE, unhealthy)
        writes = self.publish(node)
        with self._lock:
            verbs = dict(self.writes - before)
        return {"writes": writes, "verbs": verbs}

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "nodes": len(self.nodes),
                "published": len(self.published),
                "writes": dict(self.writes),
                "errors": list(self.errors),
            }

    def run(self, stop: threading.Event, *, resync: float) -> None:
        """Publish everything, then again every ``resync`` seconds until ``stop``."""
        while not stop.is_set():
            self.publish_all()
            stop.wait(resync)


def _handler(fleet: FleetPublisher) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, body: Mapping[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/status":
                self._answer(200, fleet.status())
            else:
                self._answer(404, {"error": f"no {self.path}"})

        def do_POST(self) -> None:
            if self.path != "/flip":
                self._answer(404, {"error": f"no {self.path}"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                result = fleet.flip(
                    str(body["node"]), str(body["device"]), healthy=bool(body.get("healthy"))
                )
            except (FleetError, KeyError, ValueError) as err:
                self._answer(400, {"error": str(err)})
                return
            except Exception as err:  # the API server refused: say so, keep serving
                self._answer(502, {"error": str(err)})
                return
            self._answer(200, result)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug(format, *args)

    return Handler


def api_from_kubeconfig(kubeconfig: Path, *, user_agent: str = USER_AGENT) -> KubeApi:
    """A KubeApi whose connection pool fits WORKERS threads, with its own user agent
    (the API server's audit log tells the fleet's writes apart by it)."""
    configuration = client.Configuration()
    config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=str(kubeconfig), client_configuration=configuration, persist_config=False
    )
    configuration.connection_pool_maxsize = WORKERS * 2
    api_client = client.ApiClient(configuration)
    api_client.user_agent = user_agent
    return KubeApi(api_client)


def node_names(prefix: str, count: int) -> list[str]:
    """The fleet's node names: ``<prefix><index>``, zero-padded so they sort."""
    if count < 0:
        raise ValueError(f"--count: {count} is negative")
    width = len(str(max(count - 1, 0)))
    return [f"{prefix}{i:0{width}d}" for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.fleet", description=__doc__)
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--driver", default="gpu.drasil.dev")
    parser.add_argument("--profile", default="h100-80gb:8")
    parser.add_argument("--node-prefix", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--resync", type=float, default=300.0)
    parser.add_argument("--port-file", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    fleet = FleetPublisher(
        api_from_kubeconfig(args.kubeconfig),
        driver=args.driver,
        profile=args.profile,
        nodes=node_names(args.node_prefix, args.count),
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fleet))
    tmp = args.port_file.with_suffix(".tmp")
    tmp.write_text(str(server.server_address[1]))
    tmp.replace(args.port_file)
    stop = threading.Event()
    threading.Thread(target=fleet.run, args=(stop,), kwargs={"resync": args.resync}).start()
    log.info("fleet of %d nodes, HTTP on port %d", args.count, server.server_address[1])
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())

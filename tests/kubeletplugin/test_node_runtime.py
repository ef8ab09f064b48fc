"""What both node daemons share (``drasil.kubeletplugin.node``): health and its gauge,
the HTTP endpoints, the stop, and SIGTERM in DRA mode keeping the prepared claims."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from kubelet_client import (
    DEADLINE,
    DRIVER,
    NODE,
    PROFILE,
    MemoryClaims,
    claim_json,
    node_devices,
    ref_of,
    result,
    short_dir,
    wait_until,
)
from prometheus_client import CollectorRegistry
from test_deviceplugin_main import process

from drasil.driver.checkpoint import CHECKPOINT_DIR, CheckpointStore
from drasil.driver.checkpointdisk import read_state
from drasil.driver.health import FAULT_FILE, write_faults
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.metrics import devices_gauge
from drasil.kubeletplugin.node import NodeRuntime
from drasil.kubeletplugin.options import PluginOptions, parse_options
from drasil.kubeletplugin.vendors.registry import open_vendors

UID = "5b0a1f0e-1c1d-4c55-9f4a-0d1e2f3a4b5c"


def dra_flags(root: Path, *flags: str) -> list[str]:
    """A DRA node under ``root`` on simulated GPUs, without HTTP."""
    return [
        f"--node-name={NODE}",
        "--backend=simulated",
        f"--simulated-profile={PROFILE}",
        f"--plugins-dir={root / 'plugins'}",
        f"--registrar-dir={root / 'registry'}",
        f"--cdi-root={root / 'cdi'}",
        "--metrics-addr=0",
        "--health-addr=0",
        *flags,
    ]


def options(root: Path, *flags: str) -> PluginOptions:
    return parse_options(dra_flags(root, *flags), {})


class Listener:
    def __init__(self) -> None:
        self.stops = 0

    def stop(self) -> None:
        self.stops += 1


def test_health_sources_feed_the_devices_gauge(tmp_path: Path) -> None:
    opts = options(tmp_path)
    registry = CollectorRegistry()
    node = NodeRuntime(opts, vendors=open_vendors(opts)[1], devices_gauge=devices_gauge(registry))
    write_faults(opts.state_dir / FAULT_FILE, {"gpu-1": "XID 79"})
    health = node.watch_health(node.discover(), fault_poll=0.01)
    try:
        assert set(health.unhealthy()) == {"gpu-1"}  # a fault from before the start counts
        assert registry.get_sample_value("drasil_devices", {"health": "Unhealthy"}) == 1
        assert registry.get_sample_value("drasil_devices", {"health": "Healthy"}) == 3
        write_faults(opts.state_dir / FAULT_FILE, {})
        wait_until(lambda: not health.unhealthy(), what="gpu-1 to heal")
        assert registry.get_sample_value("drasil_devices", {"health": "Healthy"}) == 4
    finally:
        node.stop([])


def test_stop_ends_threads_listeners_and_http(tmp_path: Path) -> None:
    opts = options(tmp_path, "--metrics-addr=127.0.0.1:0", "--health-addr=127.0.0.1:0")
    registry = CollectorRegistry()
    node = NodeRuntime(opts, vendors=open_vendors(opts)[1], devices_gauge=devices_gauge(registry))
    node.serve_http(registry=registry, check=lambda: (True, "ok (test)"))
    (server,) = node._http  # one address serves metrics and probes
    url = f"http://127.0.0.1:{server.server_port}"
    with urllib.request.urlopen(f"{url}/healthz", timeout=DEADLINE) as response:
        assert response.read() == b"ok (test)\n"
    node.thread("waits", lambda stop: stop.wait())
    listeners = [Listener(), Listener()]
    node.stop(listeners)
    node.stop(listeners)  # a second stop is harmless
    assert [listener.stops for listener in listeners] == [2, 2]
    assert node.stop_event.is_set()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/healthz", timeout=DEADLINE)


def _kubeconfig(path: Path) -> Path:
    # An API server that refuses connections: the plugin must start and stop without one.
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(json.dumps(config))
    return path


def test_sigterm_in_dra_mode_stops_serving_and_keeps_prepared_claims() -> None:
    with short_dir() as root:
        opts = options(root)
        claim = claim_json(UID, result("gpu-2"))
        opts.state_dir.mkdir(parents=True)
        opts.cdi_root.mkdir(parents=True)
        store = CheckpointStore(opts.state_dir / CHECKPOINT_DIR)
        store.load()
        preparer = Preparer(
            driver=DRIVER,
            pool=NODE,
            devices=node_devices(),
            claims=MemoryClaims(claim),
            store=store,
            cdi_root=opts.cdi_root,
            state_dir=opts.state_dir,
        )
        assert preparer.prepare(ref_of(claim)).error == ""
        checkpoint = read_state(opts.state_dir / CHECKPOINT_DIR)
        assert checkpoint is not None
        assert UID in checkpoint.claims
        spec = opts.cdi_root / f"k8s.{DRIVER}-claim_{UID}.json"
        args = dra_flags(root, f"--kubeconfig={_kubeconfig(root / 'kubeconfig')}")
        with process(args) as daemon:
            wait_until(lambda: " running " in daemon.output, what="the running log line")
            sockets = [opts.state_dir / "dra.sock", root / "registry" / f"{DRIVER}-reg.sock"]
            assert all(s.is_socket() for s in sockets)
            daemon.proc.send_signal(signal.SIGTERM)
            assert daemon.exit_code() == 0, daemon.output
        assert not any(s.exists() for s in sockets)
        assert read_state(opts.state_dir / CHECKPOINT_DIR) == checkpoint
        assert spec.exists()

"""``--mig-mode dynamic`` in the node daemon: discovery keeps the counter sets and the
node pool publishes them with the devices that consume them."""

from __future__ import annotations

from pathlib import Path

from kubelet_client import NODE
from prometheus_client import CollectorRegistry

from drasil.driver.discovery.health import HealthTracker
from drasil.driver.nvidia.simulated import simulated_library
from drasil.kubeletplugin.dra.nodeslices import NodeSlices
from drasil.kubeletplugin.metrics import devices_gauge
from drasil.kubeletplugin.node import NodeRuntime
from drasil.kubeletplugin.options import parse_options


class _Api:
    def get_node_uid(self, name: str) -> str | None:
        return "node-uid"


def test_dynamic_node_publishes_counter_sets(tmp_path: Path) -> None:
    flags = [
        f"--node-name={NODE}",
        "--backend=simulated",
        "--simulated-profile=h100-80gb:2,l4:1",
        f"--plugins-dir={tmp_path / 'plugins'}",
        f"--registrar-dir={tmp_path / 'registry'}",
        "--metrics-addr=0",
        "--health-addr=0",
        "--mig-mode=dynamic",
    ]
    opts = parse_options(flags, {})
    lib = simulated_library(opts.simulated_profile, node_name=NODE)
    node = NodeRuntime(opts, lib=lib, devices_gauge=devices_gauge(CollectorRegistry()))
    devices = node.discover()
    assert [c.name for c in node.counter_sets] == ["gpu-0-counters", "gpu-1-counters"]
    assert len(devices) == 2 * 26 + 1
    pool = NodeSlices(
        _Api(),  # type: ignore[arg-type]
        driver="gpu.drasil.dev",
        node_name=NODE,
        devices=devices,
        health=HealthTracker(devices),
        publisher=None,  # type: ignore[arg-type]
        counter_sets=node.counter_sets,
    )
    slices = pool.desired()
    shared = [c["name"] for s in slices for c in s["spec"].get("sharedCounters", ())]
    assert shared == ["gpu-0-counters", "gpu-1-counters"]
    published = [d["name"] for s in slices for d in s["spec"].get("devices", ())]
    assert sorted(published) == sorted(d.name for d in devices)


def test_static_node_has_no_counter_sets(tmp_path: Path) -> None:
    flags = [
        f"--node-name={NODE}",
        "--backend=simulated",
        "--simulated-profile=a100-40gb-mig:1",
        f"--plugins-dir={tmp_path / 'plugins'}",
        f"--registrar-dir={tmp_path / 'registry'}",
        "--metrics-addr=0",
        "--health-addr=0",
    ]
    opts = parse_options(flags, {})
    lib = simulated_library(opts.simulated_profile, node_name=NODE)
    node = NodeRuntime(opts, lib=lib, devices_gauge=devices_gauge(CollectorRegistry()))
    assert len(node.discover()) == 4
    assert node.counter_sets == ()


def test_device_plugin_mode_stays_static(tmp_path: Path) -> None:
    flags = [
        f"--node-name={NODE}",
        "--backend=simulated",
        "--simulated-profile=h100-80gb:1",
        f"--plugins-dir={tmp_path / 'plugins'}",
        f"--registrar-dir={tmp_path / 'registry'}",
        "--metrics-addr=0",
        "--health-addr=0",
        "--mode=device-plugin",
        "--mig-mode=dynamic",
    ]
    opts = parse_options(flags, {})
    lib = simulated_library(opts.simulated_profile, node_name=NODE)
    node = NodeRuntime(opts, lib=lib, devices_gauge=devices_gauge(CollectorRegistry()))
    assert [d.name for d in node.discover()] == ["gpu-0"]
    assert node.counter_sets == ()

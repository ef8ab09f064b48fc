"""``--mig-mode dynamic`` in the node daemon: discovery keeps the counter sets and the
node pool publishes them with the devices that consume them."""

from __future__ import annotations

from pathlib import Path

from kubelet_client import NODE, simulated_node

from drasil.driver.health import HealthTracker
from drasil.kubeletplugin.dra.nodeslices import NodeSlices


class _Api:
    def get_node_uid(self, name: str) -> str | None:
        return "node-uid"


def test_dynamic_node_publishes_counter_sets(tmp_path: Path) -> None:
    node = simulated_node(tmp_path, "h100-80gb:2,l4:1", "--mig-mode=dynamic")
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
    node = simulated_node(tmp_path, "a100-40gb-mig:1")
    assert len(node.discover()) == 4
    assert node.counter_sets == ()


def test_device_plugin_mode_stays_static(tmp_path: Path) -> None:
    node = simulated_node(tmp_path, "h100-80gb:1", "--mode=device-plugin", "--mig-mode=dynamic")
    assert [d.name for d in node.discover()] == ["gpu-0"]
    assert node.counter_sets == ()

"""Another device plugin advertising GPUs on the node (kubeletplugin/dra/doublebooking.py):
while the Node has its resource allocatable, that vendor's GPUs are withheld from the
slices; once it reports 0 they are published again."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kubelet_client import NODE, simulated_node

from drasil.driver.devices import Device, Vendor
from drasil.driver.health import HealthTracker
from drasil.kubeletplugin.dra.doublebooking import Conflict, DoubleBookingGuard, conflict
from drasil.kubeletplugin.dra.nodeslices import NodeSlices
from drasil.kubeletplugin.options import DEVICE_PLUGIN_RESOURCES, OptionsError, parse_options


def _device(vendor: Vendor) -> Device:
    return SimpleNamespace(vendor=vendor)  # type: ignore[return-value]


def test_only_matching_resources_with_something_allocatable_conflict() -> None:
    allocatable = {
        "cpu": "8",
        "nvidia.com/gpu": "8",
        "nvidia.com/mig-1g.10gb": "7",
        "nvidia.com/mig-3g.40gb": "0",  # registered once, gone now
        "example.com/fpga": "2",
    }
    found = conflict(allocatable, DEVICE_PLUGIN_RESOURCES)
    assert dict(found.resources) == {"nvidia.com/gpu": 8, "nvidia.com/mig-1g.10gb": 7}
    assert conflict({"nvidia.com/gpu": "0"}, DEVICE_PLUGIN_RESOURCES).resources == {}
    assert conflict(allocatable, ()).resources == {}  # --device-plugin-resources ""


def test_a_vendors_resource_withholds_that_vendors_gpus_and_another_domain_all() -> None:
    nvidia, amd = _device(Vendor.NVIDIA), _device(Vendor.AMD)
    by_nvidia = Conflict({"nvidia.com/gpu": 8})
    assert (by_nvidia.withheld(nvidia), by_nvidia.withheld(amd)) == (True, False)
    by_rocm = Conflict({"amd.com/gpu": 1})
    assert (by_rocm.withheld(nvidia), by_rocm.withheld(amd)) == (False, True)
    by_other = Conflict({"drasil.dev/gpu": 2})
    assert (by_other.withheld(nvidia), by_other.withheld(amd)) == (True, True)


def test_the_message_names_the_resource_the_count_and_the_way_out() -> None:
    text = Conflict({"nvidia.com/gpu": 8}).message("node-a", 8)
    assert "Node node-a has allocatable nvidia.com/gpu: 8" in text
    assert "none of its 8 nvidia device(s)" in text
    assert "nvidia.com/gpu.deploy.device-plugin=false" in text
    assert "--device-plugin-resources" in text


class _Node:
    """The Node's allocatable as the API server has it, changed by the test."""

    def __init__(self) -> None:
        self.allocatable: dict[str, str] | None = {"cpu": "8"}
        self.uid = "node-uid"

    def get_node_allocatable(self, name: str) -> dict[str, str] | None:
        return self.allocatable

    def get_node_uid(self, name: str) -> str | None:
        return self.uid


@pytest.fixture
def node_pool(tmp_path: Path) -> tuple[NodeSlices, list[Device]]:
    devices = simulated_node(tmp_path, "h100-80gb:2").discover()
    pool = NodeSlices(
        _Node(),  # type: ignore[arg-type]
        driver="gpu.drasil.dev",
        node_name=NODE,
        devices=devices,
        health=HealthTracker(devices),
        publisher=None,  # type: ignore[arg-type]
    )
    return pool, devices


def _published(pool: NodeSlices) -> list[str]:
    return sorted(d["name"] for s in pool.desired() for d in s["spec"].get("devices", ()))


def test_the_guard_withholds_while_the_node_advertises_and_publishes_again_after(
    node_pool: tuple[NodeSlices, list[Device]],
) -> None:
    pool, devices = node_pool
    node = _Node()
    seen: list[dict[str, int]] = []

    def changed(found: Conflict) -> None:
        seen.append(dict(found.resources))
        pool.withhold(found.withheld if found.resources else None)

    guard = DoubleBookingGuard(
        node,  # type: ignore[arg-type]
        node_name=NODE,
        patterns=DEVICE_PLUGIN_RESOURCES,
        on_change=changed,
    )
    assert not guard.check_once()
    assert _published(pool) == sorted(d.name for d in devices)
    node.allocatable = {"cpu": "8", "nvidia.com/gpu": "2"}  # NVIDIA's plugin registered
    assert guard.check_once()
    assert _published(pool) == []
    assert not guard.check_once()  # nothing new: no second report
    node.allocatable = None  # the Node cannot be read: the last state stands
    assert not guard.check_once()
    assert _published(pool) == []
    node.allocatable = {"cpu": "8", "nvidia.com/gpu": "0"}  # its plugin is gone
    assert guard.check_once()
    assert _published(pool) == sorted(d.name for d in devices)
    assert seen == [{"nvidia.com/gpu": 2}, {}]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", ()),
        (" drasil.dev/gpu , nvidia.com/mig-* ", ("drasil.dev/gpu", "nvidia.com/mig-*")),
    ],
)
def test_the_resources_are_a_comma_separated_list(value: str, expected: tuple[str, ...]) -> None:
    opts = parse_options([f"--node-name={NODE}", f"--device-plugin-resources={value}"], {})
    assert opts.device_plugin_resources == expected


@pytest.mark.parametrize("value", ["gpu", "nvidia.com/", "NVIDIA.com/gpu", "nvidia.com/gpu x"])
def test_a_resource_that_is_no_extended_resource_name_is_refused(value: Any) -> None:
    with pytest.raises(OptionsError, match=r"--device-plugin-resources: .* <domain>/<name>"):
        parse_options([f"--node-name={NODE}", f"--device-plugin-resources={value}"], {})

"""``--gpu-sharing consumable`` in the node daemon: DRA mode publishes shareable GPUs,
device-plugin mode keeps them exclusive."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubelet_client import NODE
from prometheus_client import CollectorRegistry

from drasil.driver.nvidia.simulated import simulated_library
from drasil.kubeletplugin.metrics import devices_gauge
from drasil.kubeletplugin.node import NodeRuntime
from drasil.kubeletplugin.options import parse_options


def _node(tmp_path: Path, *extra: str) -> NodeRuntime:
    flags = [
        f"--node-name={NODE}",
        "--backend=simulated",
        "--simulated-profile=l4:2",
        f"--plugins-dir={tmp_path / 'plugins'}",
        f"--registrar-dir={tmp_path / 'registry'}",
        "--metrics-addr=0",
        "--health-addr=0",
        *extra,
    ]
    opts = parse_options(flags, {})
    lib = simulated_library(opts.simulated_profile, node_name=NODE)
    return NodeRuntime(opts, lib=lib, devices_gauge=devices_gauge(CollectorRegistry()))


@pytest.mark.parametrize(
    ("flags", "shared"),
    [
        ((), False),
        (("--gpu-sharing=consumable",), True),
        (("--gpu-sharing=consumable", "--mode=device-plugin"), False),
    ],
)
def test_gpu_sharing_reaches_discovery(
    tmp_path: Path, flags: tuple[str, ...], shared: bool
) -> None:
    devices = _node(tmp_path, *flags).discover()
    assert [d.allow_multiple_allocations for d in devices] == [shared, shared]

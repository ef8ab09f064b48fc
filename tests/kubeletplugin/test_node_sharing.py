"""``--gpu-sharing consumable`` in the node daemon: DRA mode publishes shareable GPUs,
device-plugin mode keeps them exclusive."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubelet_client import simulated_node

from drasil.kubeletplugin.node import NodeRuntime


def _node(tmp_path: Path, *extra: str) -> NodeRuntime:
    return simulated_node(tmp_path, "l4:2", *extra)


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

"""Fake AMD sysfs trees for the AMD tests: one per simulated model."""

from __future__ import annotations

from pathlib import Path

from drasil.driver.amd.devices import AmdDiscovery, discover_amd
from drasil.driver.simulated.amdsysfs import write_simulated_tree

NODE = "node-a"


def tree(tmp_path: Path, *entries: tuple[str, int], node_name: str = NODE) -> Path:
    """Write a simulated tree of ``entries`` under ``tmp_path/sys`` and return it."""
    root = tmp_path / "sys"
    write_simulated_tree(list(entries), root, node_name=node_name)
    return root


def discover(tmp_path: Path, *entries: tuple[str, int]) -> AmdDiscovery:
    return discover_amd(tree(tmp_path, *entries))

"""The node daemon's package rules (``drasil.kubeletplugin``'s docstring): DRA mode and
device-plugin mode never import each other, and the daemon loads neither the CEL
engine nor ``explain``, which serve the CLI and the controller."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kubeletplugin"


def imported(path: Path) -> set[str]:
    """The drasil modules a file imports (``from x import y`` counts as x and x.y)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("drasil.")}


@pytest.mark.parametrize(("package", "other"), [("dra", "deviceplugin"), ("deviceplugin", "dra")])
def test_the_two_modes_never_import_each_other(package: str, other: str) -> None:
    forbidden = f"drasil.kubeletplugin.{other}"
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            n for n in imported(path) if n == forbidden or n.startswith(f"{forbidden}.")
        )
        for path in sorted((PACKAGE / package).rglob("*.py"))
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_daemon_loads_neither_cel_nor_explain() -> None:
    script = (
        "import sys, drasil.kubeletplugin.main\n"
        "print(' '.join(m for m in sys.modules if m.startswith("
        "('drasil.driver.cel', 'drasil.driver.explain'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True
    ).stdout.split()
    assert loaded == []

"""docs/design.md stays true to the code where a newcomer reads it first: the CLI's
verbs, the health sources, the vendor seam's types."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from drasil.driver import cli, health
from drasil.driver.amd import health as amd_health
from drasil.driver.nvidia import xid
from drasil.kubeletplugin.vendors.nvidia.mps import watch

ROOT = Path(__file__).parents[2]
DESIGN = (ROOT / "docs" / "design.md").read_text()


def _section(title: str) -> str:
    return DESIGN.split(f"\n### {title}\n", 1)[1].split("\n### ", 1)[0]


def test_the_cli_verbs_are_the_ones_drasil_has() -> None:
    line = DESIGN.split("- `drasil` (also `kubectl drasil`): ", 1)[1].split("\n\n", 1)[0]
    named = {m.split()[0] for m in re.findall(r"`([^`]+)`", line)}
    verbs: set[str] = set()
    for action in cli._parser()._actions:
        if isinstance(action.choices, dict):
            verbs |= set(action.choices)
    assert verbs, "the drasil command's verbs"
    assert named == verbs


def test_every_health_source_is_described() -> None:
    described = set(re.findall(r"^- `([a-z]+)`:", _section("Health"), re.MULTILINE))
    assert described == {xid.SOURCE, health.FAULTS_SOURCE, amd_health.SOURCE, watch.SOURCE}


def test_the_vendor_seam_section_names_every_protocol_of_the_seam() -> None:
    seam = ROOT / "kubeletplugin" / "vendors" / "seam.py"
    classes = {
        node.name
        for node in ast.parse(seam.read_text()).body
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_")
    }
    text = _section("Vendor backends")
    missing = sorted(c for c in classes if f"`{c}`" not in text)
    assert missing == [], f"docs/design.md#vendor-backends does not name {missing}"

"""Only ``drasil.driver.objects`` walks the API's JSON of claims, Pods and statuses.

Everything else reads ``status``, ``status.allocation`` and ``status.reservedFor``
through its views (``ResourceClaim``, ``Pod``, ``status_of``, ``conditions``), so a
field's absence or garbage is handled once. import-linter sees imports, not dict
reads; this test reads the code instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "driver", "kubeletplugin", "controller")
FIELDS = {"status", "allocation", "reservedFor", "resourceClaimStatuses"}
ALLOWED = {
    "driver/objects.py",  # the views
    "driver/kubeapi.py",  # the boundary: requests and responses
    # Validates a claim's allocation on the prepare path and names each malformed
    # field in its error, which the views (garbage counts as absent) cannot.
    "driver/claims/deviceconfigs.py",
}


def _reads(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        key: ast.expr | None = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
        ):
            key = node.args[0]
        if isinstance(key, ast.Constant) and key.value in FIELDS:
            found.append((node.lineno, str(key.value)))
    return found


def test_raw_reads_of_statuses_are_in_the_objects_module_alone() -> None:
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ALLOWED or "/schemas/" in rel or rel.endswith("_pb2.py"):
                continue
            for line, field in _reads(ast.parse(path.read_text(), rel)):
                offenders.append(f"{rel}:{line}: {field}")
    assert offenders == []

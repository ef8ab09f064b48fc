"""A claim's CDI spec: the official CDI JSON Schema, drasil's own rules, and NVIDIA's
generator (``nvidia-ctk cdi generate``) as the oracle of the driver files it mounts.

The schema (draft-07, ``cdi-schema.json`` with ``cdi-defs.json``) is a copy of
``schema/`` of cncf-tags/container-device-interface (``cdi-schema.md`` says which); it
travels with the package so that the check needs no clone, and the tests validate with
it too. The comparison is the one ``e2e/test_nvidia_oracle.py`` makes on fake roots, here
on the node's real driver: management mode, an empty toolkit config, the same hook.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from drasil.driver.cdi.metadata import CONTAINER_DIR
from drasil.driver.cdi.spec import validate_spec

HERE = Path(__file__).resolve().parent
SCHEMA_FILE = HERE / "cdi-schema.json"
DEFS_FILE = HERE / "cdi-defs.json"
CTK_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CTK_TIMEOUT_S = 120


def schema_validator() -> Any:
    """The official CDI schema with its ``defs.json`` resolved."""
    defs = json.loads(DEFS_FILE.read_text())
    registry: Registry[Any] = Registry().with_resource(
        "defs.json", Resource.from_contents(defs, default_specification=DRAFT7)
    )
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema, registry=registry)


def spec_problems(spec: Mapping[str, Any]) -> list[str]:
    """Every schema error, then drasil's own rules (``validate_spec``: what the
    schema cannot say, e.g. env entries, which its broken ``ref`` never checks)."""
    problems = [
        f"schema: {'/'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message}"
        for e in schema_validator().iter_errors(spec)
    ]
    try:
        validate_spec(spec)
    except Exception as err:  # CdiSpecError, or a malformed spec the rules trip on
        problems.append(f"drasil rules: {err}")
    return problems


def _edits(spec: Mapping[str, Any], devices: Iterable[str] | None) -> list[Mapping[str, Any]]:
    wanted = None if devices is None else set(devices)
    found = [spec.get("containerEdits") or {}]
    found += [
        d.get("containerEdits") or {}
        for d in spec.get("devices") or []
        if wanted is None or d["name"] in wanted
    ]
    return found


def mounts(spec: Mapping[str, Any], devices: Iterable[str] | None = None) -> dict[str, str]:
    """containerPath -> hostPath of the spec-wide edits and ``devices`` (all if None)."""
    edits = _edits(spec, devices)
    return {m["containerPath"]: m["hostPath"] for e in edits for m in e.get("mounts") or []}


def device_nodes(spec: Mapping[str, Any], devices: Iterable[str] | None = None) -> set[str]:
    """The host nodes (``hostPath``, else ``path``): a generator given a dev root other
    than ``/`` may spell the container path either way."""
    edits = _edits(spec, devices)
    return {d.get("hostPath") or d["path"] for e in edits for d in e.get("deviceNodes") or []}


def hook_names(spec: Mapping[str, Any], devices: Iterable[str] | None = None) -> list[str]:
    return [
        (h.get("args") or ["", PurePosixPath(h["path"]).name])[1]
        for e in _edits(spec, devices)
        for h in e.get("hooks") or []
    ]


@dataclass(frozen=True)
class Comparison:
    problems: tuple[str, ...]
    notes: tuple[str, ...]


def compare_with_ctk(
    ours: Mapping[str, Any], devices: Sequence[str], theirs: Mapping[str, Any], *, gpu_node: str
) -> Comparison:
    """What drasil's spec, as the container of ``devices`` gets it, lacks or adds
    against nvidia-ctk's management spec. ``gpu_node``: the claimed GPU's node; the
    other GPUs' nodes and the MIG management nodes (``/dev/nvidia-caps``) are
    management mode's, not a whole GPU's."""
    our_mounts = {p: h for p, h in mounts(ours, devices).items() if not p.startswith(CONTAINER_DIR)}
    their_mounts = mounts(theirs)
    lacks, adds = their_mounts.keys() - our_mounts.keys(), our_mounts.keys() - their_mounts.keys()
    problems = [f"mount {p}: nvidia-ctk has it, drasil lacks it" for p in sorted(lacks)]
    problems += [f"mount {p}: drasil adds it, nvidia-ctk has none" for p in sorted(adds)]
    problems += [
        f"mount {p}: host path {our_mounts[p]} (drasil) vs {their_mounts[p]} (nvidia-ctk)"
        for p in sorted(our_mounts.keys() & their_mounts.keys())
        if our_mounts[p] != their_mounts[p]
    ]
    our_nodes, their_nodes = device_nodes(ours, devices), device_nodes(theirs)
    added = sorted(our_nodes - their_nodes)
    problems += [f"device node {n}: drasil adds it, nvidia-ctk has none" for n in added]
    other = {n for n in their_nodes - our_nodes if _management_only(n, gpu_node)}
    lacking = sorted(their_nodes - our_nodes - other)
    problems += [f"device node {n}: nvidia-ctk has it, drasil lacks it" for n in lacking]
    notes = [f"not in the claim (management mode's): {', '.join(sorted(other))}"] if other else []
    ours_h, theirs_h = hook_names(ours, devices), hook_names(theirs)
    notes.append(f"hooks: drasil {ours_h}, nvidia-ctk {theirs_h}")
    return Comparison(tuple(problems), tuple(notes))


def _management_only(node: str, gpu_node: str) -> bool:
    name = PurePosixPath(node).name
    is_gpu = name.startswith("nvidia") and name[len("nvidia") :].isdigit()
    return (is_gpu and node != gpu_node) or "/nvidia-caps/" in node


def find_ctk() -> str | None:
    return shutil.which("nvidia-ctk")


def ctk_spec(ctk: str, *, driver_root: str, dev_root: str, hook: str) -> dict[str, Any]:
    """``nvidia-ctk cdi generate --mode=management`` of the node, as parsed JSON.
    Raises ``RuntimeError`` with its log when it fails."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-ctk-") as tmp:
        config, output = Path(tmp) / "config.toml", Path(tmp) / "spec.json"
        config.write_text("")  # hermetic: not the node's runtime config
        command = [
            ctk,
            f"--config={config}",
            "cdi",
            "generate",
            "--mode=management",
            f"--driver-root={driver_root}",
            f"--dev-root={dev_root}",
            f"--nvidia-cdi-hook-path={hook}",
            "--format=json",
            f"--output={output}",
        ]
        env = {"PATH": CTK_PATH, "HOME": tmp, "LANG": "C"}
        env |= {k: v for k, v in os.environ.items() if k.startswith(("DRASIL_MOCK", "FAKE_"))}
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=CTK_TIMEOUT_S, check=False
        )
        if done.returncode != 0 or not output.is_file():
            raise RuntimeError(f"nvidia-ctk exited {done.returncode}: {done.stderr[-2000:]}")
        spec: dict[str, Any] = json.loads(output.read_text())
        return spec

"""constraints.txt: the pins of every distribution the image installs.

The Dockerfile installs drasil's dependencies with `--constraint constraints.txt`, so
every build of the same commit gets the same versions. `write_constraints()` makes the
file from the running environment (`.venv`): the distributions drasil needs at run time
(its requirements and theirs, without extras, markers evaluated here) at the versions
installed, which are the versions the tests ran with.
"""

from __future__ import annotations

import importlib.metadata

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from e2e.harness import paths

FILE = paths.CHECKOUT / "constraints.txt"
HEADER = (
    "# pip constraints of the image (Dockerfile): every distribution drasil needs at run\n"
    "# time, pinned to what the tests ran with. Regenerate from a fresh .venv:\n"
    "#   .venv/bin/python -m tools.image constraints\n"
)


def runtime_versions(project: str = "drasil") -> dict[str, str]:
    """Canonical name -> installed version of what `project` needs at run time."""
    environment = {k: str(v) for k, v in default_environment().items()} | {"extra": ""}
    found: dict[str, str] = {}
    todo = [project]
    while todo:
        for text in importlib.metadata.distribution(todo.pop()).requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(environment):
                continue
            name = canonicalize_name(req.name)
            if name not in found:
                found[name] = importlib.metadata.distribution(req.name).version
                todo.append(req.name)
    return dict(sorted(found.items()))


def render(versions: dict[str, str]) -> str:
    return HEADER + "".join(f"{name}=={version}\n" for name, version in versions.items())


def pinned() -> dict[str, str]:
    """What constraints.txt pins (canonical name -> version)."""
    pins: dict[str, str] = {}
    for raw in FILE.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version
    return pins


def write_constraints() -> str:
    text = render(runtime_versions())
    paths.write_atomic(FILE, text)
    return text

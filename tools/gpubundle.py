"""``make gpu-check-bundle``: ``build/gpu-check/``, the GPU check for a bare GPU machine.

The machine has the NVIDIA driver and a python3 (3.10 to 3.13, x86_64 or aarch64), and
maybe no pip and no network. The bundle carries:

- ``src/drasil/``: drasil's ``api``, ``driver`` and ``kubeletplugin`` packages (the
  check's import closure lies in them; the generated gRPC stubs of ``api/kubelet`` and
  the controller stay out);
- ``lib/pure/``: the pure-Python wheels of the check's dependencies, unpacked once;
- ``wheels/cp3XX-<machine>/``: the binary wheels (pydantic-core, PyYAML, rpds-py) per
  interpreter and architecture, as ``pip download --only-binary=:all: --platform
  manylinux...`` fetched them from PyPI (the versions this venv has), kept zipped: eight
  unpacked copies would pass the bundle's 60 MiB;
- ``run.py``: unpacks the running interpreter's binary wheels into ``lib/<tag>/`` on
  first use (a temp dir where the bundle is read-only), puts that folder, ``lib/pure``
  and ``src`` on ``sys.path``, installs ``drasil.kubeletplugin.gpucheck.compat`` (3.10
  names) and runs the check with its arguments.

Wheels are cached under ``<cache>/gpu-check/wheels/``; a rebuild without network works
from the cache.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

from e2e.harness import paths

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DEST = REPO / "build" / "gpu-check"
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
MACHINES = {
    "x86_64": ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64"),
    "aarch64": ("manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_28_aarch64"),
}
# The check's third-party imports (the rest of their closure comes as their deps).
REQUIREMENTS = ("pydantic", "PyYAML", "nvidia-ml-py", "jsonschema")
PACKAGES = ("api", "driver", "kubeletplugin")
LEFT_OUT = ("__pycache__", "kubelet")  # api/kubelet: gRPC stubs the check never imports
MAX_BYTES = 60 * 2**20

RUN_PY = '''#!/usr/bin/env python3
"""The GPU check of drasil (docs/gpu-check.md): python3 run.py [--help]."""

import os
import platform
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))


def binary_folder(tag):
    """lib/<tag>: the interpreter's binary wheels, unpacked on first use."""
    wheels = os.path.join(HERE, "wheels", tag)
    if not os.path.isdir(wheels):
        return None
    target = os.path.join(HERE, "lib", tag)
    if os.path.isdir(target):
        return target
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        work = tempfile.mkdtemp(prefix="." + tag, dir=os.path.dirname(target))
    except OSError:  # a read-only bundle: unpack where this run may write
        work = target = tempfile.mkdtemp(prefix="gpu-check-" + tag + "-")
    for name in sorted(os.listdir(wheels)):
        with zipfile.ZipFile(os.path.join(wheels, name)) as z:
            z.extractall(work)
    if work != target:
        try:
            os.rename(work, target)
        except OSError:  # another run got there first
            return target if os.path.isdir(target) else work
    return target


def main():
    tag = "cp%d%d-%s" % (sys.version_info[0], sys.version_info[1], platform.machine())
    binary = binary_folder(tag)
    if binary is None:
        known = sorted(os.listdir(os.path.join(HERE, "wheels")))
        sys.stderr.write("gpu-check: no wheels for %s (the bundle has %s)\\n" % (tag, known))
        return 2
    paths = [os.path.join(HERE, "src"), binary, os.path.join(HERE, "lib", "pure")]
    sys.path[:0] = paths
    # The programs the check starts with this interpreter (the MPS step's mpsview) too.
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + given)
    from drasil.kubeletplugin.gpucheck import compat

    compat.install()
    from drasil.kubeletplugin.gpucheck.main import main as check

    return check(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
'''


def _pins() -> list[str]:
    """The requirements at the versions this venv has (what the tests ran with)."""
    return [f"{name}=={importlib.metadata.version(name)}" for name in REQUIREMENTS]


def _download(python: str, machine: str, into: Path) -> list[Path]:
    into.mkdir(parents=True, exist_ok=True)
    abi = "cp" + python.replace(".", "")
    platforms = [a for p in MACHINES[machine] for a in ("--platform", p)]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--only-binary=:all:",
        *platforms,
        "--python-version",
        python,
        "--implementation",
        "cp",
        "--abi",
        abi,
        "--dest",
        str(into),
        *_pins(),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        wheels = sorted(into.glob("*.whl"))
        if wheels:  # offline: the cache of an earlier build
            print(f"pip download failed for {abi}-{machine}; using the cached wheels")
            return wheels
        raise RuntimeError(f"pip download for {abi}-{machine} failed:\n{done.stderr[-3000:]}")
    return sorted(into.glob("*.whl"))


def _is_pure(wheel: Path) -> bool:
    return wheel.name.endswith("-none-any.whl")


def _unpack(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest)


def _copy_code(dest: Path) -> None:
    for package in PACKAGES:
        shutil.copytree(
            REPO / package,
            dest / "src" / "drasil" / package,
            ignore=shutil.ignore_patterns(*LEFT_OUT),
        )


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def build(dest: Path) -> Path:
    cache = paths.cache_root() / "gpu-check" / "wheels"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    _copy_code(dest)
    pure_done: set[str] = set()
    for python in PYTHONS:
        for machine in MACHINES:
            tag = f"cp{python.replace('.', '')}-{machine}"
            for wheel in _download(python, machine, cache / tag):
                if not _is_pure(wheel):
                    (dest / "wheels" / tag).mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(wheel, dest / "wheels" / tag / wheel.name)
                elif wheel.name not in pure_done:
                    _unpack(wheel, dest / "lib" / "pure")
                    pure_done.add(wheel.name)
    (dest / "run.py").write_text(RUN_PY)
    (dest / "run.py").chmod(0o755)
    size = _size(dest)
    if size > MAX_BYTES:
        raise RuntimeError(f"{dest} is {size / 2**20:.1f} MiB, over {MAX_BYTES / 2**20:.0f} MiB")
    print(f"{dest}: {size / 2**20:.1f} MiB")
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gpubundle")
    p.add_argument("dest", nargs="?", type=Path, default=DEFAULT_DEST)
    build(p.parse_args(argv).dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
- ``containers.tar.xz``: the container step's kit (``e2e.harness.containerkit``:
  containerd, its runc shim, runc, ctr, nvidia-cdi-hook, runc's libseccomp, the probe
  image), xz-compressed (about 85 MiB unpacked) and cached by its inputs' digest;
- ``run.py``: unpacks the running interpreter's binary wheels into ``lib/<tag>/`` and
  the kit into ``containers/`` on first use (temp dirs where the bundle is read-only),
  puts the wheels' folder, ``lib/pure`` and ``src`` on ``sys.path``, installs
  ``drasil.kubeletplugin.gpucheck.compat`` (3.10 names) and runs the check with its
  arguments (and ``--container-kit`` where they name none).

Wheels are cached under ``<cache>/gpu-check/wheels/``; a rebuild without network works
from the cache.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from e2e.harness import containerkit, paths

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
import tarfile
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))


def unpack_once(target, extract):
    """``target``, made on first use by ``extract(folder)`` in a temp folder beside it and
    renamed into place (a temp dir elsewhere where the bundle is read-only)."""
    name = os.path.basename(target)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        work = tempfile.mkdtemp(prefix="." + name, dir=os.path.dirname(target))
    except OSError:  # a read-only bundle: unpack where this run may write
        work = target = tempfile.mkdtemp(prefix="gpu-check-" + name + "-")
    extract(work)
    if work != target:
        try:
            os.rename(work, target)
        except OSError:  # another run got there first
            return target if os.path.isdir(target) else work
    return target


def binary_folder(tag):
    """lib/<tag>: the interpreter's binary wheels, unpacked on first use."""
    wheels = os.path.join(HERE, "wheels", tag)
    if not os.path.isdir(wheels):
        return None
    target = os.path.join(HERE, "lib", tag)
    if os.path.isdir(target):
        return target

    def extract(work):
        for name in sorted(os.listdir(wheels)):
            with zipfile.ZipFile(os.path.join(wheels, name)) as z:
                z.extractall(work)

    return unpack_once(target, extract)


def container_kit():
    """containers/: the container step's kit, unpacked on first use; None without one."""
    packed = os.path.join(HERE, "containers.tar.xz")
    if not os.path.isfile(packed):
        return None
    target = os.path.join(HERE, "containers")
    if os.path.isfile(os.path.join(target, "kit.json")):
        return target
    # The "data" filter where the interpreter has it (3.12, and 3.10/3.11 updates).
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}

    def extract(work):
        with tarfile.open(packed) as tar:
            tar.extractall(work, **safe)

    return unpack_once(target, extract)


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

    args = sys.argv[1:]
    kit = container_kit()
    if kit is not None and not any(a.startswith("--container-kit") for a in args):
        args.append("--container-kit=" + kit)
    return check(args)


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


def _packed_kit(cache: Path) -> Path:
    """The container kit as a tar.xz, from the cache where its inputs are unchanged
    (compressing takes a minute of CPU)."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-kit-") as tmp:
        kit = containerkit.build_kit(Path(tmp) / "kit")
        digest = hashlib.sha256()
        for path in sorted(p for p in kit.rglob("*") if p.is_file()):
            digest.update(path.relative_to(kit).as_posix().encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
        packed = cache / f"containers-{digest.hexdigest()[:16]}.tar.xz"
        if not packed.is_file():
            cache.mkdir(parents=True, exist_ok=True)
            partial = packed.with_suffix(".partial")
            with tarfile.open(partial, "w:xz") as tar:
                for path in sorted(kit.iterdir()):
                    tar.add(path, arcname=path.name)
            partial.rename(packed)
    return packed


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
    shutil.copyfile(_packed_kit(paths.cache_root() / "gpu-check"), dest / "containers.tar.xz")
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

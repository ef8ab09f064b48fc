"""C built at test time with the system compiler, cached by a key under the e2e cache.

The fake driver roots' libraries (e2e.harness.driverroot) and the mock NVML
(e2e.harness.mocknvml) are both compiled here: into a temp folder beside the target,
renamed into place when all went well, so that two runs never see half a build and a
failed build leaves nothing.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path


def compiler() -> str:
    return os.environ.get("CC") or "cc"


def compile_c(cmd: Sequence[str], *, error: type[Exception]) -> None:
    """Run a compiler command; ``error`` names it and what it said when it fails."""
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    except OSError as e:
        raise error(f"no C compiler ({shlex.join(cmd)}): {e}") from e
    if done.returncode != 0:
        raise error(f"{shlex.join(cmd)} failed:\n{done.stderr[-4000:]}")


def cached_build(target: Path, build: Callable[[Path], None]) -> Path:
    """``target`` (a folder), made by ``build(work_folder)`` on first use."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        build(work)
        try:
            os.rename(work, target)
        except OSError:
            if not target.is_dir():  # not another process that got there first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target

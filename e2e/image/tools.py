"""What every step of the image build shares: its error, running a host tool (apt,
dpkg, pip, ctr) as a named step, and the cache directory with its lock."""

from __future__ import annotations

import contextlib
import fcntl
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from e2e import paths

# Bump when what the image build writes changes in a way its inputs do not show.
FORMAT = 1


class ImageBuildError(RuntimeError):
    """A step of the image build failed; says which and why."""


def images_dir() -> Path:
    """`<cache>/images/drasil/`: archives, base layers, remembered package lists."""
    return paths.cache_root() / "images" / "drasil"


def run(
    step: str, cmd: Sequence[str], *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> str:
    """The stdout of `cmd`; ImageBuildError naming `step` and the output's tail when it
    fails."""
    try:
        done = subprocess.run(
            list(cmd), capture_output=True, text=True, check=False, timeout=900, cwd=cwd, env=env
        )
    except OSError as e:
        raise ImageBuildError(f"{step}: cannot run {cmd[0]}: {e}") from e
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-30:])
        raise ImageBuildError(f"{step} failed ({done.returncode}): {' '.join(cmd)}\n{tail}")
    return done.stdout


@contextlib.contextmanager
def lock() -> Iterator[None]:
    """Two sessions building at once would race on the same cache files."""
    images_dir().mkdir(parents=True, exist_ok=True)
    with open(images_dir() / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield

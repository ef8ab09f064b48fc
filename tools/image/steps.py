"""What every step of the image build shares: its error, running a host tool (buildah,
mmdebstrap, ctr) as a named step, the cache directory with its lock, and the hashes
the cache keys are made of."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from e2e.harness import paths
from e2e.harness.binaries import BuildError, Writer, ensure_host_tools

# Bump when what the image build writes changes in a way its inputs do not show.
FORMAT = 3  # 3: the image carries nvidia-cdi-hook (a Go stage)
# buildah runs RUN steps in a chroot: no OCI runtime, no cgroups, no user namespace.
# (crun fails on hosts whose cgroups are in hybrid mode; the steps need none of it.)
ISOLATION = "chroot"


class ImageBuildError(RuntimeError):
    """A step of the image build failed; says which and why."""


def images_dir() -> Path:
    """`<cache>/images/drasil/`: archives, base root filesystems, their metadata."""
    return paths.cache_root() / "images" / "drasil"


def run(
    step: str,
    cmd: Sequence[str],
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 1200,
) -> str:
    """The stdout of `cmd`; ImageBuildError naming `step` and the output's tail when it
    fails."""
    try:
        done = subprocess.run(
            list(cmd),
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            cwd=cwd,
            env=env,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ImageBuildError(f"{step}: cannot run {cmd[0]}: {e}") from e
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-30:])
        raise ImageBuildError(f"{step} failed ({done.returncode}): {' '.join(cmd)}\n{tail}")
    return done.stdout


def ensure_tools(tools: Iterable[str], out: Writer) -> None:
    """Install the host tools the build needs (apt-get) when they are missing."""
    try:
        ensure_host_tools(tools, out=out)
    except BuildError as e:
        raise ImageBuildError(str(e)) from e


def buildah(step: str, *args: str, timeout: float = 1200) -> str:
    """`buildah ARGS`: its stdout, or ImageBuildError naming `step`."""
    env = {**os.environ, "BUILDAH_ISOLATION": ISOLATION}
    return run(step, ["buildah", *args], env=env, timeout=timeout)


def image_exists(name: str) -> bool:
    """Whether buildah's local storage holds an image `name`."""
    done = subprocess.run(
        ["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", name],
        capture_output=True,
        check=False,
        timeout=60,
    )
    return done.returncode == 0


def hash_files(files: Iterable[Path], *, root: Path) -> str:
    """A hash of the names (relative to `root`), modes and contents of `files`."""
    sha = hashlib.sha256()
    for path in sorted(files):
        rel = path.relative_to(root).as_posix()
        sha.update(f"{rel}\0{path.stat().st_mode & 0o777:o}\0".encode())
        sha.update(hashlib.sha256(path.read_bytes()).digest())
    return sha.hexdigest()


@contextlib.contextmanager
def lock() -> Iterator[None]:
    """Two sessions building at once would race on the same cache files."""
    images_dir().mkdir(parents=True, exist_ok=True)
    with open(images_dir() / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield

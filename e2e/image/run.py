"""Using the image: its root filesystem, its environment, running a command in it like
a container (`sandbox_command`), and loading it into containerd (`import_image`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from e2e import oci
from e2e.image.local import LocalImage
from e2e.image.tools import ImageBuildError, run

SANDBOX = Path(__file__).resolve().with_name("sandbox.py")


def unpack(image: LocalImage, into: Path) -> Path:
    """The image's root filesystem: its layers extracted in order into `into`."""
    return oci.unpack(image.archive, image.layers, into)


def sandbox_command(
    rootfs: Path,
    argv: Sequence[str],
    *,
    binds: dict[str, Path],
    env: dict[str, str],
    uid: int = 0,
    gid: int = 0,
    tmpfs: Sequence[str] = ("/tmp",),
) -> list[str]:
    """A command line that runs `argv` from the unpacked image `rootfs` like a
    container (see e2e/image/sandbox.py); needs root. `binds` maps container paths to
    host paths; their mount points are made in `rootfs`, which must be a scratch copy."""
    for target in [*binds, *tmpfs, "/proc", "/dev"]:
        (rootfs / target.lstrip("/")).mkdir(parents=True, exist_ok=True)
    spec = {
        "root": str(rootfs),
        "binds": [[target, str(source)] for target, source in binds.items()],
        "tmpfs": list(tmpfs),
        "workdir": "/",
        "uid": uid,
        "gid": gid,
        "argv": list(argv),
        "env": env,
    }
    # -I: neither this directory nor the environment's PYTHON* variables reach it.
    return [sys.executable, "-I", str(SANDBOX), json.dumps(spec)]


def image_env(image: LocalImage) -> dict[str, str]:
    """The image config's Env as a dict (what a runtime starts the container with)."""
    return dict(e.split("=", 1) for e in image.config["config"]["Env"])


def import_image(
    image: LocalImage, *, ctr: Path, address: str | Path, namespace: str = "k8s.io"
) -> None:
    """Load the archive into containerd (`ctr images import`), unpacked for its default
    snapshotter, in the namespace kubelet's CRI uses."""
    base = [str(ctr), "--address", str(address), "--namespace", namespace, "images"]
    run(f"ctr images import {image.name}", [*base, "import", str(image.archive)])
    listed = run("ctr images ls", [*base, "ls", "-q"])
    if image.name not in listed.split():
        raise ImageBuildError(f"ctr imported {image.archive} but lists no {image.name}:\n{listed}")

"""Using the image: its root filesystem, its environment, running a command in it like
a container (`sandbox_command`), and loading it into containerd (`import_image`)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

from tools.image.local import LocalImage
from tools.image.steps import ImageBuildError, run

SANDBOX = Path(__file__).resolve().with_name("sandbox.py")
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_SYMLINKS = 40  # as the kernel's limit


def unpack(image: LocalImage, into: Path) -> Path:
    """The image's root filesystem: the layers of its archive extracted in order into
    `into`, each layer's whiteouts (`.wh.` files) deleting what lower layers put there."""
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(image.archive) as outer:
        for layer in image.layers:
            member = outer.extractfile(f"blobs/sha256/{layer.removeprefix('sha256:')}")
            if member is None:
                raise ImageBuildError(f"{image.archive}: no layer {layer}")
            with tarfile.open(fileobj=member, mode="r|*") as tar:
                for entry in tar:
                    if not _whiteout(entry.name, into):
                        tar.extract(entry, into, filter="tar")
    return into


def _whiteout(name: str, root: Path) -> bool:
    """Apply `name` if it is an OCI whiteout (and say so)."""
    parent, _, base = name.rstrip("/").rpartition("/")
    if not base.startswith(WHITEOUT):
        return False
    directory = root / parent
    if base == OPAQUE:
        for child in directory.iterdir() if directory.is_dir() else []:
            _remove(child)
    else:
        _remove(directory / base.removeprefix(WHITEOUT))
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


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
    container (see tools/image/sandbox.py); needs root. `binds` maps container paths to
    host paths; their mount points are made in `rootfs`, which must be a scratch copy."""
    # Like a runtime, resolve each mount target's symlinks inside the image (Debian's
    # /var/run -> /run): the kernel would follow them out of it, onto the host.
    resolved_binds = {resolve_in(rootfs, target): source for target, source in binds.items()}
    resolved_tmpfs = [resolve_in(rootfs, target) for target in tmpfs]
    for target in [*resolved_binds, *resolved_tmpfs, "/proc", "/dev"]:
        (rootfs / target.lstrip("/")).mkdir(parents=True, exist_ok=True)
    spec = {
        "root": str(rootfs),
        "binds": [[target, str(source)] for target, source in resolved_binds.items()],
        "tmpfs": resolved_tmpfs,
        "workdir": "/",
        "uid": uid,
        "gid": gid,
        "argv": list(argv),
        "env": env,
    }
    # -I: neither this directory nor the environment's PYTHON* variables reach it.
    return [sys.executable, "-I", str(SANDBOX), json.dumps(spec)]


def resolve_in(root: Path, path: str) -> str:
    """`path` of the container with every symlink in it resolved within `root` (an
    absolute link starts again at `root`; `..` stops at it)."""
    todo = [p for p in path.split("/") if p]
    done: list[str] = []
    hops = 0
    while todo:
        part = todo.pop(0)
        if part in (".", ".."):
            done = done[:-1] if part == ".." else done
            continue
        here = root.joinpath(*done, part)
        if not here.is_symlink():
            done.append(part)
            continue
        hops += 1
        if hops > MAX_SYMLINKS:
            raise ImageBuildError(f"{path}: too many symlinks in {root}")
        link = os.readlink(here)
        done = [] if link.startswith("/") else done
        todo = [p for p in link.split("/") if p] + todo
    return "/" + "/".join(done)


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

"""Run an MPS program in the view its clients have: the daemon's ``/dev/shm``, the driver's files.

``MpsDaemons`` starts each MPS control daemon, and runs each control command, through
this wrapper::

    python -m drasil.kubeletplugin.vendors.nvidia.mps.view --pipe P --log L [--shm S] [--root R] \\
        -- nvidia-cuda-mps-control -d

Two things must hold for an MPS client in a container to reach the daemon, and for the
daemon to run at all (facts in docs/sharing.md):

- the server's shared-memory segments are created in its ``/dev/shm`` and opened by
  clients in theirs, so the daemon and every client of it get one tmpfs there (``S``,
  bind-mounted over ``/dev/shm`` in a mount namespace of the daemon's own, so the node's
  ``/dev/shm`` is untouched);
- the control daemon and the server it starts (``nvidia-cuda-mps-server``, found through
  ``PATH``) are the host driver's binaries, built against the host's libc: with a
  driver root ``R`` other than ``/`` they run chrooted into it, as NVIDIA runs them.
  Inside, the node's ``/dev``, ``/proc`` and ``/sys`` are bound over the root's, the
  pipe and log directories are bind-mounted at ``/tmp/nvidia-mps`` and
  ``/tmp/nvidia-log`` (on a tmpfs over ``R/tmp``, never written to the driver root) and
  the tmpfs ``S`` over ``R/dev/shm``. A root whose programs name a loader it does not
  hold (a GKE-style ``/usr/local/nvidia``: ``bin``, ``lib64``, built for the node's own
  loader) is not a root to chroot into: its program runs in place, with the root's
  library folders on ``LD_LIBRARY_PATH``.

Without ``--shm`` and with ``R`` = ``/`` (a control command on a host whose driver is
at ``/``) nothing is mounted and no privilege is needed. The program's directory is put
first on ``PATH``, so the control daemon finds the server next to it.

Standard library only, and drasil's ELF reader (ctypes for the mount calls Python 3.11 lacks).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from drasil.driver.nvidia.ldcache import elf_interpreter

CLONE_NEWNS: Final = 0x00020000
MS_BIND: Final = 4096
MS_REC: Final = 16384
MS_PRIVATE: Final = 1 << 18
MS_NOSUID: Final = 2
MS_NODEV: Final = 4
MS_NOEXEC: Final = 8
MNT_DETACH: Final = 2
PIPE_IN_ROOT: Final = "/tmp/nvidia-mps"
LOG_IN_ROOT: Final = "/tmp/nvidia-log"
# The node's own, bound over the root's where it has the folder: a driver root need not
# hold device nodes, /proc or /sys (a GKE-style /usr/local/nvidia has them empty, and
# read-only), and the daemon opens /dev/nvidia*, /proc/driver/nvidia and /sys there.
HOST_SYSTEM_DIRS: Final = ("dev", "proc", "sys")
# A root run in place: its library folders, for the server's libcuda.so.1.
ROOT_LIBRARY_DIRS: Final = (
    "lib64",
    "lib",
    "usr/lib64",
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
)


class ViewError(Exception):
    """The view could not be set up; the message says which step and why."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise ViewError(f"{what}: {os.strerror(errno)}")


def mount(source: str, target: Path, fstype: str | None, flags: int, data: str = "") -> None:
    """mount(2); ``ViewError`` with the system's reason."""
    _check(
        _libc().mount(
            source.encode(),
            str(target).encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def unmount_detached(target: Path) -> None:
    """umount2(2) with MNT_DETACH: whoever still holds a file there keeps it, the mount
    goes; ``ViewError`` with the system's reason."""
    _check(_libc().umount2(str(target).encode(), MNT_DETACH), f"unmount {target}")


def private_namespace() -> None:
    """A mount namespace of this process's own, whose mounts reach nobody else."""
    libc = _libc()
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(
        libc.mount(b"none", b"/", None, ctypes.c_ulong(MS_REC | MS_PRIVATE), None),
        "making / private",
    )


def bind(source: Path, target: Path) -> None:
    if not target.is_dir():
        raise ViewError(f"bind {source} on {target}: {target} is not a directory")
    mount(str(source), target, None, MS_BIND)


def _arguments(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="mpsview", description=__doc__.splitlines()[0])
    parser.add_argument("--pipe", type=Path, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--shm", type=Path)
    parser.add_argument("--root", type=Path, default=Path("/"))
    parser.add_argument("program", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        parser.error("no program after --")
    return args, program


@dataclass(frozen=True)
class View:
    """Where the program finds its directories once the view is set up, and how it is
    run there."""

    pipe: str
    log: str
    program: list[str]
    library_path: tuple[str, ...] = ()


def runs_chrooted(root: Path, program: str) -> bool:
    """Whether ``program`` (a path inside ``root``) runs chrooted into the root: it does
    unless it names a loader the root lacks, as in a GKE-style ``/usr/local/nvidia``
    (binaries for the node's own loader, libraries in ``lib64``), where it runs in
    place, as the node runs it."""
    loader = elf_interpreter(_inside(root, program))
    return loader is None or _inside(root, loader).exists()


def _inside(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def enter(args: argparse.Namespace, program: list[str]) -> View:
    """Set up the view of ``program``."""
    root = args.root.resolve()
    if root == Path("/") or not runs_chrooted(root, program[0]):
        if args.shm is not None:
            private_namespace()
            bind(args.shm, Path("/dev/shm"))
        if root == Path("/"):
            return View(str(args.pipe), str(args.log), program)
        in_place = [str(_inside(root, program[0])), *program[1:]]
        folders = tuple(str(f) for d in ROOT_LIBRARY_DIRS if (f := _inside(root, d)).is_dir())
        return View(str(args.pipe), str(args.log), in_place, folders)
    _chroot(root, args)
    return View(PIPE_IN_ROOT, LOG_IN_ROOT, program)


def _chroot(root: Path, args: argparse.Namespace) -> None:
    private_namespace()
    for system in HOST_SYSTEM_DIRS:
        if (root / system).is_dir():
            mount(f"/{system}", root / system, None, MS_BIND | MS_REC)
    tmp = root / "tmp"
    if not tmp.is_dir():
        raise ViewError(f"driver root {root} has no /tmp to hold the pipe and log directories")
    mount("tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=1777")
    for name, source in (("nvidia-mps", args.pipe), ("nvidia-log", args.log)):
        (tmp / name).mkdir()
        bind(source, tmp / name)
    if args.shm is not None:
        bind(args.shm, root / "dev" / "shm")
    os.chroot(root)
    os.chdir("/")


def _environment(view: View) -> dict[str, str]:
    env = dict(os.environ)
    env["CUDA_MPS_PIPE_DIRECTORY"] = view.pipe
    env["CUDA_MPS_LOG_DIRECTORY"] = view.log
    directory = os.path.dirname(view.program[0])
    if directory:  # the control daemon starts nvidia-cuda-mps-server through PATH
        env["PATH"] = f"{directory}:{env.get('PATH', '/usr/bin:/bin')}"
    if view.library_path:  # the server loads libcuda.so.1 of the root
        given = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
        env["LD_LIBRARY_PATH"] = ":".join([*view.library_path, *given])
    return env


def main(argv: Sequence[str] | None = None) -> int:
    args, program = _arguments(argv)
    try:
        view = enter(args, program)
    except (OSError, ViewError) as err:
        print(f"mpsview: {err}", file=sys.stderr)
        return 1
    try:
        os.execvpe(view.program[0], view.program, _environment(view))
    except OSError as err:
        where = f" in driver root {args.root}" if args.root != Path("/") else ""
        print(f"mpsview: cannot run {view.program[0]}{where}: {err.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())

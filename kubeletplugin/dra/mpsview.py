"""Run an MPS program in the view its clients have: the daemon's ``/dev/shm``, the driver's files.

``MpsDaemons`` starts each MPS control daemon, and runs each control command, through
this wrapper::

    python -m drasil.kubeletplugin.dra.mpsview --pipe P --log L [--shm S] [--root R] \\
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
  Inside, the pipe and log directories are bind-mounted at ``/tmp/nvidia-mps`` and
  ``/tmp/nvidia-log`` (on a tmpfs over ``R/tmp``, never written to the driver root) and
  the tmpfs ``S`` over ``R/dev/shm``.

Without ``--shm`` and with ``R`` = ``/`` (a control command on a host whose driver is
at ``/``) nothing is mounted and no privilege is needed. The program's directory is put
first on ``PATH``, so the control daemon finds the server next to it.

Standard library only (ctypes for the mount calls Python 3.11 lacks).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

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


def enter(args: argparse.Namespace) -> tuple[str, str]:
    """Set up the view; where the pipe and log directories are in it."""
    root = args.root.resolve()
    if root == Path("/"):
        if args.shm is not None:
            private_namespace()
            bind(args.shm, Path("/dev/shm"))
        return str(args.pipe), str(args.log)
    private_namespace()
    tmp = root / "tmp"
    mount("tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=1777")
    for name, source in (("nvidia-mps", args.pipe), ("nvidia-log", args.log)):
        (tmp / name).mkdir()
        bind(source, tmp / name)
    if args.shm is not None:
        bind(args.shm, root / "dev" / "shm")
    os.chroot(root)
    os.chdir("/")
    return PIPE_IN_ROOT, LOG_IN_ROOT


def main(argv: Sequence[str] | None = None) -> int:
    args, program = _arguments(argv)
    try:
        pipe, log = enter(args)
    except (OSError, ViewError) as err:
        print(f"mpsview: {err}", file=sys.stderr)
        return 1
    env = dict(os.environ)
    env["CUDA_MPS_PIPE_DIRECTORY"] = pipe
    env["CUDA_MPS_LOG_DIRECTORY"] = log
    directory = os.path.dirname(program[0])
    if directory:
        env["PATH"] = f"{directory}:{env.get('PATH', '/usr/bin:/bin')}"
    try:
        os.execvpe(program[0], program, env)
    except OSError as err:
        where = f" in driver root {args.root}" if args.root != Path("/") else ""
        print(f"mpsview: cannot run {program[0]}{where}: {err.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())

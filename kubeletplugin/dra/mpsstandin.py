"""A stand-in for ``nvidia-cuda-mps-control -d`` on simulated GPUs.

``MpsDaemons`` runs it with ``--backend simulated`` so a simulated node has one real
process per shared GPU with the lifecycle of an MPS control daemon, which the e2e tests
and the crash tests can see, count and kill::

    python -m drasil.kubeletplugin.dra.mpsstandin --pipe-dir P --log-dir L --gpu GPU-…

Like ``-d`` it daemonizes (forks into a new session and returns once the daemon is
ready, exit status 0; 1 if it could not start) and leaves in the pipe directory what
the real daemon leaves there and ``MpsDaemons`` reads: ``nvidia-cuda-mps-control.pid``
with its pid. The real daemon's control socket is a ``control`` FIFO here: a line
``quit`` makes it exit, as does SIGTERM, and either way it removes its FIFO and pid
file. It appends what it does to ``control.log`` in the log directory, the name of the
real daemon's log.

Standard library only, so it starts fast and carries nothing of the plugin along.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import NoReturn

PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_FIFO = "control"
LOG_FILE = "control.log"


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mpsstandin", description="a stand-in for nvidia-cuda-mps-control -d"
    )
    parser.add_argument("--pipe-dir", type=Path, required=True)
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--gpu", required=True)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Fork the daemon and wait until it is ready, as ``nvidia-cuda-mps-control -d``."""
    args = _arguments(argv)
    ready_read, ready_write = os.pipe()
    if os.fork() == 0:
        os.close(ready_read)
        _daemon(args, ready_write)
    os.close(ready_write)
    # One byte once the pid file is written; EOF if the daemon died before that.
    return 0 if os.read(ready_read, 1) else 1


def _daemon(args: argparse.Namespace, ready: int) -> NoReturn:
    os.setsid()  # no controlling terminal, and no signal of the launcher's group
    os.chdir("/")
    # Before anything exists, so a SIGTERM at any point still removes what does.
    signal.signal(signal.SIGTERM, _terminate)
    code = 0
    try:
        control = _open_control(args.pipe_dir)
        _write_pid_file(args.pipe_dir)
        _log(args.log_dir, f"stand-in control daemon for {args.gpu} started")
        os.write(ready, b"1")
        os.close(ready)
        _detach_stdio()
        _serve(control, args)
    except BaseException as err:  # whatever ends it, a daemon cleans up and reports
        code = 0 if isinstance(err, SystemExit) else 1
        if code:
            print(f"mpsstandin: {err}", file=sys.stderr)
    finally:
        _clean_up(args.pipe_dir)
        with contextlib.suppress(OSError):
            _log(args.log_dir, f"stand-in control daemon for {args.gpu} stopped")
    os._exit(code)  # never return into the launcher's stack after fork


def _open_control(pipe_dir: Path) -> int:
    pipe_dir.mkdir(parents=True, exist_ok=True)
    fifo = pipe_dir / CONTROL_FIFO
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo, 0o600)
    # Opened for writing too: a FIFO with a writer never reads as EOF, so each client
    # that writes a line and closes leaves the daemon blocked on the next read.
    return os.open(fifo, os.O_RDWR | os.O_CLOEXEC)


def _write_pid_file(pipe_dir: Path) -> None:
    # Renamed into place so a reader never sees an empty or partial pid.
    temp = pipe_dir / f".{PID_FILE}.{os.getpid()}"
    temp.write_text(f"{os.getpid()}\n")
    temp.replace(pipe_dir / PID_FILE)


def _detach_stdio() -> None:
    # The launcher's stderr may be a file it reads and deletes once we are ready.
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def _serve(control: int, args: argparse.Namespace) -> None:
    pending = b""
    while True:
        pending += os.read(control, 4096)
        *lines, pending = pending.split(b"\n")
        for line in lines:
            command = line.decode(errors="replace").strip()
            if command == "quit":
                _log(args.log_dir, "quit")
                return
            if command:
                _log(args.log_dir, f"unknown command {command!r}")


def _terminate(signum: int, frame: FrameType | None) -> NoReturn:
    raise SystemExit(0)


def _clean_up(pipe_dir: Path) -> None:
    (pipe_dir / CONTROL_FIFO).unlink(missing_ok=True)
    pid_file = pipe_dir / PID_FILE
    with contextlib.suppress(OSError, ValueError):
        if int(pid_file.read_text()) == os.getpid():  # not a successor's
            pid_file.unlink()


def _log(log_dir: Path, message: str) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with (log_dir / LOG_FILE).open("a") as log:
        log.write(f"[{stamp} Control {os.getpid()}] {message}\n")


if __name__ == "__main__":
    sys.exit(main())

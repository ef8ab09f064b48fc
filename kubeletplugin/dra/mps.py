"""MPS control daemons of shared GPUs (``--gpu-sharing consumable``): start, stop, sweep.

Claims that share one GPU are kept to their share by CUDA MPS: one control daemon per
shared GPU, started with the first share (``MpsDaemons.ensure``) and stopped after the
last (``stop``); each share's containers get the daemon's pipe and log directories and
their limits (``share_edits``). Both calls are idempotent, so a repeated call after a
crash finishes what the crashed one began.

Where things are, per GPU, under ``<state dir>/mps/<gpu uuid>/``:

- ``pipe/``: the daemon's ``CUDA_MPS_PIPE_DIRECTORY`` (mode 0755, containers mount
  it), where the daemon itself writes ``nvidia-cuda-mps-control.pid``;
- ``log/``: its ``CUDA_MPS_LOG_DIRECTORY`` (``control.log``, ``server.log``), kept
  after a stop for whoever debugs a share;
- ``daemon.json``: our record of the daemon, ``{"gpu", "pid", "startTime"}``.

A daemon is identified by its pid together with its start time (``/proc/<pid>/stat``
field 22), because a pid alone may name an unrelated process by now. One whose record
was lost (a crash right after the start) is adopted when the pid file in its pipe
directory names a live process started with that pipe directory in its environment.

Backends: ``nvml`` runs ``<control> -d`` (the real ``nvidia-cuda-mps-control``, which
daemonizes itself) with ``CUDA_VISIBLE_DEVICES=<gpu uuid>`` and the two directories in
its environment, and stops it with ``quit`` on the control program's stdin.
``simulated`` runs ``drasil.kubeletplugin.dra.mpsstandin``, a process with the same
lifecycle and files, stopped with ``quit`` on its control FIFO. Either way the daemon
is in a session of its own and outlives a plugin process that crashes; a stop that the
daemon does not obey within ``stop_timeout`` ends in SIGKILL.

Every change runs under one lock (threads, and a ``FileLock`` on ``mps.lock`` in the
state dir for a second plugin instance during a rolling update).

Crash points (see ``drasil.driver.files``): ``mps-after-start`` (daemon running, its
record not written), ``mps-after-stop`` (daemon gone, pipe directory not yet emptied).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from drasil.driver.cdi.spec import ContainerEdits, Mount
from drasil.driver.files import CRASH_ENV, FileLock, crash_point, write_atomic

log = logging.getLogger(__name__)

MPS_LOCK_TIMEOUT: Final = 30.0  # below kubelet's 45 s call timeout, like the checkpoint lock
START_TIMEOUT: Final = 10.0
STOP_TIMEOUT: Final = 10.0
BACKENDS: Final = ("nvml", "simulated")

# The control daemon writes its pid here, in CUDA_MPS_PIPE_DIRECTORY (NVIDIA's MPS
# documentation, "Appendix: Tools and Interface Reference").
PID_FILE: Final = "nvidia-cuda-mps-control.pid"
STANDIN_FIFO: Final = "control"
STANDIN_MODULE: Final = "drasil.kubeletplugin.dra.mpsstandin"
RECORD_FILE: Final = "daemon.json"
# MPS's own defaults for the two directories, so a container's CUDA finds the daemon
# even where a workload's image sets neither variable.
CONTAINER_PIPE_DIR: Final = "/tmp/nvidia-mps"
CONTAINER_LOG_DIR: Final = "/tmp/nvidia-log"
_MIB: Final = 2**20
# GPU UUIDs become directory names: letters, digits and dashes only (GPU-…, MIG-…).
_UUID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")
_POLL: Final = 0.02


class MpsError(Exception):
    """A daemon that cannot be started or stopped; the message goes to the claim."""


@dataclass(frozen=True)
class MpsDaemon:
    """A running control daemon: its GPU, its process and its directories."""

    gpu_uuid: str
    pid: int
    start_time: int  # clock ticks after boot, /proc/<pid>/stat field 22
    pipe_dir: Path
    log_dir: Path


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started (``/proc/<pid>/stat`` field 22), or None if there
    is no such process or it has exited (a zombie is not running)."""
    if pid <= 0:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2, the command name in parentheses, may itself hold spaces and ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):  # field 3, the state
        return None
    return int(fields[19])


def share_edits(
    daemon: MpsDaemon, *, memory_limit_bytes: int, thread_percentage: int, gpu_uuid: str
) -> ContainerEdits:
    """What a container of one share gets: the daemon's directories and the share's
    limits, which MPS enforces on every CUDA context the container makes.

    ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` takes ``<device>=<limit>`` pairs with an ``M``
    or ``G`` suffix; the device is named by UUID, which stays right whatever order
    the container enumerates its GPUs in. The limit is rounded down to whole MiB so a
    share never gets more than it was given.
    """
    if not 1 <= thread_percentage <= 100:
        raise ValueError(f"thread percentage {thread_percentage}: must be 1 to 100")
    if memory_limit_bytes < _MIB:
        raise ValueError(f"memory limit {memory_limit_bytes} bytes: at least 1 MiB")
    env = {
        "CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIR,
        "CUDA_MPS_LOG_DIRECTORY": CONTAINER_LOG_DIR,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{gpu_uuid}={memory_limit_bytes // _MIB}M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(thread_percentage),
    }
    mounts = (
        Mount(str(daemon.pipe_dir), CONTAINER_PIPE_DIR, options=("rbind", "rw")),
        Mount(str(daemon.log_dir), CONTAINER_LOG_DIR, options=("rbind", "rw")),
    )
    return ContainerEdits(env=env, mounts=mounts)


class MpsDaemons:
    """The node's MPS control daemons, one per shared GPU, changed under one lock."""

    def __init__(
        self,
        state_dir: Path,
        *,
        backend: str,
        control: str = "nvidia-cuda-mps-control",
        start_timeout: float = START_TIMEOUT,
        stop_timeout: float = STOP_TIMEOUT,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: must be one of {', '.join(BACKENDS)}")
        self.root = state_dir.absolute() / "mps"
        self.backend = backend
        self.control = control
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._thread_lock = threading.Lock()
        self._file_lock = state_dir / "mps.lock"

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)  # and the state dir, for the lock
        with self._thread_lock, FileLock(self._file_lock, timeout=MPS_LOCK_TIMEOUT):
            yield

    # ---- public ---------------------------------------------------------------------

    def ensure(self, gpu_uuid: str) -> MpsDaemon:
        """The GPU's running daemon, started if there is none (idempotent)."""
        self._check_uuid(gpu_uuid)
        with self._locked():
            running = self._find(gpu_uuid)
            return running if running is not None else self._start(gpu_uuid)

    def stop(self, gpu_uuid: str) -> bool:
        """Stop the GPU's daemon and empty its pipe directory (idempotent); whether a
        daemon was running."""
        self._check_uuid(gpu_uuid)
        with self._locked():
            return self._stop(gpu_uuid)

    def alive(self, record: MpsDaemon) -> bool:
        """Whether the recorded process still runs (same pid, same start time)."""
        return process_start_time(record.pid) == record.start_time

    def sweep(self, keep: Iterable[str]) -> list[str]:
        """Stop the daemons of GPUs not in ``keep`` (orphans of a crash, at start);
        the GPUs whose daemon was stopped."""
        kept = set(keep)
        stopped = []
        with self._locked():
            for gpu_uuid in self._known_gpus():
                if gpu_uuid not in kept and self._stop(gpu_uuid):
                    stopped.append(gpu_uuid)
        return stopped

    # ---- finding a daemon -------------------------------------------------------------

    def _find(self, gpu_uuid: str) -> MpsDaemon | None:
        record = self._read_record(gpu_uuid)
        if record is not None and self.alive(record):
            return record
        adopted = self._adopt(gpu_uuid)
        if adopted is not None:
            log.info("adopted an MPS daemon", extra={"gpu": gpu_uuid, "pid": adopted.pid})
            self._write_record(adopted)
        return adopted

    def _adopt(self, gpu_uuid: str) -> MpsDaemon | None:
        """The daemon the pid file names, if it runs with this GPU's pipe directory."""
        pipe_dir = self._pipe_dir(gpu_uuid)
        pid = _read_pid(pipe_dir / PID_FILE)
        if pid is None or not _serves(pid, pipe_dir):
            return None
        start_time = process_start_time(pid)
        if start_time is None:
            return None
        return MpsDaemon(gpu_uuid, pid, start_time, pipe_dir, self._log_dir(gpu_uuid))

    def _known_gpus(self) -> list[str]:
        try:
            names = sorted(entry.name for entry in self.root.iterdir() if entry.is_dir())
        except FileNotFoundError:
            return []
        return [name for name in names if _UUID.fullmatch(name)]

    # ---- start ------------------------------------------------------------------------

    def _start(self, gpu_uuid: str) -> MpsDaemon:
        pipe_dir, log_dir = self._pipe_dir(gpu_uuid), self._log_dir(gpu_uuid)
        _make_dir(pipe_dir)
        _make_dir(log_dir)
        _empty(pipe_dir)  # a dead daemon's pid file must not pass for the new one's
        self._launch(gpu_uuid)
        pid = self._wait_for_pid(gpu_uuid)
        start_time = process_start_time(pid)
        if start_time is None:
            raise MpsError(f"MPS daemon of GPU {gpu_uuid} exited at once; see {log_dir}")
        daemon = MpsDaemon(gpu_uuid, pid, start_time, pipe_dir, log_dir)
        crash_point("mps-after-start")
        self._write_record(daemon)
        log.info("MPS daemon started", extra={"gpu": gpu_uuid, "pid": pid})
        return daemon

    def _command(self, gpu_uuid: str) -> list[str]:
        if self.backend == "nvml":
            return [self.control, "-d"]
        return [
            sys.executable,
            "-m",
            STANDIN_MODULE,
            "--pipe-dir",
            str(self._pipe_dir(gpu_uuid)),
            "--log-dir",
            str(self._log_dir(gpu_uuid)),
            "--gpu",
            gpu_uuid,
        ]

    def _launch(self, gpu_uuid: str) -> None:
        """Run the daemonizing command; it returns once the daemon runs on its own."""
        command = self._command(gpu_uuid)
        # stderr goes to a file, not a pipe: a daemon that kept an inherited pipe open
        # would keep subprocess waiting for its end until the timeout.
        with tempfile.TemporaryFile() as stderr:
            try:
                done = subprocess.run(
                    command,
                    env=self._environment(gpu_uuid),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    timeout=self.start_timeout,
                    start_new_session=True,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as err:
                raise MpsError(f"MPS daemon of GPU {gpu_uuid}: {command[0]}: {err}") from err
            if done.returncode != 0:
                stderr.seek(0)
                said = stderr.read(500).decode(errors="replace").strip()
                raise MpsError(
                    f"MPS daemon of GPU {gpu_uuid}: {' '.join(command[:3])} exited with "
                    f"status {done.returncode}: {said or 'no message'}"
                )

    def _wait_for_pid(self, gpu_uuid: str) -> int:
        # -d returns when the daemon has forked; it may write its pid file just after.
        pid_file = self._pipe_dir(gpu_uuid) / PID_FILE
        deadline = time.monotonic() + self.start_timeout
        while (pid := _read_pid(pid_file)) is None:
            if time.monotonic() > deadline:
                raise MpsError(
                    f"MPS daemon of GPU {gpu_uuid} wrote no {PID_FILE} within "
                    f"{self.start_timeout:g}s; see {self._log_dir(gpu_uuid)}"
                )
            time.sleep(_POLL)
        return pid

    def _environment(self, gpu_uuid: str) -> dict[str, str]:
        env = {name: value for name, value in os.environ.items() if name != CRASH_ENV}
        env["CUDA_VISIBLE_DEVICES"] = gpu_uuid
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self._pipe_dir(gpu_uuid))
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self._log_dir(gpu_uuid))
        return env

    # ---- stop -------------------------------------------------------------------------

    def _stop(self, gpu_uuid: str) -> bool:
        daemon = self._find(gpu_uuid)
        if daemon is not None:
            self._quit(daemon)
            if not self._wait_gone(daemon):
                log.warning(
                    "MPS daemon did not quit; killing it",
                    extra={"gpu": gpu_uuid, "pid": daemon.pid},
                )
                self._kill(daemon)
            log.info("MPS daemon stopped", extra={"gpu": gpu_uuid, "pid": daemon.pid})
        crash_point("mps-after-stop")
        _empty(self._pipe_dir(gpu_uuid))
        (self.root / gpu_uuid / RECORD_FILE).unlink(missing_ok=True)
        return daemon is not None

    def _quit(self, daemon: MpsDaemon) -> None:
        """Ask the daemon to exit; failures only log, the caller's kill follows."""
        if self.backend == "simulated":
            if not _write_fifo(daemon.pipe_dir / STANDIN_FIFO, b"quit\n"):
                self._signal(daemon, signal.SIGTERM)  # its FIFO is gone: the other way
            return
        try:
            done = subprocess.run(
                [self.control],
                input=b"quit\n",
                env=self._environment(daemon.gpu_uuid),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=self.stop_timeout,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            log.warning("MPS quit failed", extra={"gpu": daemon.gpu_uuid, "error": str(err)})
            return
        if done.returncode != 0:
            said = done.stderr.decode(errors="replace").strip()[:500]
            log.warning("MPS quit refused", extra={"gpu": daemon.gpu_uuid, "error": said})

    def _wait_gone(self, daemon: MpsDaemon) -> bool:
        deadline = time.monotonic() + self.stop_timeout
        while self.alive(daemon):
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL)
        return True

    def _kill(self, daemon: MpsDaemon) -> None:
        # Checked just before the signal, so a pid reused since is never hit; the
        # window between the two is microseconds against pid reuse taking a full wrap.
        self._signal(daemon, signal.SIGKILL)
        self._wait_gone(daemon)

    def _signal(self, daemon: MpsDaemon, signum: int) -> None:
        if self.alive(daemon):
            with suppress(ProcessLookupError):
                os.kill(daemon.pid, signum)

    # ---- files ------------------------------------------------------------------------

    def _pipe_dir(self, gpu_uuid: str) -> Path:
        return self.root / gpu_uuid / "pipe"

    def _log_dir(self, gpu_uuid: str) -> Path:
        return self.root / gpu_uuid / "log"

    def _read_record(self, gpu_uuid: str) -> MpsDaemon | None:
        path = self.root / gpu_uuid / RECORD_FILE
        try:
            doc = json.loads(path.read_bytes())
            return self._record(gpu_uuid, doc)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as err:
            # Only ever written atomically by us; a bad one is ignored, and the pid
            # file still leads to a running daemon.
            log.warning(
                "unreadable MPS daemon record", extra={"path": str(path), "error": str(err)}
            )
            return None

    def _record(self, gpu_uuid: str, doc: Mapping[str, object]) -> MpsDaemon:
        pid, start_time = doc["pid"], doc["startTime"]
        if doc["gpu"] != gpu_uuid or not isinstance(pid, int) or not isinstance(start_time, int):
            raise ValueError("not a record of this GPU")
        return MpsDaemon(
            gpu_uuid, pid, start_time, self._pipe_dir(gpu_uuid), self._log_dir(gpu_uuid)
        )

    def _write_record(self, daemon: MpsDaemon) -> None:
        doc = {"gpu": daemon.gpu_uuid, "pid": daemon.pid, "startTime": daemon.start_time}
        data = json.dumps(doc, sort_keys=True).encode() + b"\n"
        # Not durable: a reboot ends the daemon, and the record with it.
        path = self.root / daemon.gpu_uuid / RECORD_FILE
        write_atomic(path, data, crash_tag="mps-record", durable=False)

    @staticmethod
    def _check_uuid(gpu_uuid: str) -> None:
        if not _UUID.fullmatch(gpu_uuid):
            raise MpsError(f"GPU UUID {gpu_uuid!r}: not a UUID MPS can be run for")


def _make_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    # Exactly 0755 whatever the umask: containers of any user reach the daemon here.
    path.chmod(0o755)


def _empty(directory: Path) -> None:
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def _serves(pid: int, pipe_dir: Path) -> bool:
    """Whether process ``pid`` was started for ``pipe_dir`` (its environment says so)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode() in environ.split(b"\0")


def _write_fifo(path: Path, data: bytes) -> bool:
    """Write to a FIFO without blocking (a daemon that is gone has no reader on it);
    whether the data went in."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # ENXIO: no reader; ENOENT: no FIFO
        return False
    try:
        return os.write(fd, data) == len(data)
    except OSError:
        return False
    finally:
        os.close(fd)

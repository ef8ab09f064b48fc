"""MPS control daemons of shared GPUs (``--gpu-sharing consumable``): start, limit, stop, sweep.

Claims that share one GPU are kept to their share by CUDA MPS: one control daemon per
shared GPU (or shared MIG instance: "GPU UUID" below is then its ``MIG-`` UUID, which
``CUDA_VISIBLE_DEVICES`` takes alike), started with the first share
(``MpsDaemons.ensure``) and stopped after the last (``stop``). Both calls are
idempotent, so a repeated call after a crash finishes what the crashed one began. Each
share's containers get the daemon's pipe directory (read-only), its ``/dev/shm`` and
their limits (``share_edits``).

Where things are, per GPU, under ``<state dir>/mps/<key>/`` (``key``: 12 hex digits of
the SHA-256 of the GPU's UUID, short because a Unix socket's path, here the daemon's
``pipe/control``, has at most 107 bytes):

- ``gpu``: the GPU's UUID;
- ``pipe/``: the daemon's ``CUDA_MPS_PIPE_DIRECTORY`` (mode 0755, containers mount
  it), where the daemon itself writes ``nvidia-cuda-mps-control.pid``;
- ``log/``: its ``CUDA_MPS_LOG_DIRECTORY`` (``control.log``, ``server.log``), kept
  after a stop for whoever debugs a share; never given to clients;
- ``shm/``: a tmpfs of its own (``rw,nosuid,nodev,noexec``, mode 1777, at most half
  the node's memory), the daemon's ``/dev/shm`` and each client's: the MPS server's
  shared-memory segments are there, and a client that does not see them cannot
  connect;
- ``daemon.json``: our record of the daemon, ``{"gpu", "pid", "startTime", "limits"}``
  and, for a daemon in a Pod, ``"pod"`` and ``"podUID"``.

Where the daemon runs is the launcher's (``DaemonLauncher``): ``ProcessLauncher``
starts a process of its own session, outside the plugin's process tree, which outlives
a plugin process that is killed, restarted or upgraded; under the chart
``drasil.kubeletplugin.vendors.nvidia.mps.pods.PodLauncher`` starts a Pod of its own on the node,
which outlives the plugin's Pod. Either way it runs in a mount namespace of its own set
up by ``drasil.kubeletplugin.vendors.nvidia.mps.view`` (the tmpfs over ``/dev/shm``; on a driver
root other than ``/``, chrooted into it so the driver's own binaries run against the
driver's own libc and find ``nvidia-cuda-mps-server`` on ``PATH``).

Limits are held by the daemon, not only by the client's environment, which a client
can unset: after each start and each new share the daemon's defaults are set
(``set_default_device_pinned_mem_limit 0 <MiB>M``, the device by ordinal, since the
UUID form is not applied; ``set_default_active_thread_percentage``), and the same on
each server already running. One daemon serves all the GPU's shares, so its limit is
the largest share's (``DaemonLimits.covering``): a client that drops its variables
gets at most that, and exactly its own when the GPU's shares are of one size.

A host process is identified by its pid together with its start time
(``/proc/<pid>/stat`` field 22), because a pid alone may name an unrelated process by
now; a Pod by its name and UID. One whose record was lost (a crash right after the
start) is adopted: a process when the pid file in its pipe directory names a live
process started for this GPU (``DRASIL_MPS_GPU`` in its environment), a Pod by its
name.

Backends: ``nvml`` runs the driver's ``nvidia-cuda-mps-control``; ``simulated`` runs
``drasil.driver.simulated.mpsstandin``, which takes the same arguments, environment and
commands. Either way a stop is ``quit`` through the control program, and a daemon that
does not obey within the stop timeout is killed (its Pod deleted).

Every change of one GPU's daemon runs under that GPU's lock (``hold``): calls for
different GPUs never wait for each other. The lock is a reentrant thread lock and an
exclusive ``FileLock`` on ``mps/<key>.lock`` (a second plugin instance during a rolling
update), taken inside a shared ``FileLock`` on the node-wide ``mps.lock``: releases
before per-GPU locking took ``mps.lock`` exclusive around each change, so during the
chart's surge an old and a new plugin still never change daemons at once
(docs/upgrading.md). Each wait is bounded (``MPS_LOCK_TIMEOUT``) and ends in a
retriable claim error.

Crash points (see ``drasil.driver.files``): ``mps-after-start`` (daemon running, its
record not written), ``mps-after-stop`` (daemon gone, pipe directory not yet emptied,
tmpfs still mounted).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final, Protocol

from drasil.driver.cdi.spec import ContainerEdits, Mount
from drasil.driver.files import (
    CRASH_ENV,
    FileLock,
    LockTimeoutError,
    crash_point,
    read_regular,
    write_atomic,
)
from drasil.kubeletplugin.vendors.nvidia.mps.view import (
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    ViewError,
    mount,
    unmount_detached,
)

log = logging.getLogger(__name__)

# kubelet ends a NodePrepareResources or NodeUnprepareResources call after 45 s. A
# call may spend DAEMON_CALL_BUDGET of it on one GPU's daemon, the wait for the GPU's
# lock included, and keeps the rest for the checkpoint, the spec and the daemon's
# limits: so a slow daemon ends the call with the claim's error, which kubelet retries,
# never with kubelet's own deadline.
KUBELET_CALL_TIMEOUT: Final = 45.0
DAEMON_CALL_BUDGET: Final = KUBELET_CALL_TIMEOUT - 15.0
MPS_LOCK_TIMEOUT: Final = DAEMON_CALL_BUDGET
START_TIMEOUT: Final = 10.0
STOP_TIMEOUT: Final = 10.0
CONTROL_TIMEOUT: Final = 10.0
BACKENDS: Final = ("nvml", "simulated")
CONTROL_PROGRAM: Final = "nvidia-cuda-mps-control"

# The control daemon writes its pid here, in CUDA_MPS_PIPE_DIRECTORY (NVIDIA's MPS
# documentation, "Appendix: Tools and Interface Reference").
PID_FILE: Final = "nvidia-cuda-mps-control.pid"
STANDIN_MODULE: Final = "drasil.driver.simulated.mpsstandin"
VIEW_MODULE: Final = "drasil.kubeletplugin.vendors.nvidia.mps.view"
RECORD_FILE: Final = "daemon.json"
GPU_FILE: Final = "gpu"
GPU_ENV: Final = "DRASIL_MPS_GPU"
# MPS's default pipe directory, so a container's CUDA finds the daemon even where a
# workload's image does not set the variable.
CONTAINER_PIPE_DIR: Final = "/tmp/nvidia-mps"
CONTAINER_SHM_DIR: Final = "/dev/shm"
# Volta+ MPS serves at most 48 client CUDA contexts per device (NVIDIA's MPS docs).
CLIENT_LIMIT: Final = 48
_MIB: Final = 2**20
# GPU UUIDs become directory names: letters, digits and dashes only (GPU-…, MIG-…).
_UUID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")
_POLL: Final = 0.02


class MpsError(Exception):
    """A daemon that cannot be started, limited or stopped; the message goes to the claim."""


@dataclass(frozen=True)
class DaemonLimits:
    """What the daemon lets any client of it use: pinned memory and active threads."""

    memory_mib: int
    thread_percentage: int

    def covering(self, other: DaemonLimits | None) -> DaemonLimits:
        """Limits no smaller than either: what one daemon of two shares must allow."""
        if other is None:
            return self
        return DaemonLimits(
            max(self.memory_mib, other.memory_mib),
            max(self.thread_percentage, other.thread_percentage),
        )

    def commands(self, servers: Sequence[int]) -> list[str]:
        """The control commands that set these limits as defaults and on ``servers``."""
        memory = f"{self.memory_mib}M"
        threads = str(self.thread_percentage)
        commands = [
            f"set_default_device_pinned_mem_limit 0 {memory}",
            f"set_default_active_thread_percentage {threads}",
        ]
        for pid in servers:
            commands.append(f"set_device_pinned_mem_limit {pid} 0 {memory}")
            commands.append(f"set_active_thread_percentage {pid} {threads}")
        return commands


def share_limits_of(memory_bytes: int, thread_percentage: int) -> DaemonLimits:
    """A share's limits in the daemon's units; the memory rounded down to whole MiB so a
    share never gets more than it was given."""
    if not 1 <= thread_percentage <= 100:
        raise ValueError(f"thread percentage {thread_percentage}: must be 1 to 100")
    if memory_bytes < _MIB:
        raise ValueError(f"memory limit {memory_bytes} bytes: at least 1 MiB")
    return DaemonLimits(memory_bytes // _MIB, thread_percentage)


@dataclass(frozen=True)
class MpsDaemon:
    """A running control daemon: its GPU, its process, its directories and limits."""

    gpu_uuid: str
    pid: int
    start_time: int  # clock ticks after boot, /proc/<pid>/stat field 22
    pipe_dir: Path
    log_dir: Path
    shm_dir: Path
    limits: DaemonLimits | None = None
    # The Pod it runs in (the Pod launcher, drasil.kubeletplugin.vendors.nvidia.mps.pods); None for
    # a process of the plugin's host. Its start_time is then 0: the plugin does not
    # see the node's PID namespace, and the Pod's UID is what tells it apart.
    pod: str | None = None
    pod_uid: str | None = None

    @property
    def launched(self) -> Launched:
        return Launched(self.pid, self.start_time, self.pod, self.pod_uid)


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


def share_edits(daemon: MpsDaemon, limits: DaemonLimits) -> ContainerEdits:
    """What a container of one share gets: the daemon's pipe directory (read-only: a
    client only connects to the daemon's sockets, and must not remove them) and
    ``/dev/shm``, and the share's own limits, which narrow the daemon's.

    ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` names the device by ordinal: the daemon serves
    exactly one GPU, so its clients see it as ``0``; NVIDIA's device plugin found the
    UUID form not applied.
    """
    env = {
        "CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIR,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={limits.memory_mib}M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(limits.thread_percentage),
    }
    mounts = (
        Mount(str(daemon.pipe_dir), CONTAINER_PIPE_DIR, options=("rbind", "ro")),
        Mount(
            str(daemon.shm_dir),
            CONTAINER_SHM_DIR,
            options=("rbind", "rw", "nosuid", "nodev", "noexec"),
        ),
    )
    return ContainerEdits(env=env, mounts=mounts)


@dataclass(frozen=True)
class DaemonProgram:
    """How to run the control program: the command (without ``-d``), the driver root
    it runs chrooted into (``/``: none), and whether it serves clients of every user."""

    command: tuple[str, ...]
    driver_root: Path = Path("/")
    multiuser: bool = False

    @classmethod
    def for_backend(
        cls,
        backend: str,
        *,
        control: str | None = None,
        driver_root: Path = Path("/"),
        multiuser: bool = False,
    ) -> DaemonProgram:
        """The simulated backend's stand-in, or the driver's control program (a path
        inside ``driver_root``)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: must be one of {', '.join(BACKENDS)}")
        if backend == "simulated":
            return cls((sys.executable, "-m", STANDIN_MODULE), Path("/"), multiuser)
        return cls((control or CONTROL_PROGRAM,), driver_root, multiuser)


@dataclass(frozen=True)
class Launched:
    """How a launcher knows a daemon again: its pid as the node sees it, and what makes
    that pid this daemon's (the process's start time, or the Pod's name and UID)."""

    pid: int
    start_time: int = 0
    pod: str | None = None
    pod_uid: str | None = None


@dataclass(frozen=True)
class DaemonSpot:
    """One GPU's daemon as a launcher needs it: the GPU, the control program's name
    (for messages), its directories, and whether it answers a control command now."""

    gpu_uuid: str
    program: str
    pipe_dir: Path
    log_dir: Path
    answers: Callable[[], bool]
    # When the call's time for this daemon ends (time.monotonic()); a start waits until
    # then at most, whatever the launcher's own bound.
    deadline: float = math.inf

    def bound(self, timeout: float) -> float:
        """Seconds a wait of at most ``timeout`` may take from now on."""
        return max(0.0, min(timeout, self.deadline - time.monotonic()))


class DaemonLauncher(Protocol):
    """Where the daemons run: processes on the plugin's host (``ProcessLauncher``), or
    Pods of their own (``drasil.kubeletplugin.vendors.nvidia.mps.pods.PodLauncher``). ``MpsDaemons``
    keeps the directories, the tmpfs, the record and the limits either way.
    """

    # Whether the control program runs with -f (its container lives as long as it)
    # rather than -d (it forks and the launching command returns).
    foreground: bool

    def launch(self, spot: DaemonSpot, command: Sequence[str], env: Mapping[str, str]) -> Launched:
        """Start the daemon; return once it runs on its own (``MpsError`` if it does not)."""
        ...

    def adopt(self, spot: DaemonSpot, *, ready: bool = True) -> Launched | None:
        """The GPU's daemon running without a record of ours (a crash before the
        record, a record lost), or None; with ``ready`` False one still starting is
        taken as it is (to be stopped)."""
        ...

    def alive(self, launched: Launched) -> bool:
        """Whether that daemon still runs."""
        ...

    def alive_all(self, launched: Sequence[Launched]) -> list[bool]:
        """``alive`` of each, as cheaply as the launcher can (the watch's look)."""
        ...

    def end(self, spot: DaemonSpot, launched: Launched) -> None:
        """After ``quit``: wait until the daemon is gone, forcing it after the stop timeout."""
        ...

    def others(self) -> list[str]:
        """GPUs with a daemon of this launcher's whatever the state dir says (the sweep's)."""
        ...


class ProcessLauncher:
    """Each daemon a process of its own session on the plugin's host, started with -d;
    known by its pid and start time, adopted by its pid file and environment."""

    foreground = False

    def __init__(
        self, *, start_timeout: float = START_TIMEOUT, stop_timeout: float = STOP_TIMEOUT
    ) -> None:
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout

    def launch(self, spot: DaemonSpot, command: Sequence[str], env: Mapping[str, str]) -> Launched:
        """Run the daemonizing command; it returns once the daemon runs on its own."""
        environment = {name: value for name, value in os.environ.items() if name != CRASH_ENV}
        self._run(spot, command, environment | dict(env))
        pid = self._wait_for_pid(spot)
        start_time = process_start_time(pid)
        if start_time is None:
            raise MpsError(f"MPS daemon of GPU {spot.gpu_uuid} exited at once; see {spot.log_dir}")
        return Launched(pid, start_time)

    def _run(self, spot: DaemonSpot, command: Sequence[str], env: Mapping[str, str]) -> None:
        # stderr goes to a file, not a pipe: a daemon that kept an inherited pipe open
        # would keep subprocess waiting for its end until the timeout.
        with tempfile.TemporaryFile() as stderr:
            try:
                done = subprocess.run(
                    list(command),
                    env=dict(env),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    timeout=spot.bound(self.start_timeout),
                    start_new_session=True,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as err:
                raise MpsError(f"MPS daemon of GPU {spot.gpu_uuid}: {spot.program}: {err}") from err
            if done.returncode != 0:
                stderr.seek(0)
                said = stderr.read(500).decode(errors="replace").strip()
                raise MpsError(
                    f"MPS daemon of GPU {spot.gpu_uuid}: {spot.program} -d exited with "
                    f"status {done.returncode}: {said or 'no message'}"
                )

    def _wait_for_pid(self, spot: DaemonSpot) -> int:
        # -d returns when the daemon has forked; it may write its pid file just after.
        pid_file = spot.pipe_dir / PID_FILE
        bound = spot.bound(self.start_timeout)
        deadline = time.monotonic() + bound
        while (pid := read_pid(pid_file)) is None:
            if time.monotonic() > deadline:
                raise MpsError(
                    f"MPS daemon of GPU {spot.gpu_uuid} wrote no {PID_FILE} within "
                    f"{bound:.3g}s; see {spot.log_dir}"
                )
            time.sleep(_POLL)
        return pid

    def adopt(self, spot: DaemonSpot, *, ready: bool = True) -> Launched | None:
        """The daemon the pid file names, if it runs for this GPU (-d returned: ready).
        With ``ready``, one still starting (a plugin killed while it started it, then
        restarted at once) is waited for until its pid file is written, not started a
        second time; a stop does not look for one (the processes are listed): one
        that comes up after it has no claim, and the next sweep finds it by its pid file."""
        pid = read_pid(spot.pipe_dir / PID_FILE)
        if pid is None or not _serves(pid, spot.gpu_uuid):
            pid = self._wait_for_starting(spot) if ready else None
            if pid is None:
                return None
        start_time = process_start_time(pid)
        return None if start_time is None else Launched(pid, start_time)

    def _wait_for_starting(self, spot: DaemonSpot) -> int | None:
        """The pid of this GPU's daemon once one that is starting wrote its pid file;
        None when none is starting (or it ended without one)."""
        bound = spot.bound(self.start_timeout)
        deadline = time.monotonic() + bound
        while starting_daemons(spot.gpu_uuid):
            pid = read_pid(spot.pipe_dir / PID_FILE)
            if pid is not None and _serves(pid, spot.gpu_uuid):
                return pid
            if time.monotonic() > deadline:
                raise MpsError(
                    f"an MPS daemon of GPU {spot.gpu_uuid} is still starting after "
                    f"{bound:.3g}s (a plugin stopped while it started it); kubelet retries "
                    f"this claim; see {spot.log_dir}"
                )
            time.sleep(_POLL)
        return None

    def alive(self, launched: Launched) -> bool:
        """Same pid, same start time: a pid alone may name an unrelated process by now."""
        return launched.pod is None and process_start_time(launched.pid) == launched.start_time

    def alive_all(self, launched: Sequence[Launched]) -> list[bool]:
        return [self.alive(one) for one in launched]

    def end(self, spot: DaemonSpot, launched: Launched) -> None:
        if not self._wait_gone(launched):
            log.warning(
                "MPS daemon did not quit; killing it",
                extra={"gpu": spot.gpu_uuid, "pid": launched.pid},
            )
            self._kill(launched)

    def others(self) -> list[str]:
        return []  # a process daemon always has its folder in the state dir

    def _wait_gone(self, launched: Launched) -> bool:
        deadline = time.monotonic() + self.stop_timeout
        while self.alive(launched):
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL)
        return True

    def _kill(self, launched: Launched) -> None:
        # Checked just before the signal, so a pid reused since is never hit; the
        # window between the two is microseconds against pid reuse taking a full wrap.
        if self.alive(launched):
            with suppress(ProcessLookupError):
                os.kill(launched.pid, signal.SIGKILL)
        self._wait_gone(launched)


class GpuLocks:
    """One lock per GPU (or MIG instance), reentrant in a thread: across threads a lock, across
    plugin instances an exclusive ``flock`` on ``<root>/<key>.lock`` inside a shared one
    on the node-wide lock file. Entries are dropped when unused: MIG UUIDs come and go."""

    def __init__(self, node_lock: Path, root: Path) -> None:
        self.node_lock = node_lock
        self.root = root
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}
        self._depth = threading.local()

    def waited_since(self, gpu_uuid: str) -> float | None:
        """When this thread began to wait for the GPU's lock it holds (monotonic), or
        None: the call's time for the daemon counts from then."""
        since: dict[str, float] = self._depth.__dict__.setdefault("since", {})
        return since.get(folder_key(gpu_uuid))

    @contextmanager
    def hold(self, gpu_uuid: str, *, wait: bool = True) -> Iterator[bool]:
        key = folder_key(gpu_uuid)
        held: dict[str, int] = self._depth.__dict__.setdefault("held", {})
        since: dict[str, float] = self._depth.__dict__.setdefault("since", {})
        if held.get(key):  # this thread holds it already
            held[key] += 1
            try:
                yield True
            finally:
                held[key] -= 1
            return
        lock = self._use(key)
        began = time.monotonic()
        try:
            deadline = began + (MPS_LOCK_TIMEOUT if wait else 0.0)
            got = lock.acquire(timeout=MPS_LOCK_TIMEOUT) if wait else lock.acquire(blocking=False)
            if not got:
                yield self._busy(gpu_uuid, wait, "another call of this plugin")
                return
            try:
                with self._files(gpu_uuid, key, deadline, wait) as taken:
                    held[key], since[key] = int(taken), began
                    try:
                        yield taken
                    finally:
                        held[key] = 0
                        since.pop(key, None)
            finally:
                lock.release()
        finally:
            self._drop(key)

    @contextmanager
    def _files(self, gpu_uuid: str, key: str, deadline: float, wait: bool) -> Iterator[bool]:
        self.root.mkdir(parents=True, exist_ok=True)  # and the state dir, for the node lock
        node = FileLock(self.node_lock, timeout=max(0.0, deadline - time.monotonic()), shared=True)
        try:
            node.acquire()
        except LockTimeoutError:
            yield self._busy(gpu_uuid, wait, f"an older plugin instance ({self.node_lock})")
            return
        try:
            gpu = FileLock(self.root / f"{key}.lock", timeout=max(0.0, deadline - time.monotonic()))
            try:
                gpu.acquire()
            except LockTimeoutError:
                yield self._busy(gpu_uuid, wait, "another plugin instance")
                return
            try:
                yield True
            finally:
                gpu.release()
        finally:
            node.release()

    @staticmethod
    def _busy(gpu_uuid: str, wait: bool, holder: str) -> bool:
        if not wait:
            return False
        raise MpsError(
            f"the MPS daemon of GPU {gpu_uuid} is being changed by {holder} for longer than "
            f"{MPS_LOCK_TIMEOUT:g}s; kubelet retries this claim"
        )

    def _use(self, key: str) -> threading.Lock:
        with self._guard:
            lock, users = self._locks.get(key) or (threading.Lock(), 0)
            self._locks[key] = (lock, users + 1)
            return lock

    def _drop(self, key: str) -> None:
        with self._guard:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


class MpsDaemons:
    """The node's MPS control daemons, one per shared GPU, each changed under its GPU's
    lock."""

    def __init__(
        self,
        state_dir: Path,
        *,
        program: DaemonProgram,
        launcher: DaemonLauncher | None = None,
        start_timeout: float = START_TIMEOUT,
        stop_timeout: float = STOP_TIMEOUT,
        shm_size: int | None = None,
    ) -> None:
        self.root = state_dir.absolute() / "mps"
        self.program = program
        self.launcher: DaemonLauncher = launcher or ProcessLauncher(
            start_timeout=start_timeout, stop_timeout=stop_timeout
        )
        self.shm_size = shm_size or _half_of_memory()
        self._locks = GpuLocks(state_dir / "mps.lock", self.root)

    def hold(self, gpu_uuid: str, *, wait: bool = True) -> AbstractContextManager[bool]:
        """The GPU's lock, held around every change of its daemon (reentrant in one
        thread); yields whether it is held: with ``wait`` False it is not taken when
        another holds it, else a wait longer than ``MPS_LOCK_TIMEOUT`` is an ``MpsError``."""
        self._check_uuid(gpu_uuid)
        return self._locks.hold(gpu_uuid, wait=wait)

    # ---- public ---------------------------------------------------------------------

    def ensure(
        self,
        gpu_uuid: str,
        limits: DaemonLimits,
        *,
        multiuser: bool = False,
        exact: bool = False,
    ) -> MpsDaemon:
        """The GPU's running daemon, started if there is none, holding limits that
        cover ``limits`` (idempotent); with ``exact``, holding exactly ``limits`` (the
        daemon of a device allocated whole serves one claim, whose config they are).
        ``multiuser``: start it with -multiuser-server even where the program does not
        (a claim's config asked; a running daemon is kept as it is)."""
        began = self._locks.waited_since(gpu_uuid) or time.monotonic()
        deadline = began + DAEMON_CALL_BUDGET  # the wait for the lock counts
        with self.hold(gpu_uuid):
            daemon = self._find(gpu_uuid, deadline=deadline) or self._start(
                gpu_uuid, multiuser=multiuser, deadline=deadline
            )
            wanted = limits if exact else limits.covering(daemon.limits)
            if wanted != daemon.limits:
                daemon = self._set_limits(daemon, wanted)
            return daemon

    def stop(self, gpu_uuid: str) -> bool:
        """Stop the GPU's daemon, empty its pipe directory, unmount its tmpfs
        (idempotent); whether a daemon was running."""
        with self.hold(gpu_uuid):
            return self._stop(gpu_uuid)

    def alive(self, record: MpsDaemon) -> bool:
        """Whether the recorded daemon still runs (same process, or same Pod)."""
        return self.launcher.alive(record.launched)

    def running_of(self, gpus: Sequence[str]) -> dict[str, bool]:
        """Per GPU with a record, whether its recorded daemon still runs, asked of the
        launcher at once (one list of the node's daemon Pods, not one read each)."""
        records = {gpu: r for gpu in gpus if (r := self._read_record(gpu)) is not None}
        alive = self.launcher.alive_all([r.launched for r in records.values()])
        return dict(zip(records, alive, strict=True))

    def running(self, gpu_uuid: str) -> MpsDaemon | None:
        """The GPU's recorded daemon if it still runs (no adoption: the watch's view)."""
        self._check_uuid(gpu_uuid)
        record = self._read_record(gpu_uuid)
        return record if record is not None and self.alive(record) else None

    def describe(self, gpu_uuid: str) -> str:
        """The recorded daemon as a person finds it ("Pod <name>", "pid <pid>"); ""
        when none is recorded."""
        record = self._read_record(gpu_uuid)
        if record is None:
            return ""
        return f"Pod {record.pod}" if record.pod else f"pid {record.pid}"

    def sweep(
        self, keep: Callable[[str], bool] | Collection[str], *, wait: bool = True
    ) -> list[str]:
        """Stop the daemons of GPUs not kept (orphans of a crash): ``keep`` names them,
        or is asked under the GPU's lock, so a prepare that recorded its share meanwhile
        is seen. Without ``wait`` a GPU whose lock is held is left to its holder. The
        GPUs whose daemon was stopped."""
        kept = keep if callable(keep) else frozenset(keep).__contains__
        stopped = []
        for gpu_uuid in self._known_gpus():
            with self.hold(gpu_uuid, wait=wait) as held:
                if held and not kept(gpu_uuid) and self._stop(gpu_uuid):
                    stopped.append(gpu_uuid)
        return stopped

    # ---- finding a daemon -------------------------------------------------------------

    def _find(
        self, gpu_uuid: str, *, ready: bool = True, deadline: float = math.inf
    ) -> MpsDaemon | None:
        record = self._read_record(gpu_uuid)
        if record is not None and self.alive(record):
            return record
        # Its limits are not known, so they are set again.
        adopted = self.launcher.adopt(self._spot(gpu_uuid, deadline), ready=ready)
        if adopted is None:
            return None
        daemon = self._daemon(gpu_uuid, adopted, None)
        log.info(
            "adopted an MPS daemon",
            extra={"gpu": gpu_uuid, "pid": adopted.pid, "pod": adopted.pod},
        )
        self._write_record(daemon)
        return daemon

    def _known_gpus(self) -> list[str]:
        found = set(self.launcher.others())
        try:
            folders = sorted(entry for entry in self.root.iterdir() if entry.is_dir())
        except FileNotFoundError:
            folders = []
        for folder in folders:
            # Not a regular file (a FIFO would hang a plain read), or not text: unknown.
            with suppress(OSError, ValueError):
                gpu_uuid = read_regular(folder / GPU_FILE).decode().strip()
                if _UUID.fullmatch(gpu_uuid) and folder == self._folder(gpu_uuid):
                    found.add(gpu_uuid)
        return sorted(gpu for gpu in found if _UUID.fullmatch(gpu))

    # ---- start ------------------------------------------------------------------------

    def _start(
        self, gpu_uuid: str, *, multiuser: bool = False, deadline: float = math.inf
    ) -> MpsDaemon:
        self._folder(gpu_uuid).mkdir(parents=True, exist_ok=True)
        write_atomic(self._folder(gpu_uuid) / GPU_FILE, f"{gpu_uuid}\n".encode(), durable=False)
        for path in (self._pipe_dir(gpu_uuid), self._log_dir(gpu_uuid)):
            _make_dir(path, 0o755)
        shm = self._shm_dir(gpu_uuid)
        _make_dir(shm, 0o755)
        if not is_mount_point(shm):
            mount_tmpfs(shm, self.shm_size)
        _empty(shm)  # a dead server's segments
        _empty(self._pipe_dir(gpu_uuid))  # a dead daemon's pid file must not pass for this one's
        mode = "-f" if self.launcher.foreground else "-d"
        multiuser = multiuser or self.program.multiuser
        flags = [mode, *(["-multiuser-server"] if multiuser else [])]
        env = {"CUDA_VISIBLE_DEVICES": gpu_uuid, GPU_ENV: gpu_uuid}
        command = self._view(gpu_uuid, shm=True) + flags
        launched = self.launcher.launch(self._spot(gpu_uuid, deadline), command, env)
        daemon = self._daemon(gpu_uuid, launched, None)
        crash_point("mps-after-start")
        self._write_record(daemon)
        log.info(
            "MPS daemon started", extra={"gpu": gpu_uuid, "pid": launched.pid, "pod": launched.pod}
        )
        return daemon

    def _view(self, gpu_uuid: str, *, shm: bool) -> list[str]:
        """The control program's command line, run in the daemon's view."""
        argv = [
            sys.executable,
            "-m",
            VIEW_MODULE,
            "--pipe",
            str(self._pipe_dir(gpu_uuid)),
            "--log",
            str(self._log_dir(gpu_uuid)),
            "--root",
            str(self.program.driver_root),
        ]
        if shm:
            argv += ["--shm", str(self._shm_dir(gpu_uuid))]
        return [*argv, "--", *self.program.command]

    def _spot(self, gpu_uuid: str, deadline: float = math.inf) -> DaemonSpot:
        return DaemonSpot(
            gpu_uuid,
            self._name(),
            self._pipe_dir(gpu_uuid),
            self._log_dir(gpu_uuid),
            lambda: self._answers(gpu_uuid),
            deadline,
        )

    def _answers(self, gpu_uuid: str) -> bool:
        """Whether the daemon takes a control command now (a harmless one)."""
        try:
            self.control(gpu_uuid, ["get_server_list"])
        except MpsError:
            return False
        return True

    def _name(self) -> str:
        return Path(self.program.command[-1]).name

    def _environment(self, gpu_uuid: str) -> dict[str, str]:
        env = {name: value for name, value in os.environ.items() if name != CRASH_ENV}
        env["CUDA_VISIBLE_DEVICES"] = gpu_uuid
        env[GPU_ENV] = gpu_uuid
        return env

    # ---- limits and commands ------------------------------------------------------------

    def control(self, gpu_uuid: str, commands: Sequence[str]) -> list[str]:
        """Send commands to the GPU's daemon through the control program; its output
        lines."""
        text = "".join(f"{command}\n" for command in commands)
        try:
            done = subprocess.run(
                self._view(gpu_uuid, shm=False),
                input=text.encode(),
                env=self._environment(gpu_uuid),
                capture_output=True,
                timeout=CONTROL_TIMEOUT,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise MpsError(f"MPS daemon of GPU {gpu_uuid}: {self._name()}: {err}") from err
        if done.returncode != 0:
            said = done.stderr.decode(errors="replace").strip()[:500]
            raise MpsError(
                f"MPS daemon of GPU {gpu_uuid}: {commands[0].split()[0]}: {said or 'no message'}"
            )
        return done.stdout.decode(errors="replace").splitlines()

    def _set_limits(self, daemon: MpsDaemon, limits: DaemonLimits) -> MpsDaemon:
        listed = self.control(daemon.gpu_uuid, ["get_server_list"])
        servers = [int(word) for line in listed for word in line.split() if word.isdigit()]
        said = self.control(daemon.gpu_uuid, limits.commands(servers))
        refused = [line for line in said if "error" in line.lower()]
        if refused:
            raise MpsError(f"MPS daemon of GPU {daemon.gpu_uuid} refused its limits: {refused[0]}")
        updated = replace(daemon, limits=limits)
        self._write_record(updated)
        log.info(
            "MPS daemon limits set",
            extra={
                "gpu": daemon.gpu_uuid,
                "memoryMiB": limits.memory_mib,
                "threads": limits.thread_percentage,
            },
        )
        return updated

    # ---- stop -------------------------------------------------------------------------

    def _stop(self, gpu_uuid: str) -> bool:
        # Not waiting for one still starting (a Pod whose image cannot be pulled): it
        # is ended all the same.
        daemon = self._find(gpu_uuid, ready=False)
        if daemon is not None:
            self._quit(daemon)
            self.launcher.end(self._spot(gpu_uuid), daemon.launched)
            log.info(
                "MPS daemon stopped",
                extra={"gpu": gpu_uuid, "pid": daemon.pid, "pod": daemon.pod},
            )
        crash_point("mps-after-stop")
        _empty(self._pipe_dir(gpu_uuid))
        shm = self._shm_dir(gpu_uuid)
        if is_mount_point(shm):
            unmount(shm)
        (self._folder(gpu_uuid) / RECORD_FILE).unlink(missing_ok=True)
        return daemon is not None

    def _quit(self, daemon: MpsDaemon) -> None:
        """Ask the daemon to exit; failures only log, the launcher's force follows."""
        try:
            self.control(daemon.gpu_uuid, ["quit"])
        except MpsError as err:
            log.warning("MPS quit failed", extra={"gpu": daemon.gpu_uuid, "error": str(err)})

    # ---- files ------------------------------------------------------------------------

    def _folder(self, gpu_uuid: str) -> Path:
        return self.root / folder_key(gpu_uuid)

    def _pipe_dir(self, gpu_uuid: str) -> Path:
        return self._folder(gpu_uuid) / "pipe"

    def _log_dir(self, gpu_uuid: str) -> Path:
        return self._folder(gpu_uuid) / "log"

    def _shm_dir(self, gpu_uuid: str) -> Path:
        return self._folder(gpu_uuid) / "shm"

    def _daemon(self, gpu_uuid: str, launched: Launched, limits: DaemonLimits | None) -> MpsDaemon:
        return MpsDaemon(
            gpu_uuid,
            launched.pid,
            launched.start_time,
            self._pipe_dir(gpu_uuid),
            self._log_dir(gpu_uuid),
            self._shm_dir(gpu_uuid),
            limits,
            launched.pod,
            launched.pod_uid,
        )

    def _read_record(self, gpu_uuid: str) -> MpsDaemon | None:
        path = self._folder(gpu_uuid) / RECORD_FILE
        try:
            doc = json.loads(read_regular(path))
            return self._record(gpu_uuid, doc)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as err:
            # Only ever written atomically by us; a bad one (not a regular file
            # included: NotRegularFile is an OSError) is ignored, and the pid file (or
            # the Pod's name) still leads to a running daemon.
            log.warning(
                "unreadable MPS daemon record", extra={"path": str(path), "error": str(err)}
            )
            return None

    def _record(self, gpu_uuid: str, doc: Mapping[str, object]) -> MpsDaemon:
        pid, start_time, limits = doc["pid"], doc["startTime"], doc.get("limits")
        if doc["gpu"] != gpu_uuid or not isinstance(pid, int) or not isinstance(start_time, int):
            raise ValueError("not a record of this GPU")
        pod, pod_uid = doc.get("pod"), doc.get("podUID")
        if not isinstance(pod, str | None) or not isinstance(pod_uid, str | None):
            raise ValueError("the Pod's name and UID are not strings")
        held = None
        if isinstance(limits, dict):
            memory, threads = limits["memoryMiB"], limits["threadPercentage"]
            if not isinstance(memory, int) or not isinstance(threads, int):
                raise ValueError("limits are not numbers")
            held = DaemonLimits(memory, threads)
        return self._daemon(gpu_uuid, Launched(pid, start_time, pod, pod_uid), held)

    def _write_record(self, daemon: MpsDaemon) -> None:
        doc: dict[str, object] = {
            "gpu": daemon.gpu_uuid,
            "pid": daemon.pid,
            "startTime": daemon.start_time,
        }
        if daemon.pod is not None:
            doc |= {"pod": daemon.pod, "podUID": daemon.pod_uid}
        if daemon.limits is not None:
            doc["limits"] = {
                "memoryMiB": daemon.limits.memory_mib,
                "threadPercentage": daemon.limits.thread_percentage,
            }
        data = json.dumps(doc, sort_keys=True).encode() + b"\n"
        # Not durable: a reboot ends the daemon, and the record with it.
        path = self._folder(daemon.gpu_uuid) / RECORD_FILE
        write_atomic(path, data, crash_tag="mps-record", durable=False)

    @staticmethod
    def _check_uuid(gpu_uuid: str) -> None:
        if not _UUID.fullmatch(gpu_uuid):
            raise MpsError(f"GPU UUID {gpu_uuid!r}: not a UUID MPS can be run for")


# ---- the tmpfs ------------------------------------------------------------------------


def is_mount_point(path: Path) -> bool:
    """Whether something is mounted at ``path`` (this process's mount table)."""
    target = str(path.absolute())
    try:
        table = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return False
    # Field 5 is the mount point, with spaces and the like escaped as octal.
    points = {_unescape(line.split()[4]) for line in table.splitlines() if len(line.split()) > 4}
    return target in points


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_tmpfs(path: Path, size: int) -> None:
    try:
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={size},mode=1777")
    except ViewError as err:
        raise MpsError(
            f"the MPS daemon's tmpfs: {err} (the plugin needs CAP_SYS_ADMIN for MPS shares)"
        ) from err


def unmount(path: Path) -> None:
    # Detached: a client still holding a segment open must not keep the stop waiting.
    try:
        unmount_detached(path)
    except ViewError as err:
        log.warning("MPS tmpfs not unmounted", extra={"path": str(path), "error": str(err)})


def _half_of_memory() -> int:
    """Half the node's memory, the most the tmpfs may take (NVIDIA sizes it so too)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 // 2
    except (OSError, ValueError, IndexError):
        pass
    return 2**30


def folder_key(gpu_uuid: str) -> str:
    """The GPU's folder name under ``<state dir>/mps``."""
    return hashlib.sha256(gpu_uuid.encode()).hexdigest()[:12]


def _make_dir(path: Path, mode: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    # Exactly this mode whatever the umask: containers of any user reach the daemon here.
    path.chmod(mode)


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


def read_pid(path: Path) -> int | None:
    # read_regular: a FIFO under the pid file's name would hang a plain read.
    try:
        text = read_regular(path).decode().strip()
    except (OSError, ValueError):
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def starting_daemons(gpu_uuid: str) -> list[int]:
    """Processes that start or run a control daemon for this GPU: ``DRASIL_MPS_GPU`` in
    their environment and ``-d`` among their arguments (the view, the control program,
    its forks; not a control command, which has no ``-d``)."""
    wanted = f"{GPU_ENV}={gpu_uuid}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"-d" in argv and wanted in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def _serves(pid: int, gpu_uuid: str) -> bool:
    """Whether process ``pid`` was started for this GPU (its environment says so)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{GPU_ENV}={gpu_uuid}".encode() in environ.split(b"\0")

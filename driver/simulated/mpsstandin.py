"""A stand-in for NVIDIA's ``nvidia-cuda-mps-control`` on simulated GPUs.

The plugin runs it exactly as it runs the real program, with the same arguments and
environment, so a simulated node enforces GPU shares the way a real one does::

    python -m drasil.driver.simulated.mpsstandin -d [-multiuser-server]  # daemonize
    python -m drasil.driver.simulated.mpsstandin -f [-multiuser-server]  # foreground
    python -m drasil.driver.simulated.mpsstandin  # client: commands on stdin

Environment, as the real one reads it: ``CUDA_MPS_PIPE_DIRECTORY`` (default
/tmp/nvidia-mps), ``CUDA_MPS_LOG_DIRECTORY`` (default /var/log/nvidia-mps) and
``CUDA_VISIBLE_DEVICES`` (the GPU served). ``DRASIL_MPS_STANDIN_SHM_DIR`` (default
/dev/shm) moves the shared memory segment, for tests only.

The daemon leaves in the pipe directory ``nvidia-cuda-mps-control.pid`` and
``control``, a Unix stream socket; in the log directory ``control.log``; and in the
shared memory directory ``mps.shm.<uid>.<pid>`` holding a random token. A client must
read that token from its own /dev/shm to connect: the point of the stand-in is that a
container which does not share the daemon's /dev/shm is refused, as real CUDA is.

Protocol: one ASCII line each way per message. Control commands (the real ones the
plugin sends, plus ``get_client_count``) get one reply line. A client handshake is
``client <pinned env> <threads env>`` -> ``shm <name>`` -> ``token <token>`` ->
``ok memory=<M> threads=<P>``, then ``ping`` -> ``pong`` while it stays connected.
Any step may be answered ``error: <why>``. e2e/harness/probe/mps_client.c speaks the client
side in containers; ``control()`` and ``connect_client()`` speak it from Python.

Standard library only, so it starts fast and carries nothing of the plugin along.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import selectors
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType, TracebackType
from typing import NoReturn, TypeVar

PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_SOCKET = "control"
LOG_FILE = "control.log"
# Volta+ MPS serves at most 48 client CUDA contexts per device (NVIDIA's MPS docs).
CLIENT_LIMIT = 48
CONNECTION_LIMIT = 256  # open connections of any kind: one thread each
MAX_LINE = 4096
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with its terminating NUL
PIPE_DIR_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_DIR_ENV = "CUDA_MPS_LOG_DIRECTORY"
GPU_ENV = "CUDA_VISIBLE_DEVICES"
SHM_DIR_ENV = "DRASIL_MPS_STANDIN_SHM_DIR"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
DEFAULT_LOG_DIR = "/var/log/nvidia-mps"
DEFAULT_SHM_DIR = "/dev/shm"
NO_DAEMON = "Cannot find MPS control daemon process"
USAGE = "usage: nvidia-cuda-mps-control [-d | -f] [-multiuser-server]"

_LIMIT = re.compile(r"([0-9]+)([MG])")
_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z-]+")
_DEFAULT_SHM = Path(DEFAULT_SHM_DIR)
_Number = TypeVar("_Number", int, float)


class DaemonNotFound(ConnectionError):
    """No MPS control daemon answers on the pipe directory's control socket."""


class StandinRefused(Exception):
    """The daemon refused a client, or the client could not read its shared memory."""


# -- limits ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """A pinned device memory limit (MiB) and an active thread percentage; None: none."""

    pinned_mib: int | None = None
    threads: float | None = None

    def memory_text(self) -> str:
        return "unlimited" if self.pinned_mib is None else f"{self.pinned_mib}M"

    def threads_text(self) -> str:
        return str(100.0 if self.threads is None else self.threads)

    def narrowed(self, client: Limits) -> Limits:
        # A client's environment can lower what the daemon allows, never raise it.
        return Limits(
            _lower(self.pinned_mib, client.pinned_mib), _lower(self.threads, client.threads)
        )


def _lower(daemon: _Number | None, client: _Number | None) -> _Number | None:
    if client is None:
        return daemon
    return client if daemon is None else min(daemon, client)


def parse_pinned(value: str) -> int:
    """``20480M`` or ``20G`` in MiB; the real daemon's form, so M or G is required."""
    match = _LIMIT.fullmatch(value)
    if match is None or int(match[1]) == 0:
        raise ValueError(f"bad memory limit {value!r}: want MiB or GiB like 20480M or 20G")
    return int(match[1]) * (1024 if match[2] == "G" else 1)


def parse_threads(value: str) -> float:
    """An active thread percentage, 1 to 100."""
    try:
        percentage = float(value)
    except ValueError:
        percentage = float("nan")
    if not 1 <= percentage <= 100:  # NaN fails too
        raise ValueError(f"bad active thread percentage {value!r}: want 1 to 100")
    return percentage


def _client_pinned(env: str, gpu: str) -> int | None:
    """The limit a CUDA_MPS_PINNED_DEVICE_MEM_LIMIT value (``0=20G,1=4G``) sets for
    the one GPU this daemon sees: its ordinal 0, or its UUID."""
    mib = None
    for entry in env.split(","):
        device, equals, value = entry.partition("=")
        if not equals or not device:
            raise ValueError(f"bad entry {entry!r}: want <device>=<limit>")
        limit = parse_pinned(value)
        if device in ("0", gpu):
            mib = limit
    return mib


def _client_limits(words: list[str], gpu: str) -> Limits:
    """The limits a ``client <pinned> <threads>`` line asks for (``-``: unset)."""
    if len(words) != 3:
        raise ValueError("want: client <pinned limit or -> <thread percentage or ->")
    pinned, threads = words[1:]
    try:
        mib = None if pinned == "-" else _client_pinned(pinned, gpu)
    except ValueError as err:
        raise ValueError(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: {err}") from None
    try:
        percentage = None if threads == "-" else parse_threads(threads)
    except ValueError as err:
        raise ValueError(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: {err}") from None
    return Limits(mib, percentage)


# -- one line each way ------------------------------------------------------------------


class _Channel:
    """A connected Unix stream socket carrying one ASCII line per message."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._reader = sock.makefile("rb")

    def send(self, line: str) -> None:
        self.sock.sendall(f"{line}\n".encode("ascii", errors="replace"))

    def receive(self) -> str | None:
        """The next line, stripped; None at EOF or when a line runs over MAX_LINE
        (the connection is then dropped: a peer that sends one is not ours)."""
        raw = self._reader.readline(MAX_LINE + 1)
        if not raw.endswith(b"\n"):
            return None
        return raw.decode("ascii", errors="replace").strip()

    def close(self) -> None:
        self._reader.close()
        self.sock.close()

    def __enter__(self) -> _Channel:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _dial(pipe_dir: Path, timeout: float) -> _Channel:
    path = pipe_dir / CONTROL_SOCKET
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(os.fsencode(path))
    except OSError as err:
        sock.close()
        raise DaemonNotFound(f"{NO_DAEMON} at {path}: {err.strerror or err}") from err
    return _Channel(sock)


def _answers(pipe_dir: Path) -> bool:
    """Whether a daemon listens on the control socket of ``pipe_dir``."""
    try:
        _dial(pipe_dir, 1.0).close()
    except DaemonNotFound:
        return False
    return True


def _peer(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end, as the kernel saw it connect."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


# -- the daemon ---------------------------------------------------------------------


class StartError(Exception):
    """The daemon cannot start; the message says why."""


@dataclass(frozen=True)
class Config:
    pipe_dir: Path
    log_dir: Path
    shm_dir: Path
    gpu: str
    multiuser: bool = False
    foreground: bool = False

    @classmethod
    def from_env(cls, *, multiuser: bool = False, foreground: bool = False) -> Config:
        # Absolute: the daemonized process works from /.
        def directory(name: str, default: str) -> Path:
            return Path(os.environ.get(name) or default).absolute()

        return cls(
            pipe_dir=directory(PIPE_DIR_ENV, DEFAULT_PIPE_DIR),
            log_dir=directory(LOG_DIR_ENV, DEFAULT_LOG_DIR),
            shm_dir=directory(SHM_DIR_ENV, DEFAULT_SHM_DIR),
            gpu=os.environ.get(GPU_ENV, ""),
            multiuser=multiuser,
            foreground=foreground,
        )


class Daemon:
    """The control daemon and the one MPS server it runs, in one process: the server's
    pid is the daemon's own."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.shm_name = f"mps.shm.{os.getuid()}.{os.getpid()}"
        self._token = secrets.token_hex(16)
        self._lock = threading.Lock()  # the limits, clients and connection count
        self._log_lock = threading.Lock()
        self._cleanup_lock = threading.Lock()
        self._default = Limits()
        self._server: Limits | None = None  # set on the running server; gone with it
        self._clients: dict[int, int] = {}  # connection id -> uid, from `client` on
        self._connections = 0
        self._bound = False  # whether the socket file is ours to remove
        self._stopping = threading.Event()
        self._wake_read, self._wake_write = os.pipe()

    # lifecycle

    def start(self) -> socket.socket:
        """The listening control socket, with the pid file and shared memory in place."""
        config = self.config
        path = config.pipe_dir / CONTROL_SOCKET
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise StartError(
                f"{path}: a Unix socket path has at most {MAX_SOCKET_PATH} bytes; "
                f"set a shorter {PIPE_DIR_ENV}"
            )
        for directory in (config.pipe_dir, config.log_dir, config.shm_dir):
            directory.mkdir(parents=True, exist_ok=True)
        self._write_log(f"starting for {config.gpu or 'no GPU'}; multiuser: {config.multiuser}")
        if _answers(config.pipe_dir):
            raise StartError(f"an MPS control daemon already runs in {config.pipe_dir}")
        path.unlink(missing_ok=True)  # a dead daemon's
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.fsencode(path))
        self._bound = True
        path.chmod(0o666)  # clients of any uid connect; the uid rules are ours
        listener.listen(CONNECTION_LIMIT)
        self._write_shm()
        _write_pid_file(config.pipe_dir)
        self.log("started")
        return listener

    def _write_shm(self) -> None:
        path = self.config.shm_dir / self.shm_name
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o644)
        with os.fdopen(fd, "w") as segment:
            os.fchmod(fd, 0o644)  # whatever the umask: clients of other uids read it
            segment.write(f"{self._token}\n")

    def serve(self, listener: socket.socket) -> None:
        """Accept connections, one thread each, until ``quit``."""
        with selectors.DefaultSelector() as selector:
            selector.register(listener, selectors.EVENT_READ)
            selector.register(self._wake_read, selectors.EVENT_READ)
            while not self._stopping.is_set():
                for key, _events in selector.select():
                    if key.fileobj is listener:
                        self._accept(listener)

    def _accept(self, listener: socket.socket) -> None:
        sock, _address = listener.accept()
        with self._lock:
            full = self._connections >= CONNECTION_LIMIT
            if not full:
                self._connections += 1
        if full:
            self.log(f"refused a connection: {CONNECTION_LIMIT} are open")
            sock.close()
            return
        threading.Thread(target=self._handle, args=(sock,), daemon=True).start()

    def stop(self) -> None:
        """Remove what the daemon left (again if need be) and wake ``serve`` to return."""
        self.clean_up()
        self._stopping.set()
        os.write(self._wake_write, b"x")

    def clean_up(self) -> None:
        with self._cleanup_lock:
            if self._bound:
                (self.config.pipe_dir / CONTROL_SOCKET).unlink(missing_ok=True)
                self._bound = False
            (self.config.shm_dir / self.shm_name).unlink(missing_ok=True)
            pid_file = self.config.pipe_dir / PID_FILE
            with contextlib.suppress(OSError, ValueError):
                if int(pid_file.read_text()) == os.getpid():  # not a successor's
                    pid_file.unlink()

    def log(self, message: str) -> None:
        """Log, never failing: a full disk must not take a connection down."""
        with contextlib.suppress(OSError):
            self._write_log(message)

    def _write_log(self, message: str) -> None:
        line = f"[{time.strftime('%Y-%m-%d %H:%M:%S')} Control {os.getpid()}] {message}\n"
        with self._log_lock, (self.config.log_dir / LOG_FILE).open("a") as log:
            log.write(line)
        if self.config.foreground:  # what a Pod shows in `kubectl logs`
            print(line, end="", file=sys.stderr, flush=True)

    # connections

    def _handle(self, sock: socket.socket) -> None:
        channel = _Channel(sock)
        quitting = False
        try:
            while not quitting and (line := channel.receive()) is not None:
                words = line.split()
                if words[:1] == ["client"]:
                    self._serve_client(channel, words)
                    return
                quitting = words == ["quit"]
                channel.send(self.command(words))
        except OSError:
            pass  # the peer went away mid-message: nothing to answer
        finally:
            channel.close()
            with self._lock:
                self._connections -= 1
            if quitting:  # even if the reply did not get through: the files are gone
                self.stop()

    def command(self, words: list[str]) -> str:
        """The reply to one control command."""
        if not words:
            return "error: empty command"
        name, *args = words
        if name not in COMMANDS:
            reply = f"error: unknown command {name}"
        elif len(args) != COMMANDS[name][0]:
            reply = f"error: {name} takes {COMMANDS[name][0]} argument(s)"
        else:
            try:
                with self._lock:
                    reply = COMMANDS[name][1](self, *args)
            except ValueError as err:
                reply = f"error: {err}"
        self.log(f"command {' '.join(words)} -> {reply or '(empty)'}")
        return reply

    def _serve_client(self, channel: _Channel, words: list[str]) -> None:
        pid, uid = _peer(channel.sock)
        try:
            wanted = _client_limits(words, self.config.gpu)
        except ValueError as err:
            self.log(f"refused client pid {pid} uid {uid}: {err}")
            channel.send(f"error: {err}")
            return
        key = id(channel)
        refusal = self._admit(key, uid)
        if refusal is not None:
            self.log(f"refused client pid {pid} uid {uid}: {refusal}")
            channel.send(f"error: {refusal}")
            return
        who = f"client pid {pid} uid {uid}"
        try:
            self._handshake(channel, key, wanted, who)
        finally:
            self._leave(key, f"{who} disconnected")

    def _handshake(self, channel: _Channel, key: int, wanted: Limits, who: str) -> None:
        channel.send(f"shm {self.shm_name}")
        line = channel.receive()
        if line is None:
            return
        if not secrets.compare_digest(line, f"token {self._token}"):
            # Gone before the reply, so a client that reads it sees the count dropped.
            self._leave(key, f"refused {who}: shared memory mismatch")
            channel.send("error: shared memory mismatch")
            return
        with self._lock:
            limits = self._running().narrowed(wanted)
        granted = f"memory={limits.memory_text()} threads={limits.threads_text()}"
        self.log(f"{who} connected: {granted}")
        channel.send(f"ok {granted}")
        while (line := channel.receive()) is not None:
            channel.send("pong" if line == "ping" else f"error: unknown client message {line}")

    def _admit(self, key: int, uid: int) -> str | None:
        """Why a client of ``uid`` cannot connect now, or None and it counts as one."""
        with self._lock:
            others = sorted({u for u in self._clients.values() if u != uid})
            if others and not self.config.multiuser:
                # The real server makes them wait; refusing keeps tests deterministic.
                return (
                    f"the MPS server runs for uid {others[0]}; clients of uid {uid} wait "
                    "until it exits (no -multiuser-server)"
                )
            if len(self._clients) >= CLIENT_LIMIT:
                return f"client limit {CLIENT_LIMIT} reached"
            self._clients[key] = uid
        return None

    def _leave(self, key: int, why: str | None = None) -> None:
        with self._lock:
            if self._clients.pop(key, None) is None:
                return
            if not self._clients:
                self._server = None  # the server exits with its last client
        if why:
            self.log(why)

    # control commands (called with self._lock held)

    def _running(self) -> Limits:
        return self._default if self._server is None else self._server

    def _server_limits(self, pid: str) -> Limits:
        if pid != str(os.getpid()) or not self._clients:
            raise ValueError(f"no server {pid}")
        return self._running()

    def _applies(self, device: str) -> bool:
        """Whether a limit set for ``device`` applies to the one GPU this daemon sees."""
        if device == "0":
            return True
        if _UUID.fullmatch(device):
            # NVIDIA's device plugin found the UUID form accepted but not applied (#572).
            self.log(f"device {device}: a UUID is accepted but not applied")
            return False
        if device.isdigit():
            self.log(f"device {device}: no such device here, ignored")
            return False
        raise ValueError(f"bad device {device!r}: want an ordinal or a UUID")

    def _quit(self) -> str:
        self.clean_up()  # before the reply: a caller that sees OK sees the files gone
        return "OK"

    def _set_default_pinned(self, device: str, value: str) -> str:
        mib = parse_pinned(value)
        if self._applies(device):
            self._default = replace(self._default, pinned_mib=mib)
        return "OK"

    def _get_default_pinned(self, device: str) -> str:
        return self._default.memory_text() if device == "0" else Limits().memory_text()

    def _set_default_threads(self, value: str) -> str:
        self._default = replace(self._default, threads=parse_threads(value))
        return "OK"

    def _get_default_threads(self) -> str:
        return self._default.threads_text()

    def _get_server_list(self) -> str:
        return str(os.getpid()) if self._clients else ""

    def _set_pinned(self, pid: str, device: str, value: str) -> str:
        limits = self._server_limits(pid)
        mib = parse_pinned(value)
        if self._applies(device):
            self._server = replace(limits, pinned_mib=mib)
        return "OK"

    def _get_pinned(self, pid: str, device: str) -> str:
        limits = self._server_limits(pid)
        return limits.memory_text() if device == "0" else Limits().memory_text()

    def _set_threads(self, pid: str, value: str) -> str:
        self._server = replace(self._server_limits(pid), threads=parse_threads(value))
        return "OK"

    def _get_threads(self, pid: str) -> str:
        return self._server_limits(pid).threads_text()

    def _get_client_count(self) -> str:
        return str(len(self._clients))


# Each command: how many arguments it takes, and what answers it.
COMMANDS: dict[str, tuple[int, Callable[..., str]]] = {
    "quit": (0, Daemon._quit),
    "set_default_device_pinned_mem_limit": (2, Daemon._set_default_pinned),
    "get_default_device_pinned_mem_limit": (1, Daemon._get_default_pinned),
    "set_default_active_thread_percentage": (1, Daemon._set_default_threads),
    "get_default_active_thread_percentage": (0, Daemon._get_default_threads),
    "get_server_list": (0, Daemon._get_server_list),
    "set_device_pinned_mem_limit": (3, Daemon._set_pinned),
    "get_device_pinned_mem_limit": (2, Daemon._get_pinned),
    "set_active_thread_percentage": (2, Daemon._set_threads),
    "get_active_thread_percentage": (1, Daemon._get_threads),
    "get_client_count": (0, Daemon._get_client_count),
}


def _write_pid_file(pipe_dir: Path) -> None:
    # Renamed into place so a reader never sees an empty or partial pid.
    temp = pipe_dir / f".{PID_FILE}.{os.getpid()}"
    temp.write_text(f"{os.getpid()}\n")
    temp.replace(pipe_dir / PID_FILE)


def _terminate(signum: int, frame: FrameType | None) -> NoReturn:
    # Once: a second signal must not interrupt the clean-up the first one started.
    signal.signal(signum, signal.SIG_IGN)
    raise SystemExit(0)


def _run_daemon(config: Config, ready: int | None = None) -> NoReturn:
    """Run the daemon until ``quit`` or SIGTERM; write a byte to ``ready`` (-d's
    launcher) once clients can connect. Never returns: after -d's fork, returning
    would run the launcher's code twice."""
    # Before anything exists, so a SIGTERM at any point still removes what does.
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    daemon = Daemon(config)
    code = 0
    try:
        listener = daemon.start()
        if ready is not None:
            os.write(ready, b"1")
            os.close(ready)
            _detach_stdio()
        daemon.serve(listener)
    except SystemExit:
        pass
    except Exception as err:  # whatever ends it, a daemon cleans up and reports
        code = 1
        print(f"mpsstandin: {err}", file=sys.stderr, flush=True)
        daemon.log(f"failed: {err}")
    finally:
        daemon.clean_up()
        daemon.log("stopped")
    os._exit(code)


def _detach_stdio() -> None:
    # The launcher's stderr may be a pipe it reads until EOF, or a file it deletes.
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def _daemonize(config: Config) -> int:
    """-d: fork the daemon into a session of its own, return once it is ready."""
    ready_read, ready_write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(ready_read)
        os.setsid()  # no controlling terminal, and no signal of the launcher's group
        os.chdir("/")
        # Twice, so the daemon is nobody's child here and the launcher can reap this one.
        if os.fork() == 0:
            _run_daemon(config, ready_write)
        os._exit(0)
    os.close(ready_write)
    os.waitpid(child, 0)
    with os.fdopen(ready_read, "rb") as ready:
        # One byte once clients can connect; EOF if the daemon died before that.
        return 0 if ready.read(1) else 1


# -- clients --------------------------------------------------------------------------


def control(pipe_dir: Path, command: str, timeout: float = 5.0) -> str:
    """Send one control command to the daemon of ``pipe_dir`` and return its reply
    (``error: ...`` included). DaemonNotFound when no daemon answers."""
    if "\n" in command:
        raise ValueError(f"one command, one line: {command!r}")
    with _dial(pipe_dir, timeout) as channel:
        channel.send(command)
        reply = channel.receive()
    if reply is None:
        raise ConnectionError(f"the MPS control daemon in {pipe_dir} did not answer {command!r}")
    return reply


class MpsClient:
    """A connection as a CUDA process under MPS holds one, with the limits it got."""

    def __init__(self, channel: _Channel, memory: str, threads: str) -> None:
        self._channel = channel
        self.memory = memory  # "20480M" or "unlimited"
        self.threads = threads  # "25.0"

    def ping(self) -> None:
        """ConnectionError (or another OSError) unless the daemon still serves us."""
        self._channel.send("ping")
        if self._channel.receive() != "pong":
            raise ConnectionError("the MPS control daemon dropped the client")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> MpsClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def connect_client(
    pipe_dir: Path,
    shm_dir: Path = _DEFAULT_SHM,
    pinned: str | None = None,
    threads: str | None = None,
    timeout: float = 5.0,
) -> MpsClient:
    """Connect as a CUDA client whose CUDA_MPS_PINNED_DEVICE_MEM_LIMIT is ``pinned``
    and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE ``threads``, reading the daemon's shared
    memory under ``shm_dir``. StandinRefused says why it may not."""
    channel = _dial(pipe_dir, timeout)
    try:
        channel.send(f"client {pinned or '-'} {threads or '-'}")
        segment = shm_dir / Path(_expect(channel, "shm")).name  # never a path elsewhere
        try:
            token = segment.read_text().strip()
        except OSError as err:
            message = f"cannot open the shared memory segment {segment}: {err.strerror or err}"
            raise StandinRefused(message) from err
        channel.send(f"token {token}")
        granted = {}
        for field in _expect(channel, "ok").split():  # memory=<M> threads=<P>
            name, _equals, value = field.partition("=")
            granted[name] = value
        return MpsClient(channel, granted.get("memory", ""), granted.get("threads", ""))
    except BaseException:
        channel.close()
        raise


def _expect(channel: _Channel, word: str) -> str:
    """The rest of a reply that starts with ``word``; StandinRefused for ``error:``."""
    reply = channel.receive()
    if reply is None:
        raise ConnectionError("the MPS control daemon closed the connection")
    if reply.startswith("error:"):
        raise StandinRefused(reply.removeprefix("error:").strip())
    head, _space, rest = reply.partition(" ")
    if head != word:
        raise ConnectionError(f"the MPS control daemon answered {reply!r}, not {word}")
    return rest


def _client_mode(pipe_dir: Path) -> int:
    """Like the real program without -d: each line of stdin to the daemon, each reply
    to stdout."""
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = control(pipe_dir, line.strip())
        except DaemonNotFound:
            print(NO_DAEMON, file=sys.stderr)
            return 1
        except OSError as err:
            print(f"mpsstandin: {err}", file=sys.stderr)
            return 1
        print(reply, flush=True)
    return 0


# -- command line -------------------------------------------------------------------


def _parse(argv: Sequence[str]) -> tuple[str | None, bool]:
    """The mode (``-d``, ``-f`` or None: the client) and whether -multiuser-server."""
    unknown = [arg for arg in argv if arg not in ("-d", "-f", "-multiuser-server")]
    modes = [arg for arg in argv if arg in ("-d", "-f")]
    multiuser = "-multiuser-server" in argv
    if unknown or len(modes) > 1 or (multiuser and not modes):
        raise ValueError(f"bad arguments {' '.join(argv)}")
    return (modes[0] if modes else None), multiuser


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        mode, multiuser = _parse(args)
    except ValueError as err:
        print(f"mpsstandin: {err}\n{USAGE}", file=sys.stderr)
        return 1
    config = Config.from_env(multiuser=multiuser, foreground=mode == "-f")
    if mode == "-d":
        return _daemonize(config)
    if mode == "-f":
        _run_daemon(config)
    return _client_mode(config.pipe_dir)


if __name__ == "__main__":
    sys.exit(main())

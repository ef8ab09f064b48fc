"""gRPC servers on unix sockets that come back when someone deletes their socket.

kubelet restarts and node clean-ups delete socket files; kubelet's plugin watcher
registers a plugin when its socket (re)appears. So a server here owns one path: it
removes a stale file before it listens, and ``ensure()`` (called every few hundred
milliseconds by the plugin's watch loop) starts a fresh server when the file it
created is gone or was replaced.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

# Linux limits sun_path to 108 bytes including the NUL; grpc's own check refuses
# paths from 106 bytes on (measured with grpcio 1.85).
MAX_SOCKET_PATH = 105

# The hidden name bound before the rename: "." + name + "." + 6 hex digits.
_HIDDEN_EXTRA = 8
# The longest socket path a caller may ask for.
MAX_PATH = MAX_SOCKET_PATH - _HIDDEN_EXTRA

AddServicers = Callable[[grpc.Server], None]

# Per-Pod socket names carry this much of the Pod's UID; see pod_tag.
POD_TAG_CHARS = 13


def pod_tag(pod_uid: str) -> str:
    """The part of a Pod UID that goes into per-Pod socket names: its first 13
    characters (``3f2a9c1b-7d4e``, 48 random bits of a UUID).

    Enough to tell apart the two Pods of a rolling update on one node, still a prefix
    of the UID an operator sees in ``kubectl get pod -o yaml``, and short enough to
    leave room for driver names of up to 40 characters under kubelet's default
    ``/var/lib/kubelet/plugins_registry`` (the whole UID left room for 17).
    """
    return pod_uid[:POD_TAG_CHARS]


class SocketPathTooLong(ValueError):
    """A unix socket path the kernel would refuse."""


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


class UnixSocketServer:
    """One gRPC server bound to one unix socket path, restartable on deletion."""

    def __init__(self, path: Path, add_servicers: AddServicers, *, max_workers: int = 32) -> None:
        size = len(os.fsencode(path))
        if size > MAX_PATH:
            raise SocketPathTooLong(
                f"socket path {path} is {size} bytes; at most {MAX_PATH} are allowed "
                "(unix sockets, and the temporary name bound first): use a shorter directory"
            )
        self.path = path
        self._add_servicers = add_servicers
        self._max_workers = max_workers
        self._server: grpc.Server | None = None
        self._inode: int | None = None
        self._lock = threading.Lock()
        self.restarts = 0

    def start(self) -> None:
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # grpc unlinks the path it bound when the server stops, whoever owns the file
        # by then. Binding a hidden name (kubelet ignores dot-files) and renaming it
        # into place leaves grpc a name that no longer exists, so stopping an old
        # instance never deletes a newer instance's socket.
        hidden = self.path.with_name(f".{self.path.name}.{secrets.token_hex(3)}")
        server = grpc.server(ThreadPoolExecutor(max_workers=self._max_workers))
        self._add_servicers(server)
        try:
            server.add_insecure_port(f"unix://{hidden}")
        except RuntimeError as err:  # grpc says only "Failed to bind"
            raise OSError(f"cannot listen on unix socket {hidden}: {err}") from err
        server.start()
        os.replace(hidden, self.path)  # also replaces a stale socket of a dead instance
        self._server = server
        self._inode = _inode(self.path)
        log.info("serving gRPC", extra={"socket": str(self.path)})

    def ensure(self) -> bool:
        """Restart the server if its socket vanished; return True when it did."""
        with self._lock:
            if self._server is None or _inode(self.path) == self._inode:
                return False
            log.warning("socket was removed; serving it again", extra={"socket": str(self.path)})
            self._server.stop(grace=None)
            self._start_locked()
            self.restarts += 1
            return True

    def stop(self, grace: float | None = 1.0) -> None:
        with self._lock:
            if self._server is not None:
                self._server.stop(grace=grace).wait()
                self._server = None
            # Only remove the file if it is still ours: a newer instance may own the path.
            if self._inode is not None and _inode(self.path) == self._inode:
                self.path.unlink(missing_ok=True)
            self._inode = None

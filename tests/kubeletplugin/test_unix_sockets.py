"""gRPC servers on unix sockets: stale files, deleted sockets, path limits, stop."""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kubelet_client import DEADLINE, short_dir

from drasil.api.kubelet.pluginregistration import registration_pb2 as pb
from drasil.api.kubelet.pluginregistration import registration_pb2_grpc as pb_grpc
from drasil.kubeletplugin.dra.plugin import _Drained
from drasil.kubeletplugin.dra.registration import Registration
from drasil.kubeletplugin.sockets import (
    MAX_PATH,
    MAX_SOCKET_PATH,
    SocketPathTooLong,
    UnixSocketServer,
)


def add_registration(server: grpc.Server) -> None:
    pb_grpc.add_RegistrationServicer_to_server(
        Registration(driver_name="gpu.drasil.dev", endpoint="/x/dra.sock"), server
    )


def answers(path: Path) -> str:
    """Dial the socket afresh, as kubelet does, and return GetInfo's name."""
    with grpc.insecure_channel(f"unix://{path}") as channel:
        info = pb_grpc.RegistrationStub(channel).GetInfo(pb.InfoRequest(), timeout=DEADLINE)
    return info.name


def is_socket(path: Path) -> bool:
    return stat.S_ISSOCK(path.lstat().st_mode)


@pytest.fixture
def directory() -> Iterator[Path]:
    with short_dir() as path:
        yield path


def test_serves_and_stop_removes_the_socket(directory: Path) -> None:
    server = UnixSocketServer(directory / "plugins" / "reg.sock", add_registration)
    server.start()  # creates the missing directory
    try:
        assert is_socket(server.path)
        assert answers(server.path) == "gpu.drasil.dev"
    finally:
        server.stop(grace=None)
    assert not server.path.exists()


def test_stale_socket_file_is_removed_at_start(directory: Path) -> None:
    path = directory / "reg.sock"
    # What a killed plugin leaves: a socket file nobody listens on.
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()
    assert is_socket(path)
    server = UnixSocketServer(path, add_registration)
    server.start()
    try:
        assert answers(path) == "gpu.drasil.dev"
    finally:
        server.stop(grace=None)


def test_stale_regular_file_is_removed_at_start(directory: Path) -> None:
    path = directory / "reg.sock"
    path.write_text("left over")
    server = UnixSocketServer(path, add_registration)
    server.start()
    try:
        assert is_socket(path)
        assert answers(path) == "gpu.drasil.dev"
    finally:
        server.stop(grace=None)


def test_ensure_recreates_a_deleted_socket(directory: Path) -> None:
    server = UnixSocketServer(directory / "reg.sock", add_registration)
    server.start()
    try:
        assert server.ensure() is False  # nothing to do
        assert server.restarts == 0

        server.path.unlink()  # what a kubelet restart or a node clean-up does
        assert server.ensure() is True
        assert server.restarts == 1
        assert is_socket(server.path)
        assert answers(server.path) == "gpu.drasil.dev"
        assert server.ensure() is False

        server.path.unlink()
        assert server.ensure() is True
        assert server.restarts == 2
        assert answers(server.path) == "gpu.drasil.dev"
    finally:
        server.stop(grace=None)
    assert not server.path.exists()


def test_ensure_before_start_does_nothing(directory: Path) -> None:
    server = UnixSocketServer(directory / "reg.sock", add_registration)
    assert server.ensure() is False
    assert not server.path.exists()


def test_stop_twice_is_harmless(directory: Path) -> None:
    server = UnixSocketServer(directory / "reg.sock", add_registration)
    server.start()
    server.stop(grace=None)
    server.stop(grace=None)
    assert not server.path.exists()


def path_of_length(directory: Path, length: int) -> Path:
    name = "s" * (length - len(os.fsencode(directory)) - 1)
    path = directory / name
    assert len(os.fsencode(path)) == length
    return path


def test_longest_allowed_path_really_serves(directory: Path) -> None:
    path = path_of_length(directory, MAX_PATH)
    server = UnixSocketServer(path, add_registration)
    server.start()
    try:
        assert answers(path) == "gpu.drasil.dev"
    finally:
        server.stop(grace=None)


def test_too_long_path_is_refused_with_a_clear_message(directory: Path) -> None:
    assert MAX_SOCKET_PATH <= 107  # sun_path is 108 bytes with the NUL
    path = path_of_length(directory, MAX_PATH + 1)
    with pytest.raises(SocketPathTooLong) as err:
        UnixSocketServer(path, add_registration)
    message = str(err.value)
    assert str(path) in message
    assert f"is {MAX_PATH + 1} bytes" in message
    assert f"at most {MAX_PATH}" in message
    assert "use a shorter directory" in message
    assert not path.exists()


def test_stop_leaves_a_file_that_another_instance_put_there(directory: Path) -> None:
    # Rolling update: the old instance stops after the new one took over the path.
    path = directory / "reg.sock"
    old = UnixSocketServer(path, add_registration)
    old.start()
    new = UnixSocketServer(path, add_registration)
    new.start()
    try:
        old.stop(grace=None)
        assert is_socket(path)
        assert answers(path) == "gpu.drasil.dev"
    finally:
        new.stop(grace=None)


class _SlowInfo(pb_grpc.RegistrationServicer):
    """Answers GetInfo once the test lets it (a prepare still in flight at stop)."""

    def __init__(self) -> None:
        self.called = threading.Event()
        self.release = threading.Event()

    def GetInfo(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.PluginInfo:
        self.called.set()
        self.release.wait(timeout=DEADLINE)
        return pb.PluginInfo(name="slow")


def test_a_drained_stop_lets_the_call_in_flight_finish(directory: Path) -> None:
    slow = _SlowInfo()
    server = UnixSocketServer(
        directory / "dra.sock", lambda s: pb_grpc.add_RegistrationServicer_to_server(slow, s)
    )
    server.start()
    answered: list[str] = []
    call = threading.Thread(target=lambda: answered.append(answers(server.path)))
    call.start()
    assert slow.called.wait(timeout=DEADLINE)
    stopping = threading.Thread(target=_Drained(server, grace=DEADLINE).stop)
    stopping.start()  # refuses new calls, waits for this one
    slow.release.set()
    call.join(timeout=DEADLINE)
    stopping.join(timeout=DEADLINE)
    assert answered == ["slow"]
    assert not server.path.exists()

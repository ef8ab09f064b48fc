"""A kubelet-like test client for device-plugin mode, and the checks that it acts like one.

``FakeKubelet`` serves ``v1beta1.Registration`` on a real ``kubelet.sock`` in a temp
``device-plugins/`` directory, validates each Register call the way kubelet does
(version, relative endpoint that exists in the directory, resource name) and records
it. Tests then dial the registered endpoint exactly as kubelet does and call the
DevicePlugin service over the socket. ``running_node`` starts a real
``DevicePluginServer`` (in-process, simulated GPUs) against it.

The other ``test_deviceplugin_*`` modules import from here (pytest puts this folder
on ``sys.path``).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubelet_client import DEADLINE, wait_until

from drasil.api.kubelet.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from drasil.api.kubelet.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc
from drasil.driver.health import FAULT_FILE, write_faults
from drasil.kubeletplugin.deviceplugin.plugin import DevicePluginIntervals, DevicePluginServer
from drasil.kubeletplugin.options import PluginOptions, parse_options
from drasil.kubeletplugin.sockets import UnixSocketServer
from drasil.kubeletplugin.vendors.registry import open_vendors

NODE = "n1"
GPU = "drasil.dev/gpu"
PROFILE = "h100-80gb:8"
# Test periods: short so that polls end fast; nothing asserts on them.
FAST = DevicePluginIntervals(
    socket_check=0.05,
    fault_poll=0.05,
    register_timeout=DEADLINE,
    register_retry=0.05,
    stream_wake=0.05,
)

Predicate = Callable[[pb.ListAndWatchResponse], bool]


class FakeKubelet(pb_grpc.RegistrationServicer):
    """kubelet's Registration service on ``<directory>/kubelet.sock``; records Register."""

    def __init__(self, directory: Path, *, refuse: int = 0) -> None:
        self.directory = directory
        self.requests: list[pb.RegisterRequest] = []
        self._refuse = refuse  # refuse this many valid calls first, as a busy kubelet might
        self._lock = threading.Lock()
        self.server = UnixSocketServer(directory / "kubelet.sock", self._add)

    def _add(self, server: grpc.Server) -> None:
        pb_grpc.add_RegistrationServicer_to_server(self, server)

    def start(self) -> FakeKubelet:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=None)

    def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:
        problem = self._invalid(request)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        with self._lock:
            if self._refuse > 0:
                self._refuse -= 1
                context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet is busy")
            self.requests.append(request)
        return pb.Empty()

    def _invalid(self, request: pb.RegisterRequest) -> str:
        # kubelet's checks (pkg/kubelet/cm/devicemanager): version, resource name,
        # and an endpoint it can dial relative to its own directory.
        if request.version != "v1beta1":
            return f"unsupported version {request.version!r}"
        if "/" not in request.resource_name:
            return f"invalid resource name {request.resource_name!r}"
        if "/" in request.endpoint or not (self.directory / request.endpoint).is_socket():
            return f"endpoint {request.endpoint!r} is not a socket in {self.directory}"
        return ""

    def registrations(self, resource: str = GPU) -> list[pb.RegisterRequest]:
        with self._lock:
            return [r for r in self.requests if r.resource_name == resource]

    def wait_for_registrations(self, count: int, resource: str = GPU) -> pb.RegisterRequest:
        """The latest Register of ``resource`` once there have been ``count`` of them."""
        wait_until(
            lambda: len(self.registrations(resource)) >= count,
            what=f"{count} registration(s) of {resource}",
        )
        return self.registrations(resource)[-1]

    @contextmanager
    def dial(self, resource: str = GPU) -> Iterator[pb_grpc.DevicePluginStub]:
        """A stub on the endpoint ``resource`` registered last, dialled as kubelet does."""
        endpoint = self.wait_for_registrations(1, resource).endpoint
        with grpc.insecure_channel(f"unix://{self.directory / endpoint}") as channel:
            yield pb_grpc.DevicePluginStub(channel)


@dataclass
class Node:
    """A temp node: kubelet's directory, the plugin's state and CDI dirs, and both sides."""

    root: Path
    opts: PluginOptions
    kubelet: FakeKubelet
    plugin: DevicePluginServer

    def inject_fault(self, faults: dict[str, str]) -> None:
        """What ``drasil fault inject`` does: replace the simulated fault file."""
        write_faults(self.opts.state_dir / FAULT_FILE, faults)


def node_flags(root: Path, *flags: str, profile: str = PROFILE) -> list[str]:
    """A device-plugin node under ``root``, no HTTP and no API server (none is needed)."""
    return [
        "--mode=device-plugin",
        f"--node-name={NODE}",
        "--backend=simulated",
        f"--simulated-profile={profile}",
        f"--device-plugins-dir={root / 'dp'}",
        f"--plugins-dir={root / 'plugins'}",
        f"--cdi-root={root / 'cdi'}",
        "--metrics-addr=0",
        "--health-addr=0",
        *flags,
    ]


def node_options(root: Path, *flags: str, profile: str = PROFILE) -> PluginOptions:
    return parse_options(node_flags(root, *flags, profile=profile), {})


@contextmanager
def short_root() -> Iterator[Path]:
    # grpc refuses unix socket paths over ~105 bytes; pytest's tmp_path can be longer.
    root = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def running_node(
    *flags: str, profile: str = PROFILE, kubelet_first: bool = True, refuse: int = 0
) -> Iterator[Node]:
    """A started plugin registered (or registering) with a fake kubelet; stops both."""
    with short_root() as root:
        opts = node_options(root, *flags, profile=profile)
        kubelet = FakeKubelet(opts.device_plugins_dir, refuse=refuse)
        if kubelet_first:
            kubelet.start()
        plugin = DevicePluginServer(opts, vendors=open_vendors(opts)[1], intervals=FAST)
        plugin.start()
        try:
            yield Node(root=root, opts=opts, kubelet=kubelet, plugin=plugin)
        finally:
            plugin.stop()
            kubelet.stop()


def stream_until(
    stub: pb_grpc.DevicePluginStub, predicate: Predicate, *, what: str
) -> pb.ListAndWatchResponse:
    """Read ListAndWatch until a response satisfies ``predicate`` (within DEADLINE)."""
    responses = stub.ListAndWatch(pb.Empty(), timeout=DEADLINE)
    try:
        for response in responses:
            if predicate(response):
                return response
    except grpc.RpcError as err:
        raise AssertionError(f"ListAndWatch ended before {what}: {err}") from err
    finally:
        responses.cancel()
    raise AssertionError(f"ListAndWatch ended before {what}")


def health_of(response: pb.ListAndWatchResponse) -> dict[str, str]:
    return {d.ID: d.health for d in response.devices}


def allocate(stub: pb_grpc.DevicePluginStub, *ids: str) -> pb.ContainerAllocateResponse:
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
    (response,) = stub.Allocate(request, timeout=DEADLINE).container_responses
    return response


def preferred_ids(
    stub: pb_grpc.DevicePluginStub,
    *,
    available: Sequence[str],
    must_include: Sequence[str] = (),
    size: int,
) -> list[str]:
    request = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available,
                must_include_deviceIDs=must_include,
                allocation_size=size,
            )
        ]
    )
    (response,) = stub.GetPreferredAllocation(request, timeout=DEADLINE).container_responses
    return list(response.deviceIDs)


# ---- the fake behaves like kubelet -----------------------------------------------------------


def test_fake_kubelet_refuses_what_kubelet_refuses() -> None:
    with short_root() as root:
        kubelet = FakeKubelet(root).start()
        try:
            with grpc.insecure_channel(f"unix://{kubelet.server.path}") as channel:
                stub = pb_grpc.RegistrationStub(channel)
                bad = [
                    pb.RegisterRequest(version="v1alpha", endpoint="x.sock", resource_name=GPU),
                    pb.RegisterRequest(version="v1beta1", endpoint="x.sock", resource_name="gpu"),
                    pb.RegisterRequest(version="v1beta1", endpoint="none.sock", resource_name=GPU),
                ]
                for request in bad:
                    with pytest.raises(grpc.RpcError) as err:
                        stub.Register(request, timeout=DEADLINE)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            kubelet.stop()
        assert kubelet.requests == []

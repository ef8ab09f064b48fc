"""Device-plugin mode: the node's GPUs through kubelet's classic device-plugin API.

For clusters (or nodes) without DRA, ``drasil-kubelet-plugin --mode device-plugin``
serves ``v1beta1.DevicePlugin`` for each extended resource (``drasil.dev/gpu``, and
``drasil.dev/mig-<profile>`` with ``--mig-strategy mixed``; ``amd.com/gpu`` for AMD
GPUs and partitions) on a socket in kubelet's
``device-plugins/`` directory and registers it on ``kubelet.sock``. Discovery,
health (XID events, the simulated fault file), HTTP and stopping are those of DRA
mode (``kubeletplugin.node``); what differs is in ``deviceplugin.resources`` (what is
advertised), ``deviceplugin.allocation`` (what a container gets) and
``deviceplugin.service``.

kubelet forgets every plugin when it restarts and deletes the sockets in the
directory. A watch loop checks every ``socket_check`` seconds whether a socket is gone
(it serves it again) or ``kubelet.sock`` is a new file, and registers again when either
changed since the last successful registration. The health tracker lives as long as
the process, so a device that was unhealthy is still unhealthy on the new stream.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc

from drasil.api.kubelet import names
from drasil.api.kubelet.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from drasil.api.kubelet.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc
from drasil.driver.cdi.staticspec import write_device_specs
from drasil.kubeletplugin.deviceplugin.resources import Resource, plan_resources, socket_name
from drasil.kubeletplugin.deviceplugin.service import OPTIONS, DevicePluginService
from drasil.kubeletplugin.metrics import DevicePluginMetrics
from drasil.kubeletplugin.node import NodeRuntime
from drasil.kubeletplugin.options import PluginOptions
from drasil.kubeletplugin.sockets import UnixSocketServer
from drasil.kubeletplugin.vendors.seam import NodeVendor

log = logging.getLogger(__name__)

KUBELET_SOCKET: Final = "kubelet.sock"


@dataclass
class DevicePluginIntervals:
    """Loop periods and timeouts; tests shorten them."""

    socket_check: float = 0.2  # kubelet restarts are noticed well within a second
    fault_poll: float = 0.25
    register_timeout: float = 5.0
    register_retry: float = 1.0  # after kubelet refused: it may be busy, or refuse forever
    stream_wake: float = 0.5


def _file_identity(path: Path) -> tuple[int, int] | None:
    # The inode alone is not enough: a file system hands a freed inode number to the
    # next new file, so a re-created kubelet.sock often has its predecessor's.
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_ctime_ns)


def _rpc_error(err: grpc.RpcError) -> str:
    if isinstance(err, grpc.Call):  # what the sync stubs raise: it carries the status
        return f"{err.code().name}: {err.details()}"
    return str(err)


class ResourceEndpoint:
    """One resource's socket in ``device-plugins/`` and its registration with kubelet."""

    def __init__(
        self,
        service: DevicePluginService,
        *,
        directory: Path,
        socket: str,
        register_timeout: float = 5.0,
        register_retry: float = 1.0,
        on_register: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.service = service
        self.resource_name = service.resource.name
        self.kubelet_socket = directory / KUBELET_SOCKET
        self.server = UnixSocketServer(directory / socket, self._add_servicer)
        self._register_timeout = register_timeout
        self._register_retry = register_retry
        self._on_register = on_register
        self._lock = threading.Lock()  # the watch loop and callers of sync()
        self._retry_at = 0.0
        # (our server's restart count, kubelet.sock's identity) at the last successful
        # Register: a new socket on either side means kubelet no longer knows us.
        self._registered_for: tuple[int, tuple[int, int]] | None = None
        self.registrations = 0
        self.last_error = ""

    def _add_servicer(self, server: grpc.Server) -> None:
        pb_grpc.add_DevicePluginServicer_to_server(self.service, server)

    @property
    def registered(self) -> bool:
        return self._registered_for is not None

    def start(self) -> None:
        # Serve first: kubelet dials the endpoint as soon as Register returns.
        self.server.start()
        self.sync()

    def sync(self) -> bool:
        """Re-serve a deleted socket and (re-)register when needed; True if it registered."""
        with self._lock:
            self.server.ensure()
            kubelet = _file_identity(self.kubelet_socket)
            if kubelet is None:
                # kubelet is down or restarting: whatever comes back will not know us.
                self._registered_for = None
                self._retry_at = 0.0
                return False
            target = (self.server.restarts, kubelet)
            if self._registered_for == target or time.monotonic() < self._retry_at:
                return False
            if not self._register():
                self._retry_at = time.monotonic() + self._register_retry
                return False
            self._registered_for = target
            return True

    def _register(self) -> bool:
        request = pb.RegisterRequest(
            version=names.DEVICE_PLUGIN_API_VERSION,
            endpoint=self.server.path.name,  # relative: kubelet joins it to its directory
            resource_name=self.resource_name,
            options=OPTIONS,
        )
        try:
            with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
                pb_grpc.RegistrationStub(channel).Register(request, timeout=self._register_timeout)
        except grpc.RpcError as err:
            self._failed(_rpc_error(err))
            return False
        self.registrations += 1
        self.last_error = ""
        log.info(
            "registered with kubelet",
            extra={"resource": self.resource_name, "endpoint": self.server.path.name},
        )
        self._notify(ok=True)
        return True

    def _failed(self, error: str) -> None:
        # Retried every tick while kubelet is away: log each new error once only.
        if error != self.last_error:
            log.warning(
                "kubelet registration failed; retrying",
                extra={"resource": self.resource_name, "error": error},
            )
        self.last_error = error
        self._notify(ok=False)

    def _notify(self, *, ok: bool) -> None:
        if self._on_register is not None:
            self._on_register(self.resource_name, ok)

    def stop(self) -> None:
        self.server.stop(grace=None)
        self._registered_for = None


class DevicePluginServer:
    """The node daemon in device-plugin mode: resources, CDI, their sockets, the watch loop.

    Discovery, health, HTTP and threads come from ``kubeletplugin.node``.
    """

    def __init__(
        self,
        opts: PluginOptions,
        *,
        vendors: Sequence[NodeVendor],
        intervals: DevicePluginIntervals | None = None,
        metrics: DevicePluginMetrics | None = None,
    ) -> None:
        self.opts = opts
        self.intervals = intervals or DevicePluginIntervals()
        self.metrics = metrics or DevicePluginMetrics()
        self.node = NodeRuntime(opts, vendors=vendors, devices_gauge=self.metrics.devices)
        self.endpoints: list[ResourceEndpoint] = []

    @property
    def sockets(self) -> list[Path]:
        return [e.server.path for e in self.endpoints]

    # ---- start -------------------------------------------------------------------------

    def start(self) -> None:
        """Raises ``DevicePluginConfigError`` for settings the devices cannot be served with."""
        devices = self.node.discover()
        resources = plan_resources(
            devices,
            resource_name=self.opts.resource_name,
            mig_strategy=self.opts.mig_strategy,
            replicas=self.opts.time_slicing_replicas,
            amd_resource_name=self.opts.amd_resource_name,
        )
        self.node.readiness()
        # The vendor's edits as Allocate needs them (NVIDIA's without the "void" of
        # NVIDIA_VISIBLE_DEVICES, which would override Allocate's env). They are
        # spec-wide in NVIDIA's spec only: AMD devices are in a spec of their own,
        # which no spec-wide edit reaches (staticspec).
        edits = self.node.common_edits(device_plugin=True)
        write_device_specs(
            devices,
            cdi_root=self.opts.cdi_root,
            driver=self.opts.driver_name,
            nvidia_common=edits[1].current() if edits is not None else None,
        )
        self.health = self.node.watch_health(devices, fault_poll=self.intervals.fault_poll)
        self._start_endpoints(resources)
        self.node.thread("device-plugin-sockets", self._watch)
        self.node.serve_http(registry=self.metrics.registry, check=self.check_health)

    def _start_endpoints(self, resources: Sequence[Resource]) -> None:
        for resource in resources:
            service = DevicePluginService(
                resource,
                driver=self.opts.driver_name,
                health=self.health,
                stop=self.node.stop_event,
                wake=self.intervals.stream_wake,
                on_allocate=self.metrics.allocated,
            )
            self.endpoints.append(self._endpoint(service))
        for endpoint in self.endpoints:
            endpoint.start()

    def _endpoint(self, service: DevicePluginService) -> ResourceEndpoint:
        def on_register(resource: str, ok: bool) -> None:
            self.metrics.registrations.labels(resource, "success" if ok else "error").inc()

        return ResourceEndpoint(
            service,
            directory=self.opts.device_plugins_dir,
            socket=socket_name(
                service.resource.name, pod_uid=self.opts.pod_uid, vendor=service.resource.vendor
            ),
            register_timeout=self.intervals.register_timeout,
            register_retry=self.intervals.register_retry,
            on_register=on_register,
        )

    def _watch(self, stop: threading.Event) -> None:
        while not stop.wait(self.intervals.socket_check):
            for endpoint in self.endpoints:
                try:
                    endpoint.sync()
                except Exception as err:  # e.g. the directory vanished; the next tick retries
                    log.error(
                        "device-plugin socket check failed",
                        extra={"resource": endpoint.resource_name, "error": str(err)},
                    )

    # ---- health and stop ---------------------------------------------------------------

    def check_health(self) -> tuple[bool, str]:
        """Every resource socket answers, and says whether kubelet has it registered."""
        for endpoint in self.endpoints:
            try:
                with grpc.insecure_channel(f"unix://{endpoint.server.path}") as channel:
                    pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(pb.Empty(), timeout=2)
            except grpc.RpcError as err:
                return False, f"{endpoint.server.path} does not answer: {err}"
        waiting = [e.resource_name for e in self.endpoints if not e.registered]
        detail = f"not yet registered: {', '.join(waiting)}" if waiting else "registered"
        return True, f"ok ({detail})"

    def stop(self) -> None:
        """Stop serving and remove the sockets; safe to call more than once."""
        self.node.stop(self.endpoints)

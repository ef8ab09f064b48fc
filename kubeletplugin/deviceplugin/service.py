"""The ``v1beta1.DevicePlugin`` service for one extended resource.

kubelet keeps one ListAndWatch stream open per registered resource and treats each
response as the complete device list, so a response goes out when the stream opens
and whenever the list (health included) differs from the last one sent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, Final, NoReturn

import grpc

from drasil.api.kubelet import names
from drasil.api.kubelet.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from drasil.api.kubelet.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc
from drasil.driver.health import HealthTracker
from drasil.kubeletplugin.deviceplugin.allocation import (
    UnknownDeviceIds,
    container_response,
    preferred,
    resolve,
)
from drasil.kubeletplugin.deviceplugin.resources import Resource

log = logging.getLogger(__name__)

# PreStartContainer has nothing to do: CDI and env carry everything, so kubelet need
# not wait for it on every container start.
OPTIONS: Final = pb.DevicePluginOptions(
    pre_start_required=False, get_preferred_allocation_available=True
)

OnAllocate = Callable[[str, bool], None]
"""Called with (resource name, succeeded) after each Allocate."""


class DevicePluginService(pb_grpc.DevicePluginServicer):
    """Serves one resource's devices; health comes from the shared tracker."""

    def __init__(
        self,
        resource: Resource,
        *,
        driver: str,
        health: HealthTracker,
        stop: threading.Event,
        wake: float = 0.5,
        on_allocate: OnAllocate | None = None,
    ) -> None:
        self.resource = resource
        self._driver = driver
        self._health = health
        self._stop = stop
        self._wake = wake  # how soon a stream notices a stop or a cancelled call
        self._on_allocate = on_allocate

    def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        return OPTIONS

    def ListAndWatch(self, request: pb.Empty, context: Any) -> Iterator[pb.ListAndWatchResponse]:
        last: pb.ListAndWatchResponse | None = None
        while not self._stop.is_set() and context.is_active():
            seen = self._health.version  # read before the snapshot: no change is missed
            response = self.device_list()
            if response != last:
                last = response
                yield response
            self._health.wait_for_change(seen, timeout=self._wake)

    def device_list(self) -> pb.ListAndWatchResponse:
        """Every advertised ID with its device's health and NUMA node."""
        health = self._health.snapshot()
        devices = []
        for unit in self.resource.units:
            state = health.get(unit.device.name)
            healthy = state is None or state.healthy
            numa = unit.device.numa_node
            devices.append(
                pb.Device(
                    ID=unit.id,
                    health=names.HEALTHY if healthy else names.UNHEALTHY,
                    topology=None
                    if numa is None
                    else pb.TopologyInfo(nodes=[pb.NUMANode(ID=numa)]),
                )
            )
        return pb.ListAndWatchResponse(devices=devices)

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Any
    ) -> pb.PreferredAllocationResponse:
        responses = []
        for creq in request.container_requests:
            try:
                available = resolve(self.resource, creq.available_deviceIDs)
                must = resolve(self.resource, creq.must_include_deviceIDs)
            except UnknownDeviceIds as err:
                _invalid(context, err)
            units = preferred(available, must_include=must, size=creq.allocation_size)
            responses.append(
                pb.ContainerPreferredAllocationResponse(deviceIDs=[u.id for u in units])
            )
        return pb.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        responses = []
        for creq in request.container_requests:
            try:
                units = resolve(self.resource, creq.devices_ids)
            except UnknownDeviceIds as err:
                self._allocated(ok=False)
                _invalid(context, err)
            responses.append(container_response(units, driver=self._driver))
        self._allocated(ok=True)
        return pb.AllocateResponse(container_responses=responses)

    def _allocated(self, *, ok: bool) -> None:
        if self._on_allocate is not None:
            self._on_allocate(self.resource.name, ok)

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: Any
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


def _invalid(context: grpc.ServicerContext, err: UnknownDeviceIds) -> NoReturn:
    # kubelet shows the status message in the Pod's admission error: name the IDs.
    log.error("request for unknown device IDs", extra={"resource": err.resource, "ids": err.ids})
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

"""DRAResourceHealth (v1 and v1alpha1): device health streamed to kubelet.

Each response is the complete list (docs/design.md#kubelet-grpc-apis). We send one when a watch
starts, on every change, and again every ``resend`` seconds so kubelet never lets a
healthy device time out into Unknown.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from drasil.api.kubelet.health.v1 import health_pb2 as v1
from drasil.api.kubelet.health.v1 import health_pb2_grpc as v1_grpc
from drasil.api.kubelet.health.v1alpha1 import health_pb2 as v1alpha1
from drasil.api.kubelet.health.v1alpha1 import health_pb2_grpc as v1alpha1_grpc
from drasil.driver.health import HealthTracker

MAX_MESSAGE = 1024  # kubelet's limit on DeviceHealth.message
WAIT_SLICE = 0.25


class HealthStreams:
    """Builds the responses for any number of concurrent watches."""

    def __init__(
        self, tracker: HealthTracker, *, pool: str, stop: threading.Event, resend: float = 30.0
    ) -> None:
        self.tracker = tracker
        self.pool = pool
        self.stop = stop
        self.resend = resend

    def timeout_seconds(self) -> int:
        # Twice the resend period: one lost response does not flip devices to Unknown.
        return int(self.resend * 2)

    def responses(self, pb: ModuleType, context: Any) -> Iterator[Any]:
        while self._open(context):
            seen = self.tracker.version
            yield self._response(pb)
            self._wait(seen, context)

    def _open(self, context: Any) -> bool:
        return not self.stop.is_set() and bool(context.is_active())

    def _wait(self, seen: int, context: Any) -> None:
        """Until a change or the resend time; short slices notice a stop or a hang-up
        quickly, so the process exits within its grace period."""
        deadline = time.monotonic() + self.resend
        while self._open(context) and time.monotonic() < deadline:
            if self.tracker.wait_for_change(seen, timeout=WAIT_SLICE) != seen:
                return

    def _response(self, pb: ModuleType) -> Any:
        now = int(time.time())
        devices = [
            pb.DeviceHealth(
                device=pb.DeviceIdentifier(pool_name=self.pool, device_name=name),
                health=pb.HEALTHY if health.healthy else pb.UNHEALTHY,
                last_updated_time=now,
                health_check_timeout_seconds=self.timeout_seconds(),
                message=health.message[:MAX_MESSAGE],
            )
            for name, health in sorted(self.tracker.snapshot().items())
        ]
        return pb.NodeWatchResourcesResponse(devices=devices)


class HealthV1(v1_grpc.DRAResourceHealthServicer):
    def __init__(self, streams: HealthStreams) -> None:
        self._streams = streams

    def NodeWatchResources(
        self, request: v1.NodeWatchResourcesRequest, context: Any
    ) -> Iterator[v1.NodeWatchResourcesResponse]:
        return self._streams.responses(v1, context)


class HealthV1alpha1(v1alpha1_grpc.DRAResourceHealthServicer):
    def __init__(self, streams: HealthStreams) -> None:
        self._streams = streams

    def NodeWatchResources(
        self, request: v1alpha1.NodeWatchResourcesRequest, context: Any
    ) -> Iterator[v1alpha1.NodeWatchResourcesResponse]:
        return self._streams.responses(v1alpha1, context)

"""The DRAPlugin gRPC service (v1 and v1beta1) kubelet calls over ``dra.sock``."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from drasil.api.checkpoint import PreparedDevice
from drasil.api.kubelet.dra.v1 import dra_pb2 as v1
from drasil.api.kubelet.dra.v1 import dra_pb2_grpc as v1_grpc
from drasil.api.kubelet.dra.v1beta1 import dra_pb2 as v1beta1
from drasil.api.kubelet.dra.v1beta1 import dra_pb2_grpc as v1beta1_grpc
from drasil.kubeletplugin.dra.prepare import ClaimRef, Preparer, PrepareResult
from drasil.kubeletplugin.metrics import PluginMetrics

T = TypeVar("T")
Claim = v1.Claim | v1beta1.Claim


class ClaimWork:
    """Runs one call's claims in parallel: kubelet batches all claims of a Pod."""

    def __init__(self, preparer: Preparer, metrics: PluginMetrics, *, workers: int = 16) -> None:
        self.preparer = preparer
        self.metrics = metrics
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="claim")

    def _each(self, claims: Sequence[Claim], fn: Callable[[ClaimRef], T]) -> dict[str, T]:
        refs = [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]
        if len(refs) == 1:  # the common case: no thread hop on the latency path
            return {refs[0].uid: fn(refs[0])}
        return dict(zip((r.uid for r in refs), self._pool.map(fn, refs), strict=True))

    def prepare(self, claims: Sequence[Claim]) -> dict[str, PrepareResult]:
        return self._each(claims, self._timed_prepare)

    def unprepare(self, claims: Sequence[Claim]) -> dict[str, str]:
        return self._each(claims, self._timed_unprepare)

    def _timed_prepare(self, ref: ClaimRef) -> PrepareResult:
        start = time.perf_counter()
        result = self.preparer.prepare(ref)
        self.metrics.observe(
            "prepare", seconds=time.perf_counter() - start, error=bool(result.error)
        )
        return result

    def _timed_unprepare(self, ref: ClaimRef) -> str:
        start = time.perf_counter()
        error = self.preparer.unprepare(ref)
        self.metrics.observe("unprepare", seconds=time.perf_counter() - start, error=bool(error))
        return error


def _v1_device(d: PreparedDevice) -> v1.Device:
    device = v1.Device(
        request_names=list(d.request_names),
        pool_name=d.pool_name,
        device_name=d.device_name,
        cdi_device_ids=list(d.cdi_device_ids),
    )
    if d.share_id is not None:
        device.share_id = d.share_id
    return device


def _v1beta1_device(d: PreparedDevice) -> v1beta1.Device:
    return v1beta1.Device(
        request_names=list(d.request_names),
        pool_name=d.pool_name,
        device_name=d.device_name,
        cdi_device_ids=list(d.cdi_device_ids),
    )


class DRAPluginV1(v1_grpc.DRAPluginServicer):
    def __init__(self, work: ClaimWork) -> None:
        self._work = work

    def NodePrepareResources(
        self, request: v1.NodePrepareResourcesRequest, context: Any
    ) -> v1.NodePrepareResourcesResponse:
        response = v1.NodePrepareResourcesResponse()
        for uid, result in self._work.prepare(request.claims).items():
            entry = response.claims[uid]
            entry.error = result.error
            entry.devices.extend(_v1_device(d) for d in result.devices)
        return response

    def NodeUnprepareResources(
        self, request: v1.NodeUnprepareResourcesRequest, context: Any
    ) -> v1.NodeUnprepareResourcesResponse:
        response = v1.NodeUnprepareResourcesResponse()
        for uid, error in self._work.unprepare(request.claims).items():
            response.claims[uid].error = error
        return response


class DRAPluginV1beta1(v1beta1_grpc.DRAPluginServicer):
    def __init__(self, work: ClaimWork) -> None:
        self._work = work

    def NodePrepareResources(
        self, request: v1beta1.NodePrepareResourcesRequest, context: Any
    ) -> v1beta1.NodePrepareResourcesResponse:
        response = v1beta1.NodePrepareResourcesResponse()
        for uid, result in self._work.prepare(request.claims).items():
            entry = response.claims[uid]
            entry.error = result.error
            entry.devices.extend(_v1beta1_device(d) for d in result.devices)
        return response

    def NodeUnprepareResources(
        self, request: v1beta1.NodeUnprepareResourcesRequest, context: Any
    ) -> v1beta1.NodeUnprepareResourcesResponse:
        response = v1beta1.NodeUnprepareResourcesResponse()
        for uid, error in self._work.unprepare(request.claims).items():
            response.claims[uid].error = error
        return response

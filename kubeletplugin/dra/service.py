"""The DRAPlugin gRPC service kubelet calls over ``dra.sock``: v1, and v1beta1 over it.

v1beta1's messages are v1's with the same names and field numbers, less
``Device.share_id`` (field 5). So ``DRAPluginV1beta1`` converts each message through its
wire bytes and lets ``DRAPluginV1`` do the work: there is one servicer to keep right.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from google.protobuf.message import Message

from drasil.api.checkpoint import PreparedDevice
from drasil.api.kubelet.dra.v1 import dra_pb2 as v1
from drasil.api.kubelet.dra.v1 import dra_pb2_grpc as v1_grpc
from drasil.api.kubelet.dra.v1beta1 import dra_pb2 as v1beta1
from drasil.api.kubelet.dra.v1beta1 import dra_pb2_grpc as v1beta1_grpc
from drasil.driver.claims.plan import ClaimRef
from drasil.kubeletplugin.dra.prepare import Preparer, PrepareResult
from drasil.kubeletplugin.metrics import PluginMetrics

T = TypeVar("T")
M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)


class ClaimWork:
    """Runs one call's claims in parallel: kubelet batches all claims of a Pod."""

    def __init__(self, preparer: Preparer, metrics: PluginMetrics, *, workers: int = 16) -> None:
        self.preparer = preparer
        self.metrics = metrics
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="claim")

    def _each(self, claims: Sequence[v1.Claim], fn: Callable[[ClaimRef], T]) -> dict[str, T]:
        refs = [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]
        if len(refs) == 1:  # the common case: no thread hop on the latency path
            return {refs[0].uid: fn(refs[0])}
        return dict(zip((r.uid for r in refs), self._pool.map(fn, refs), strict=True))

    def prepare(self, claims: Sequence[v1.Claim]) -> dict[str, PrepareResult]:
        return self._each(claims, self._timed_prepare)

    def unprepare(self, claims: Sequence[v1.Claim]) -> dict[str, str]:
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


def _convert(message: Message, into: type[M]) -> M:
    """The same message in the other version; a v1-only field (share_id) is dropped.

    Parsing keeps a field the target does not know as an unknown field and would send
    it on; kubelet's v1beta1 must get exactly the v1beta1 message.
    """
    converted = into.FromString(message.SerializeToString())
    converted.DiscardUnknownFields()
    return converted


def _via_v1(call: Callable[[R, Any], Message], request: R, context: Any, *, answer: type[M]) -> M:
    """The v1 servicer's answer to ``request`` (already v1), as the v1beta1 ``answer``."""
    return _convert(call(request, context), answer)


class DRAPluginV1beta1(v1beta1_grpc.DRAPluginServicer):
    """v1beta1 for kubelets that do not speak v1 yet: an adapter over ``DRAPluginV1``."""

    def __init__(self, work: ClaimWork) -> None:
        self._v1 = DRAPluginV1(work)

    def NodePrepareResources(
        self, request: v1beta1.NodePrepareResourcesRequest, context: Any
    ) -> v1beta1.NodePrepareResourcesResponse:
        return _via_v1(
            self._v1.NodePrepareResources,
            _convert(request, v1.NodePrepareResourcesRequest),
            context,
            answer=v1beta1.NodePrepareResourcesResponse,
        )

    def NodeUnprepareResources(
        self, request: v1beta1.NodeUnprepareResourcesRequest, context: Any
    ) -> v1beta1.NodeUnprepareResourcesResponse:
        return _via_v1(
            self._v1.NodeUnprepareResources,
            _convert(request, v1.NodeUnprepareResourcesRequest),
            context,
            answer=v1beta1.NodeUnprepareResourcesResponse,
        )

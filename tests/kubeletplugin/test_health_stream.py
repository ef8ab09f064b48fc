"""DRAResourceHealth v1 and v1alpha1 as kubelet watches it, over a real socket."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import grpc
import pytest
from kubelet_client import DEADLINE, NODE, node_devices, serving

from drasil.api.kubelet.health.v1 import health_pb2 as v1
from drasil.api.kubelet.health.v1 import health_pb2_grpc as v1_grpc
from drasil.api.kubelet.health.v1alpha1 import health_pb2 as v1alpha1
from drasil.api.kubelet.health.v1alpha1 import health_pb2_grpc as v1alpha1_grpc
from drasil.driver.health import HealthTracker
from drasil.kubeletplugin.dra.healthservice import (
    MAX_MESSAGE,
    HealthStreams,
    HealthV1,
    HealthV1alpha1,
)

VERSIONS = [
    pytest.param((v1, v1_grpc), id="v1"),
    pytest.param((v1alpha1, v1alpha1_grpc), id="v1alpha1"),
]
DEVICES = ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]


@contextmanager
def health_server(
    tracker: HealthTracker, *, resend: float = 30.0
) -> Iterator[tuple[HealthStreams, grpc.Channel]]:
    stop = threading.Event()
    streams = HealthStreams(tracker, pool=NODE, stop=stop, resend=resend)

    def add(server: grpc.Server) -> None:
        v1_grpc.add_DRAResourceHealthServicer_to_server(HealthV1(streams), server)
        v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(HealthV1alpha1(streams), server)

    try:
        with serving(add) as (_, channel):
            yield streams, channel
    finally:
        stop.set()
        # A stream waits for the next change (or resend); give it one so it sees stop.
        tracker.report("test-teardown", {"gpu-0": "shutting down"})


def watch(channel: grpc.Channel, versions: tuple[ModuleType, ModuleType]) -> Any:
    pb, pb_grpc = versions
    stub = pb_grpc.DRAResourceHealthStub(channel)
    return stub.NodeWatchResources(pb.NodeWatchResourcesRequest(), timeout=DEADLINE * 3)


def by_name(response: Any) -> dict[str, Any]:
    names = [d.device.device_name for d in response.devices]
    assert names == sorted(names), "each response is the complete, ordered list"
    assert {d.device.pool_name for d in response.devices} == {NODE}
    return {d.device.device_name: d for d in response.devices}


def next_matching(call: Any, condition: Any) -> dict[str, Any]:
    """Read responses until one satisfies ``condition`` (the call's deadline bounds it)."""
    for response in call:
        devices = by_name(response)
        if condition(devices):
            return devices
    raise AssertionError("the stream ended")


@pytest.mark.parametrize("versions", VERSIONS)
def test_stream_reports_faults_and_recovery(versions: tuple[ModuleType, ModuleType]) -> None:
    pb = versions[0]
    tracker = HealthTracker(node_devices().values())
    with health_server(tracker) as (_, channel):
        call = watch(channel, versions)
        try:
            first = by_name(next(call))
            assert list(first) == DEVICES
            for health in first.values():
                assert health.health == pb.HEALTHY
                assert health.message == ""
                assert health.health_check_timeout_seconds == 60
                assert health.last_updated_time > 0

            tracker.report("faults", {"gpu-2": "injected by test"})
            devices = next_matching(call, lambda d: d["gpu-2"].health == pb.UNHEALTHY)
            assert list(devices) == DEVICES
            assert devices["gpu-2"].message == "faults: injected by test"
            assert all(devices[n].health == pb.HEALTHY for n in DEVICES if n != "gpu-2")

            tracker.report("faults", {})
            devices = next_matching(call, lambda d: d["gpu-2"].health == pb.HEALTHY)
            assert devices["gpu-2"].message == ""
            assert all(d.health == pb.HEALTHY for d in devices.values())
        finally:
            call.cancel()


def test_both_versions_watch_at_once() -> None:
    tracker = HealthTracker(node_devices().values())
    with health_server(tracker) as (_, channel):
        calls = [watch(channel, (v1, v1_grpc)), watch(channel, (v1alpha1, v1alpha1_grpc))]
        try:
            for call in calls:
                assert len(next(call).devices) == 4
            tracker.report("xid", {"gpu-1": "XID 79"})
            for call, pb in zip(calls, (v1, v1alpha1), strict=True):
                devices = next_matching(call, lambda d, pb=pb: d["gpu-1"].health == pb.UNHEALTHY)
                assert devices["gpu-1"].message == "xid: XID 79"
        finally:
            for call in calls:
                call.cancel()


def test_long_messages_are_cut_to_kubelets_limit() -> None:
    tracker = HealthTracker(node_devices().values())
    tracker.report("faults", {"gpu-3": "x" * 5000})
    with health_server(tracker) as (_, channel):
        call = watch(channel, (v1, v1_grpc))
        try:
            devices = by_name(next(call))
        finally:
            call.cancel()
    assert devices["gpu-3"].health == v1.UNHEALTHY
    assert len(devices["gpu-3"].message) == MAX_MESSAGE == 1024
    assert devices["gpu-3"].message.startswith("faults: xxx")


def test_full_list_is_resent_without_changes() -> None:
    tracker = HealthTracker(node_devices().values())
    with health_server(tracker, resend=1.0) as (streams, channel):
        assert streams.timeout_seconds() == 2
        call = watch(channel, (v1, v1_grpc))
        try:
            first = by_name(next(call))
            second = by_name(next(call))  # nothing changed: the periodic resend
        finally:
            call.cancel()
    assert list(second) == list(first) == DEVICES
    assert all(d.health_check_timeout_seconds == 2 for d in second.values())


def test_stop_ends_open_watches_without_waiting_for_a_change() -> None:
    # Otherwise SIGTERM waits up to the resend period for kubelet's open watch.
    ended = threading.Event()

    class Recording(HealthStreams):
        def responses(self, pb: ModuleType, context: Any) -> Iterator[Any]:
            try:
                yield from super().responses(pb, context)
            finally:
                ended.set()

    tracker = HealthTracker(node_devices().values())
    stop = threading.Event()
    streams = Recording(tracker, pool=NODE, stop=stop, resend=3600.0)

    def add(server: grpc.Server) -> None:
        v1_grpc.add_DRAResourceHealthServicer_to_server(HealthV1(streams), server)

    with serving(add) as (_server, channel):
        call = watch(channel, (v1, v1_grpc))
        next(call)
        stop.set()
    assert ended.wait(DEADLINE)

"""Plugin registration as kubelet's plugin watcher sees it, over a real socket."""

from __future__ import annotations

from contextlib import AbstractContextManager

import grpc
from kubelet_client import DEADLINE, serving

from drasil.api.kubelet.pluginregistration import registration_pb2 as pb
from drasil.api.kubelet.pluginregistration import registration_pb2_grpc as pb_grpc
from drasil.kubeletplugin.dra.registration import Registration
from drasil.kubeletplugin.sockets import UnixSocketServer

ENDPOINT = "/var/lib/kubelet/plugins/gpu.drasil.dev/dra.sock"


def serve(
    registration: Registration,
) -> AbstractContextManager[tuple[UnixSocketServer, grpc.Channel]]:
    def add(server: grpc.Server) -> None:
        pb_grpc.add_RegistrationServicer_to_server(registration, server)

    return serving(add, name="gpu.drasil.dev-reg.sock")


def test_get_info_describes_a_dra_plugin_with_health() -> None:
    registration = Registration(driver_name="gpu.drasil.dev", endpoint=ENDPOINT)
    with serve(registration) as (_, channel):
        info = pb_grpc.RegistrationStub(channel).GetInfo(pb.InfoRequest(), timeout=DEADLINE)
    assert info.type == "DRAPlugin"
    assert info.name == "gpu.drasil.dev"
    assert info.endpoint == ENDPOINT
    # kubelet picks the first entry it supports: the order is the preference.
    assert list(info.supported_versions) == [
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1.DRAResourceHealth",
        "v1alpha1.DRAResourceHealth",
    ]


def test_get_info_without_health_service() -> None:
    registration = Registration(driver_name="gpu.example.com", endpoint="/e", with_health=False)
    with serve(registration) as (_, channel):
        info = pb_grpc.RegistrationStub(channel).GetInfo(pb.InfoRequest(), timeout=DEADLINE)
    assert info.name == "gpu.example.com"
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]


def test_registration_status_is_recorded() -> None:
    registration = Registration(driver_name="gpu.drasil.dev", endpoint=ENDPOINT)
    assert not registration.registered.is_set()
    assert registration.last_error == ""
    with serve(registration) as (_, channel):
        stub = pb_grpc.RegistrationStub(channel)

        stub.NotifyRegistrationStatus(
            pb.RegistrationStatus(plugin_registered=False, error="version not supported"),
            timeout=DEADLINE,
        )
        assert not registration.registered.is_set()
        assert registration.last_error == "version not supported"

        reply = stub.NotifyRegistrationStatus(
            pb.RegistrationStatus(plugin_registered=True), timeout=DEADLINE
        )
        assert isinstance(reply, pb.RegistrationStatusResponse)
        assert registration.registered.is_set()
        assert registration.last_error == ""

        # kubelet may refuse a later attempt (it restarts from GetInfo after any failure).
        stub.NotifyRegistrationStatus(
            pb.RegistrationStatus(plugin_registered=False, error="socket gone"), timeout=DEADLINE
        )
        assert not registration.registered.is_set()
        assert registration.last_error == "socket gone"

"""kubelet plugin registration: the service kubelet's plugin watcher calls."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from drasil.api.kubelet import names
from drasil.api.kubelet.pluginregistration import registration_pb2 as pb
from drasil.api.kubelet.pluginregistration import registration_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class Registration(pb_grpc.RegistrationServicer):
    """Answers GetInfo and records what kubelet said about the registration.

    A failed registration needs no retry loop of ours: kubelet starts over from
    GetInfo as long as our socket stays, so we log it and keep serving.
    """

    def __init__(
        self,
        *,
        driver_name: str,
        endpoint: str,
        with_health: bool = True,
        on_registered: Callable[[], None] | None = None,
    ) -> None:
        self._on_registered = on_registered
        self._info = pb.PluginInfo(
            type=names.DRA_PLUGIN_TYPE,
            name=driver_name,
            endpoint=endpoint,
            supported_versions=list(
                names.SUPPORTED_VERSIONS if with_health else names.DRA_PLUGIN_VERSIONS
            ),
        )
        self.registered = threading.Event()
        self.last_error = ""

    def GetInfo(self, request: pb.InfoRequest, context: Any) -> pb.PluginInfo:
        return self._info

    def NotifyRegistrationStatus(
        self, request: pb.RegistrationStatus, context: Any
    ) -> pb.RegistrationStatusResponse:
        if request.plugin_registered:
            log.info("registered with kubelet", extra={"driver": self._info.name})
            self.last_error = ""
            self.registered.set()
            if self._on_registered is not None:
                self._on_registered()
        else:
            self.last_error = request.error
            self.registered.clear()
            log.error(
                "kubelet refused the registration; waiting for kubelet to retry",
                extra={"driver": self._info.name, "error": request.error},
            )
        return pb.RegistrationStatusResponse()

"""Entry point of ``drasil-kubelet-plugin``."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from drasil.driver.discovery.backends import open_backend
from drasil.driver.discovery.nvml import NvmlError, NvmlLibrary
from drasil.driver.discovery.simulated import ProfileSpecError
from drasil.driver.kubeapi import KubeApi, KubeconfigError, load_api_client
from drasil.driver.logs import setup_logging
from drasil.kubeletplugin.deviceplugin.plugin import DevicePluginServer
from drasil.kubeletplugin.deviceplugin.resources import DevicePluginConfigError
from drasil.kubeletplugin.dra.plugin import KubeletPlugin
from drasil.kubeletplugin.options import OptionsError, PluginOptions, parse_options

log = logging.getLogger("drasil.kubeletplugin")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        opts = parse_options(sys.argv[1:] if argv is None else argv)
    except OptionsError as err:
        print(f"drasil-kubelet-plugin: {err}", file=sys.stderr)
        return 2
    setup_logging(log_format=opts.log_format, verbosity=opts.verbosity)
    try:
        lib = open_backend(opts.backend, profile=opts.simulated_profile, node_name=opts.node_name)
        plugin = _start(opts, lib)
    except (NvmlError, ProfileSpecError, DevicePluginConfigError, OSError, KubeconfigError) as err:
        log.error("cannot start: %s", err)
        return 1
    stopped = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("stopping", extra={"signal": signal.Signals(signum).name})
        stopped.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info(
        "running",
        extra={
            "node": opts.node_name,
            "driver": opts.driver_name,
            "socket": ", ".join(str(s) for s in _sockets(plugin)),
        },
    )
    # Wake up now and then: the kernel may deliver SIGTERM to a gRPC thread, and
    # Python runs the handler only when the main thread next gets to run.
    while not stopped.wait(1.0):
        pass
    plugin.stop()
    return 0


def _start(opts: PluginOptions, lib: NvmlLibrary) -> KubeletPlugin | DevicePluginServer:
    # Device-plugin mode needs no API server: kubelet's socket is all it talks to.
    if opts.mode == "device-plugin":
        server = DevicePluginServer(opts, lib=lib)
        server.start()
        return server
    plugin = KubeletPlugin(opts, lib=lib, api=KubeApi(load_api_client(opts.kubeconfig)))
    plugin.start()
    return plugin


def _sockets(plugin: KubeletPlugin | DevicePluginServer) -> list[Path]:
    return plugin.sockets if isinstance(plugin, DevicePluginServer) else [plugin.dra_socket]


if __name__ == "__main__":
    sys.exit(main())

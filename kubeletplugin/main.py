"""Entry point of ``drasil-kubelet-plugin``."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from drasil.driver.backends import open_backend
from drasil.driver.kubeapi import KubeApi, load_api_client
from drasil.driver.logs import setup_logging
from drasil.driver.nvml import NvmlError
from drasil.driver.simulated import ProfileSpecError
from drasil.kubeletplugin.options import OptionsError, parse_options
from drasil.kubeletplugin.plugin import KubeletPlugin

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
        api = KubeApi(load_api_client(opts.kubeconfig))
        plugin = KubeletPlugin(opts, lib=lib, api=api)
        plugin.start()
    except (NvmlError, ProfileSpecError, OSError) as err:
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
            "socket": str(plugin.dra_socket),
        },
    )
    stopped.wait()
    plugin.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

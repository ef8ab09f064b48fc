"""Entry point of ``drasil-kubelet-plugin``: DRA mode, or device-plugin mode with ``--mode``."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace

from drasil.api.limits import allow_nesting
from drasil.driver.checkpoint import use_boot_id_file
from drasil.driver.devices import HardwareError, VendorError
from drasil.driver.kubeapi import KubeApi, KubeconfigError, load_api_client
from drasil.driver.logs import setup_logging
from drasil.kubeletplugin.deviceplugin.plugin import DevicePluginServer
from drasil.kubeletplugin.deviceplugin.resources import DevicePluginConfigError
from drasil.kubeletplugin.dra.plugin import KubeletPlugin
from drasil.kubeletplugin.node import NodeDaemon, signals_for_the_main_thread, stop_on_signals
from drasil.kubeletplugin.options import MIG_MODES, OptionsError, PluginOptions, parse_options
from drasil.kubeletplugin.vendors.registry import open_vendors

log = logging.getLogger("drasil.kubeletplugin")


# glibc's mallopt parameter for the number of malloc arenas.
_M_ARENA_MAX = -8
MALLOC_ARENAS = 2


def fewer_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas before any thread starts; returns whether it applied.

    glibc gives each thread that allocates concurrently its own arena (up to 8 per
    CPU), and each keeps the pages it once used: with gRPC's and our thread pools that
    is tens of MiB of RSS for nothing, since the GIL lets one thread allocate at a time.
    """
    name = ctypes.util.find_library("c")
    if name is None:  # not glibc (musl has no arenas to cap)
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    fewer_malloc_arenas()
    try:
        opts = parse_options(sys.argv[1:] if argv is None else argv)
    except OptionsError as err:
        print(f"drasil-kubelet-plugin: {err}", file=sys.stderr)
        return 2
    setup_logging(log_format=opts.log_format, verbosity=opts.verbosity)
    allow_nesting()  # objects users write may nest thousands of levels deep
    use_boot_id_file(opts.boot_id_file)
    try:
        # Every thread is started under the block (NVML's, gRPC's, ours), so SIGTERM
        # always reaches the main thread waiting below; a signal that came during the
        # start is delivered once the handlers are in place.
        with signals_for_the_main_thread():
            daemon = _start(opts)
            stopped = stop_on_signals()
    except (
        HardwareError,
        DevicePluginConfigError,
        OSError,
        KubeconfigError,
        VendorError,
    ) as err:
        log.error("cannot start: %s", err)
        return 1
    log.info(
        "running",
        extra={
            "node": opts.node_name,
            "driver": opts.driver_name,
            "socket": ", ".join(str(s) for s in daemon.sockets),
        },
    )
    stopped.wait()
    daemon.stop()
    return 0


MIG_MODE_LABEL = "drasil.dev/mig-mode"


def with_node_mig_mode(opts: PluginOptions, api: KubeApi) -> PluginOptions:
    """``--mig-mode``, overridden by the node's ``drasil.dev/mig-mode`` label if set.

    Read once at start: switching a node is drain, relabel, restart (docs/mig.md). A
    label with another value is logged and ignored rather than stopping the plugin.
    """
    try:
        labels = api.get_node_labels(opts.node_name) or {}
    except Exception as err:  # the API may be away; the flag still says what to do
        log.warning("could not read the node's labels", extra={"error": str(err)})
        return opts
    value = labels.get(MIG_MODE_LABEL)
    if value is None or value == opts.mig_mode:
        return opts
    if value not in MIG_MODES:
        log.error(
            "ignoring node label %s=%r; allowed values are %s", MIG_MODE_LABEL, value, MIG_MODES
        )
        return opts
    log.info("MIG mode from the node label", extra={"label": MIG_MODE_LABEL, "mode": value})
    return replace(opts, mig_mode=value)


def _start(opts: PluginOptions) -> NodeDaemon:
    # Device-plugin mode needs no API server: kubelet's socket is all it talks to.
    if opts.mode == "device-plugin":
        opts, vendors = open_vendors(opts)
        server = DevicePluginServer(opts, vendors=vendors)
        server.start()
        return server
    api = KubeApi(load_api_client(opts.kubeconfig))
    # The vendors are opened with the options they serve under (the node's MIG mode).
    opts, vendors = open_vendors(with_node_mig_mode(opts, api))
    plugin = KubeletPlugin(opts, api=api, vendors=vendors)
    plugin.start()
    return plugin


if __name__ == "__main__":
    sys.exit(main())

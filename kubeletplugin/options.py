"""Flags of ``drasil-kubelet-plugin``; a flag wins over its environment variable."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drasil.driver import flags
from drasil.driver.checkpoint import BOOT_ID_PATH
from drasil.driver.flags import option
from drasil.driver.hostresources import HostResourcesError, parse_host_resources
from drasil.driver.logs import LOG_FORMATS, LogFormat
from drasil.kubeletplugin.vendors.installed import installed

DEFAULT_DRIVER = "gpu.drasil.dev"
BACKENDS = ("nvml", "simulated")
# --amd-partition-mode: drasil.driver.amd.partitions.PARTITION_MODES (options import no vendor).
PARTITION_MODES = ("static", "dynamic")
MODES = ("dra", "device-plugin")
MIG_STRATEGIES = ("none", "single", "mixed")
MIG_MODES = ("static", "dynamic")
GPU_SHARING = ("exclusive", "consumable")
# DRA mode: the node's GPU labels under drasil.dev/ (drasil), also under GPU Feature
# Discovery's nvidia.com/ names (gfd), or none (off); kubeletplugin/dra/nodelabels.py.
NODE_LABELS = ("drasil", "gfd", "off")
# The extended resources of the vendors' own device plugins (NVIDIA's whole GPUs, its
# shared "gpu.shared", MIG devices of its mixed strategy; ROCm's): while the Node has
# one allocatable, DRA mode withholds that vendor's GPUs (kubeletplugin/dra/doublebooking.py).
DEVICE_PLUGIN_RESOURCES = (
    "nvidia.com/gpu",
    "nvidia.com/gpu.shared",
    "nvidia.com/mig-*",
    "amd.com/gpu",
)
# <domain>/<name>, the name possibly with shell wildcards (* ? [...]).
_RESOURCE_PATTERN = re.compile(
    r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9*?\[\]][-A-Za-z0-9_.*?\[\]]*"
)
CDI_HOOKS = ("enabled", "disabled")
VENDORS = ("nvidia", "amd")
AUTO_VENDORS = "auto"
# Where the image carries NVIDIA's nvidia-cdi-hook (Dockerfile), copied to the node
# when no --nvidia-cdi-hook-path is given.
BUNDLED_CDI_HOOK = "/opt/drasil/bin/nvidia-cdi-hook"
# What --mps-daemon-pod may set, in the Pod's spec and in its container.
MPS_DAEMON_POD_FIELDS = ("tolerations", "priorityClassName", "imagePullSecrets")
MPS_DAEMON_CONTAINER_FIELDS = ("imagePullPolicy", "resources")


# reStructuredText's inline literal, as docstrings write it: ``--mode``.
_LITERAL = re.compile(r"``([^`]+)``")


class OptionsError(ValueError):
    """A flag or environment variable with a value the plugin cannot run with."""


def _yes(text: str) -> bool:
    return text.lower() in ("1", "true", "yes")


def _path(text: str) -> Path:
    return Path(text)


def _path_or_none(text: str | None) -> Path | None:
    return Path(text) if text else None


def _or_none(text: str | None) -> str | None:
    return text or None


def _replicas(value: int) -> int:
    if value < 1:
        raise OptionsError(f"--time-slicing-replicas: {value} is less than 1")
    return value


def plain(text: str) -> str:
    """Text for a terminal: inline literals of a docstring lose their double backquotes."""
    return _LITERAL.sub(r"\1", text)


class _PlainHelpFormatter(argparse.HelpFormatter):
    """``--help`` shows descriptions and help texts without reStructuredText markup,
    so they can be written like (or taken from) the docstrings."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return plain(super()._expand_help(action))


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    return flags.parser(
        PluginOptions,
        env,
        error=OptionsError,
        prog="drasil-kubelet-plugin",
        formatter_class=_PlainHelpFormatter,
        description="drasil's node daemon: publishes this node's GPUs and prepares them "
        "for containers through kubelet's DRA plugin API.",
    )


def parse_options(argv: Sequence[str], env: Mapping[str, str] | None = None) -> PluginOptions:
    """Parse flags, falling back to the environment, and check what argparse cannot."""
    env = os.environ if env is None else env
    ns = _parser(env).parse_args(list(argv))
    if not ns.node_name:
        raise OptionsError("--node-name (or env NODE_NAME) is required")
    opts = flags.settings(PluginOptions, ns, env, error=OptionsError)
    if opts.mps_daemon_image and not opts.pod_namespace:
        raise OptionsError("--mps-daemon-image needs --pod-namespace (or env POD_NAMESPACE)")
    return opts


def _host_resources(text: str) -> dict[str, str]:
    try:
        return parse_host_resources(text)
    except HostResourcesError as err:
        raise OptionsError(str(err)) from None


def _resource_patterns(text: str) -> tuple[str, ...]:
    """``nvidia.com/gpu,nvidia.com/mig-*`` → a tuple; each must be <domain>/<name>."""
    patterns = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    for pattern in patterns:
        if len(pattern) > 253 or not _RESOURCE_PATTERN.fullmatch(pattern):
            raise OptionsError(
                f"--device-plugin-resources: {pattern!r} is no extended resource name "
                "<domain>/<name> (the name may hold * ? [...]), e.g. nvidia.com/mig-*"
            )
    return patterns


def _vendors(text: str) -> tuple[str, ...]:
    """``nvidia,amd`` → ``("nvidia", "amd")``; ``auto`` alone; nothing else."""
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    bad = [n for n in names if n not in (*VENDORS, AUTO_VENDORS)]
    if bad:  # a vendor another package installed (kubeletplugin.vendors.installed)
        bad = [n for n in bad if n not in installed(built_in=VENDORS)]
    if not names or bad or (AUTO_VENDORS in names and len(names) > 1):
        raise OptionsError(
            f"--vendors: {text!r} is not a comma-separated list of {', '.join(VENDORS)}, "
            f"nor {AUTO_VENDORS} alone"
        )
    return names


def _daemon_pod(text: str) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise OptionsError(f"--mps-daemon-pod: not JSON: {err}") from None
    if not isinstance(doc, dict):
        raise OptionsError(f"--mps-daemon-pod: {text!r} is not a JSON object")
    allowed = MPS_DAEMON_POD_FIELDS + MPS_DAEMON_CONTAINER_FIELDS
    unknown = sorted(set(doc) - set(allowed))
    if unknown:
        # The rest of the Pod (node, command, mounts, privileges) is the plugin's own.
        raise OptionsError(
            f"--mps-daemon-pod: unknown fields {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(allowed))}"
        )
    return doc


@dataclass(frozen=True)
class PluginOptions:
    """The plugin's settings, each declared once with its flag and environment
    variable (``drasil.driver.flags``), in the order ``--help`` lists them."""

    node_name: str = option("--node-name", env="NODE_NAME", help="env NODE_NAME; required")
    driver_name: str = option("--driver-name", env="DRIVER_NAME", default=DEFAULT_DRIVER)
    backend: str = option("--backend", env="BACKEND", default="nvml", choices=BACKENDS)
    simulated_profile: str = option(
        "--simulated-profile",
        env="SIMULATED_PROFILE",
        default="h100-80gb:8",
        help="GPUs of the simulated backend, e.g. h100-80gb:8 or a100-40gb-mig:2,l4:1",
    )
    kubeconfig: str | None = option("--kubeconfig", env="KUBECONFIG", help="in-cluster if absent")
    registrar_dir: Path = option(
        "--registrar-dir", default="/var/lib/kubelet/plugins_registry", convert=_path
    )
    plugins_dir: Path = option("--plugins-dir", default="/var/lib/kubelet/plugins", convert=_path)
    cdi_root: Path = option("--cdi-root", default="/var/run/cdi", convert=_path)
    pod_uid: str | None = option("--pod-uid", env="POD_UID", help="env POD_UID")
    metrics_addr: str = option(
        "--metrics-addr",
        env="METRICS_ADDR",
        default=":9400",
        convert=flags.address("--metrics-addr"),
    )
    health_addr: str = option(
        "--health-addr",
        env="HEALTH_ADDR",
        default=":9401",
        convert=flags.address("--health-addr"),
    )
    log_format: LogFormat = option(
        "--log-format", env="LOG_FORMAT", default="text", choices=LOG_FORMATS
    )
    verbosity: int = option("--v", short="-v", dest="verbosity", env="V", default="0", kind=int)
    mode: str = option("--mode", env="MODE", default="dra", choices=MODES)
    # Device-plugin mode only (docs/device-plugin.md).
    device_plugins_dir: Path = option(
        "--device-plugins-dir", default="/var/lib/kubelet/device-plugins", convert=_path
    )
    resource_name: str = option(
        "--resource-name",
        env="RESOURCE_NAME",
        default="drasil.dev/gpu",
        help="extended resource of device-plugin mode; match the DeviceClass's "
        "extendedResourceName",
    )
    time_slicing_replicas: int = option(
        "--time-slicing-replicas",
        env="TIME_SLICING_REPLICAS",
        # A bad number in the env is an OptionsError naming it (drasil.driver.flags).
        default="1",
        kind=int,
        convert=_replicas,
        help="device-plugin mode: advertise each device N times (<id>::<n>)",
    )
    mig_strategy: str = option(
        "--mig-strategy",
        env="MIG_STRATEGY",
        default="none",
        choices=MIG_STRATEGIES,
        help="device-plugin mode: none (full GPUs), single or mixed (mig-<profile>)",
    )
    # DRA mode: publish existing MIG devices (static) or cut them on demand (dynamic).
    mig_mode: str = option(
        "--mig-mode",
        env="MIG_MODE",
        default="static",
        choices=MIG_MODES,
        help="DRA mode: static publishes the MIG devices that exist; dynamic publishes "
        "every MIG placement of MIG-capable GPUs and creates the instance at prepare "
        "(a node label drasil.dev/mig-mode overrides it; docs/mig.md)",
    )
    # DRA mode: whole GPUs for one claim each (exclusive) or shared by capacity.
    gpu_sharing: str = option(
        "--gpu-sharing",
        env="GPU_SHARING",
        default="exclusive",
        choices=GPU_SHARING,
        help="DRA mode: exclusive publishes whole GPUs for one claim each; consumable "
        "lets several claims share a GPU by memory and compute capacity, each share "
        "enforced with MPS (docs/sharing.md)",
    )
    # MPS daemons for devices allocated whole with an MPS config (docs/sharing.md).
    mps_whole_devices: bool = option(
        "--mps-whole-devices",
        env="MPS_WHOLE_DEVICES",
        default="true",
        truth=_yes,
        help="env MPS_WHOLE_DEVICES; run an MPS daemon for a GPU or MIG device allocated "
        "whole whose config says strategy MPS (the plugin needs CAP_SYS_ADMIN for the "
        "daemon's /dev/shm); --no-mps-whole-devices refuses such a claim at prepare, "
        "naming the chart value that turns it on (Helm mps.enabled)",
    )
    # MPS daemons of shared GPUs serve clients of every user (docs/sharing.md).
    mps_multiuser: bool = option(
        "--mps-multiuser",
        env="MPS_MULTIUSER",
        default="",
        truth=_yes,
        help="env MPS_MULTIUSER; start each MPS daemon with -multiuser-server, so that "
        "shares whose containers run as different users use the GPU at once (Volta "
        "and newer); without it MPS serves one user at a time and the others wait",
    )
    # Set: each MPS daemon runs in a Pod of this image in pod_namespace, shaped by
    # mps_daemon_pod (docs/sharing.md#where-the-daemon-runs); None: a host process.
    mps_daemon_image: str | None = option(
        "--mps-daemon-image",
        env="MPS_DAEMON_IMAGE",
        convert=_or_none,
        help="env MPS_DAEMON_IMAGE; run each MPS daemon in a Pod of this image (the "
        "plugin's own) on this node, in --pod-namespace, so that it outlives the plugin's "
        "Pod; without it each daemon is a process of the plugin's host",
    )
    mps_daemon_pod: Mapping[str, Any] = option(
        "--mps-daemon-pod",
        env="MPS_DAEMON_POD",
        default="{}",
        convert=_daemon_pod,
        help="env MPS_DAEMON_POD; JSON fields of each MPS daemon Pod: tolerations, "
        "priorityClassName, imagePullSecrets, imagePullPolicy, resources",
    )
    pod_namespace: str | None = option(
        "--pod-namespace",
        env="POD_NAMESPACE",
        convert=_or_none,
        help="env POD_NAMESPACE; the plugin's namespace, where its MPS daemon Pods go",
    )
    simulated_state: Path | None = option(
        "--simulated-state",
        env="SIMULATED_STATE",
        convert=_path_or_none,
        help="simulated backend: the file its GPUs keep MIG state in "
        "(default simulated-gpus.json in the plugin's state dir)",
    )
    # The NVIDIA driver's files (docs/kubelet-plugin.md#the-drivers-files). None: not
    # given, which for the simulated backend means "no driver files in specs".
    nvidia_driver_root: str | None = option(
        "--nvidia-driver-root",
        env="NVIDIA_DRIVER_ROOT",
        absolute=True,
        convert=_or_none,
        help="env NVIDIA_DRIVER_ROOT; the host directory the NVIDIA driver is installed "
        "under: / (default), /run/nvidia/driver for the GPU Operator's driver container. "
        "Its libraries, firmware, utilities and sockets go into every GPU container. With "
        "--backend simulated, only when given",
    )
    container_driver_root: Path | None = option(
        "--container-driver-root",
        env="CONTAINER_DRIVER_ROOT",
        absolute=True,
        convert=_path_or_none,
        help="env CONTAINER_DRIVER_ROOT; where this process sees --nvidia-driver-root "
        "(the chart mounts it at /driver-root); default: the same path",
    )
    nvidia_cdi_hook_path: str | None = option(
        "--nvidia-cdi-hook-path",
        env="NVIDIA_CDI_HOOK_PATH",
        absolute=True,
        convert=_or_none,
        help="env NVIDIA_CDI_HOOK_PATH; the host path of NVIDIA's nvidia-cdi-hook; "
        f"default: the one in the image ({BUNDLED_CDI_HOOK}), copied to the plugin's "
        "state dir on the host",
    )
    cdi_hooks: str = option(
        "--cdi-hooks",
        env="CDI_HOOKS",
        default="enabled",
        choices=CDI_HOOKS,
        help="env CDI_HOOKS; disabled leaves nvidia-cdi-hook's hooks out of CDI specs, "
        "for runtimes that refuse hooks",
    )
    # The GPU vendors this node serves (docs/amd.md#choosing-the-vendors): a subset of
    # VENDORS (or installed ones), or ("auto",) to find them; the simulated backend
    # takes them from its profile instead.
    vendors: tuple[str, ...] = option(
        "--vendors",
        env="VENDORS",
        default="nvidia",
        convert=_vendors,
        help="env VENDORS; the GPU vendors this node serves, comma-separated: nvidia, amd, "
        "or auto (each vendor whose kernel driver has GPUs here); --backend simulated "
        "takes them from --simulated-profile",
    )
    # Where amdgpu's sysfs tree is read (a fake tree in tests).
    amd_sysfs_root: Path = option(
        "--amd-sysfs-root",
        env="AMD_SYSFS_ROOT",
        default="/sys",
        absolute=True,
        convert=_path,
        help="env AMD_SYSFS_ROOT; where amdgpu's sysfs tree is read; for tests",
    )
    # static: AMD GPUs as their partition mode is; dynamic: prepare switches the mode.
    amd_partition_mode: str = option(
        "--amd-partition-mode",
        env="AMD_PARTITION_MODE",
        default="static",
        choices=PARTITION_MODES,
        help="env AMD_PARTITION_MODE; DRA mode: static publishes AMD GPUs in the compute "
        "partition mode they are in; dynamic publishes every partition of MI300-class GPUs "
        "and switches the GPU's mode at prepare (docs/amd.md#dynamic-partitions)",
    )
    # DRA mode: each whole GPU also published for VMs, bound to vfio-pci at prepare.
    passthrough: bool = option(
        "--passthrough",
        env="PASSTHROUGH",
        default="",
        truth=_yes,
        help="env PASSTHROUGH; DRA mode: publish each whole GPU a second time, as a vfio "
        "device a KubeVirt VM gets (DeviceClass vfio.gpu.drasil.dev); prepare binds it to "
        "vfio-pci, unprepare back to its driver (docs/passthrough.md)",
    )
    # Where PCI functions are read and rebound for passthrough (a fake tree in tests).
    pci_sysfs_root: Path = option(
        "--pci-sysfs-root",
        env="PCI_SYSFS_ROOT",
        default="/sys",
        absolute=True,
        convert=_path,
        help="env PCI_SYSFS_ROOT; the sysfs tree of the node's PCI functions (passthrough); "
        "for tests",
    )
    vfio_dev_root: Path = option(
        "--vfio-dev-root",
        env="VFIO_DEV_ROOT",
        default="/dev",
        absolute=True,
        convert=_path,
        help="env VFIO_DEV_ROOT; where the host's /dev is seen, for passthrough to wait "
        "for /dev/vfio/<group> (the chart mounts the host's at /host-dev)",
    )
    # DRA mode: another device plugin's resources that make this one withhold GPUs.
    device_plugin_resources: tuple[str, ...] = option(
        "--device-plugin-resources",
        env="DEVICE_PLUGIN_RESOURCES",
        default=",".join(DEVICE_PLUGIN_RESOURCES),
        convert=_resource_patterns,
        help="env DEVICE_PLUGIN_RESOURCES; DRA mode: comma-separated extended resources "
        "(shell wildcards allowed) of other device plugins; while the Node has one "
        "allocatable, drasil publishes none of that vendor's GPUs, so that no GPU has two "
        "holders (empty: never; docs/migrating.md)",
    )
    # DRA mode: host resources each Pod using a whole GPU takes from the node's
    # allocatable (drasil.driver.hostresources); empty: none.
    host_resources_per_gpu: Mapping[str, str] = option(
        "--host-resources-per-gpu",
        env="HOST_RESOURCES_PER_GPU",
        default="",
        convert=_host_resources,
        help="env HOST_RESOURCES_PER_GPU; DRA mode: host resources each Pod using a whole "
        "GPU takes from the node's allocatable, e.g. cpu=8,memory=32Gi (published as the "
        "GPU's nodeAllocatableResources; needs the DRANodeAllocatableResources feature "
        "gate; docs/kubelet-plugin.md#host-resources-with-a-gpu); empty: none",
    )
    # DRA mode: which GPU labels the node gets, and NFD's features.d to write them to
    # (None: the plugin patches its own Node).
    node_labels: str = option(
        "--node-labels",
        env="NODE_LABELS",
        default="drasil",
        choices=NODE_LABELS,
        help="env NODE_LABELS; DRA mode: label the node with its GPUs (product, count, "
        "memory, family, compute capability, driver and CUDA versions, MIG and MPS) under "
        "drasil.dev/ (drasil), also under GPU Feature Discovery's nvidia.com/ names (gfd), "
        "or not at all (off); docs/migrating.md",
    )
    nfd_features_dir: Path | None = option(
        "--nfd-features-dir",
        env="NFD_FEATURES_DIR",
        default="",
        absolute=True,
        convert=_path_or_none,
        help="env NFD_FEATURES_DIR; write the labels to Node Feature Discovery's local "
        "feature directory (features.d) instead of patching this node's Node",
    )
    # Device-plugin mode: the extended resource AMD GPUs are advertised under (ROCm's
    # device plugin's, so Pods written for it run unchanged).
    amd_resource_name: str = option(
        "--amd-resource-name",
        env="AMD_RESOURCE_NAME",
        default="amd.com/gpu",
        help="device-plugin mode: the extended resource of AMD GPUs (ROCm's plugin's)",
    )
    # Where the NVIDIA driver's /proc entries are read (MIG capability minors).
    proc_root: Path = option(
        "--proc-root",
        env="PROC_ROOT",
        default="/proc",
        absolute=True,
        convert=_path,
        help="env PROC_ROOT; where the NVIDIA driver's /proc entries are read (MIG "
        "capability numbers), and the processes looked through for a GPU in use before "
        "it is passed through (the host's: the chart sets hostPID with passthrough on); "
        "for tests",
    )
    # Where the id of the current boot is read: prepared state of another boot is
    # never trusted (a test rig's simulated reboot writes its own file).
    boot_id_file: Path = option(
        "--boot-id-file",
        env="BOOT_ID_FILE",
        default=str(BOOT_ID_PATH),
        absolute=True,
        convert=_path,
        help="env BOOT_ID_FILE; the file holding the id of the current boot: prepared "
        "claims, MIG instances and MPS daemons of another boot are made again; for test "
        "rigs that simulate a node reboot",
    )
    # Where the image carries nvidia-cdi-hook (tests point it elsewhere); env only.
    bundled_cdi_hook: Path = option(
        None, env="DRASIL_BUNDLED_CDI_HOOK", default=BUNDLED_CDI_HOOK, convert=_path
    )

    @property
    def driver_root_host(self) -> str:
        """The driver root as the host sees it (``/`` unless given)."""
        return self.nvidia_driver_root or "/"

    @property
    def driver_root_local(self) -> Path:
        """Where this process sees the driver root (the chart's ``/driver-root``)."""
        return self.container_driver_root or Path(self.driver_root_host)

    @property
    def dev_root(self) -> tuple[str, Path]:
        """The GPUs' device nodes (host path, where this process sees them): the driver
        root's ``dev/`` where it has the control node (a driver container's root, as
        NVIDIA's DRA driver decides), else ``/dev``."""
        local = self.driver_root_local / "dev"
        if self.driver_root_host != "/" and (local / "nvidiactl").exists():
            return f"{self.driver_root_host.rstrip('/')}/dev", local
        return "/dev", Path("/dev")

    @property
    def state_dir(self) -> Path:
        """Checkpoint and locks live beside the DRA socket (docs/design.md#names)."""
        return self.plugins_dir / self.driver_name

    @property
    def simulated_pci_root(self) -> Path:
        """The simulated NVIDIA GPUs' PCI sysfs tree (passthrough), kept like the AMD one."""
        return self.state_dir / "simulated-pci-sysfs"

    @property
    def simulated_dev_root(self) -> Path:
        """Where the simulated kernel makes ``vfio/<group>`` nodes (regular files)."""
        return self.state_dir / "simulated-dev"

    @property
    def simulated_amd_root(self) -> Path:
        """The simulated AMD GPUs' sysfs tree: written once per node, it keeps their
        partition modes and error counters as a real GPU's sysfs would."""
        return self.state_dir / "simulated-amd-sysfs"

    @property
    def simulated_state_file(self) -> Path:
        """Where the simulated GPUs keep their MIG instances, which outlive the plugin
        as a real GPU's do (default: ``simulated-gpus.json`` in the state dir)."""
        return self.simulated_state or self.state_dir / "simulated-gpus.json"

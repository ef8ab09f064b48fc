"""Flags of ``drasil-kubelet-plugin``; a flag wins over its environment variable."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drasil.driver.checkpoint import BOOT_ID_PATH
from drasil.driver.endpoints import parse_addr
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


@dataclass(frozen=True)
class PluginOptions:
    node_name: str
    driver_name: str
    backend: str
    simulated_profile: str
    kubeconfig: str | None
    registrar_dir: Path
    plugins_dir: Path
    cdi_root: Path
    pod_uid: str | None
    metrics_addr: str
    health_addr: str
    log_format: LogFormat
    verbosity: int
    mode: str
    # Device-plugin mode only (docs/device-plugin.md); defaults keep DRA callers short.
    device_plugins_dir: Path = Path("/var/lib/kubelet/device-plugins")
    resource_name: str = "drasil.dev/gpu"
    time_slicing_replicas: int = 1
    mig_strategy: str = "none"
    # DRA mode: publish existing MIG devices (static) or cut them on demand (dynamic).
    mig_mode: str = "static"
    # DRA mode: whole GPUs for one claim each (exclusive) or shared by capacity.
    gpu_sharing: str = "exclusive"
    # MPS daemons of shared GPUs serve clients of every user (docs/sharing.md).
    mps_multiuser: bool = False
    # MPS daemons for devices allocated whole with an MPS config (docs/sharing.md).
    mps_whole_devices: bool = True
    # Set: each MPS daemon runs in a Pod of this image in pod_namespace, shaped by
    # mps_daemon_pod (docs/sharing.md#where-the-daemon-runs); None: a host process.
    mps_daemon_image: str | None = None
    mps_daemon_pod: Mapping[str, Any] = field(default_factory=dict)
    pod_namespace: str | None = None
    simulated_state: Path | None = None
    # The NVIDIA driver's files (docs/kubelet-plugin.md#the-drivers-files). None: not
    # given, which for the simulated backend means "no driver files in specs".
    nvidia_driver_root: str | None = None
    container_driver_root: Path | None = None
    nvidia_cdi_hook_path: str | None = None
    cdi_hooks: str = "enabled"
    bundled_cdi_hook: Path = Path(BUNDLED_CDI_HOOK)
    # Where the NVIDIA driver's /proc entries are read (MIG capability minors).
    proc_root: Path = Path("/proc")
    # Where the id of the current boot is read: prepared state of another boot is
    # never trusted (a test rig's simulated reboot writes its own file).
    boot_id_file: Path = BOOT_ID_PATH
    # The GPU vendors this node serves (docs/amd.md#choosing-the-vendors): a subset of
    # VENDORS, or ("auto",) to find them; the simulated backend takes them from its
    # profile instead.
    vendors: tuple[str, ...] = ("nvidia",)
    # Where amdgpu's sysfs tree is read (a fake tree in tests).
    amd_sysfs_root: Path = Path("/sys")
    # Device-plugin mode: the extended resource AMD GPUs are advertised under (ROCm's
    # device plugin's, so Pods written for it run unchanged).
    amd_resource_name: str = "amd.com/gpu"
    # static: AMD GPUs as their partition mode is; dynamic: prepare switches the mode.
    amd_partition_mode: str = "static"
    # DRA mode: another device plugin's resources that make this one withhold GPUs.
    device_plugin_resources: tuple[str, ...] = DEVICE_PLUGIN_RESOURCES
    # DRA mode: which GPU labels the node gets, and NFD's features.d to write them to
    # (None: the plugin patches its own Node).
    node_labels: str = "drasil"
    nfd_features_dir: Path | None = None
    # DRA mode: host resources each Pod using a whole GPU takes from the node's
    # allocatable (drasil.driver.hostresources); empty: none.
    host_resources_per_gpu: Mapping[str, str] = field(default_factory=dict)

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
    def simulated_amd_root(self) -> Path:
        """The simulated AMD GPUs' sysfs tree: written once per node, it keeps their
        partition modes and error counters as a real GPU's sysfs would."""
        return self.state_dir / "simulated-amd-sysfs"

    @property
    def simulated_state_file(self) -> Path:
        """Where the simulated GPUs keep their MIG instances, which outlive the plugin
        as a real GPU's do (default: ``simulated-gpus.json`` in the state dir)."""
        return self.simulated_state or self.state_dir / "simulated-gpus.json"


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
    p = argparse.ArgumentParser(
        prog="drasil-kubelet-plugin",
        formatter_class=_PlainHelpFormatter,
        description="drasil's node daemon: publishes this node's GPUs and prepares them "
        "for containers through kubelet's DRA plugin API.",
    )
    p.add_argument("--node-name", default=env.get("NODE_NAME"), help="env NODE_NAME; required")
    p.add_argument("--driver-name", default=env.get("DRIVER_NAME", DEFAULT_DRIVER))
    p.add_argument("--backend", choices=BACKENDS, default=env.get("BACKEND", "nvml"))
    p.add_argument(
        "--simulated-profile",
        default=env.get("SIMULATED_PROFILE", "h100-80gb:8"),
        help="GPUs of the simulated backend, e.g. h100-80gb:8 or a100-40gb-mig:2,l4:1",
    )
    p.add_argument("--kubeconfig", default=env.get("KUBECONFIG"), help="in-cluster if absent")
    p.add_argument("--registrar-dir", default="/var/lib/kubelet/plugins_registry")
    p.add_argument("--plugins-dir", default="/var/lib/kubelet/plugins")
    p.add_argument("--cdi-root", default="/var/run/cdi")
    p.add_argument("--pod-uid", default=env.get("POD_UID"), help="env POD_UID")
    p.add_argument("--metrics-addr", default=env.get("METRICS_ADDR", ":9400"))
    p.add_argument("--health-addr", default=env.get("HEALTH_ADDR", ":9401"))
    p.add_argument("--log-format", choices=LOG_FORMATS, default=env.get("LOG_FORMAT", "text"))
    p.add_argument("-v", "--v", dest="verbosity", type=int, default=_env_int(env, "V"))
    p.add_argument("--mode", choices=MODES, default=env.get("MODE", "dra"))
    p.add_argument("--device-plugins-dir", default="/var/lib/kubelet/device-plugins")
    p.add_argument(
        "--resource-name",
        default=env.get("RESOURCE_NAME", "drasil.dev/gpu"),
        help="extended resource of device-plugin mode; match the DeviceClass's "
        "extendedResourceName",
    )
    p.add_argument(
        "--time-slicing-replicas",
        type=int,
        # A string default goes through type=int too: a bad env value is a usage error.
        default=env.get("TIME_SLICING_REPLICAS", "1"),
        help="device-plugin mode: advertise each device N times (<id>::<n>)",
    )
    p.add_argument(
        "--mig-strategy",
        choices=MIG_STRATEGIES,
        default=env.get("MIG_STRATEGY", "none"),
        help="device-plugin mode: none (full GPUs), single or mixed (mig-<profile>)",
    )
    p.add_argument(
        "--mig-mode",
        choices=MIG_MODES,
        default=env.get("MIG_MODE", "static"),
        help="DRA mode: static publishes the MIG devices that exist; dynamic publishes "
        "every MIG placement of MIG-capable GPUs and creates the instance at prepare "
        "(a node label drasil.dev/mig-mode overrides it; docs/mig.md)",
    )
    p.add_argument(
        "--gpu-sharing",
        choices=GPU_SHARING,
        default=env.get("GPU_SHARING", "exclusive"),
        help="DRA mode: exclusive publishes whole GPUs for one claim each; consumable "
        "lets several claims share a GPU by memory and compute capacity, each share "
        "enforced with MPS (docs/sharing.md)",
    )
    p.add_argument(
        "--mps-whole-devices",
        action=argparse.BooleanOptionalAction,
        default=env.get("MPS_WHOLE_DEVICES", "true").lower() in ("1", "true", "yes"),
        help="env MPS_WHOLE_DEVICES; run an MPS daemon for a GPU or MIG device allocated "
        "whole whose config says strategy MPS (the plugin needs CAP_SYS_ADMIN for the "
        "daemon's /dev/shm); --no-mps-whole-devices refuses such a claim at prepare, "
        "naming the chart value that turns it on (Helm mps.enabled)",
    )
    p.add_argument(
        "--mps-multiuser",
        action=argparse.BooleanOptionalAction,
        default=env.get("MPS_MULTIUSER", "").lower() in ("1", "true", "yes"),
        help="env MPS_MULTIUSER; start each MPS daemon with -multiuser-server, so that "
        "shares whose containers run as different users use the GPU at once (Volta "
        "and newer); without it MPS serves one user at a time and the others wait",
    )
    p.add_argument(
        "--mps-daemon-image",
        default=env.get("MPS_DAEMON_IMAGE"),
        help="env MPS_DAEMON_IMAGE; run each MPS daemon in a Pod of this image (the "
        "plugin's own) on this node, in --pod-namespace, so that it outlives the plugin's "
        "Pod; without it each daemon is a process of the plugin's host",
    )
    p.add_argument(
        "--mps-daemon-pod",
        default=env.get("MPS_DAEMON_POD", "{}"),
        help="env MPS_DAEMON_POD; JSON fields of each MPS daemon Pod: tolerations, "
        "priorityClassName, imagePullSecrets, imagePullPolicy, resources",
    )
    p.add_argument(
        "--pod-namespace",
        default=env.get("POD_NAMESPACE"),
        help="env POD_NAMESPACE; the plugin's namespace, where its MPS daemon Pods go",
    )
    p.add_argument(
        "--simulated-state",
        default=env.get("SIMULATED_STATE"),
        help="simulated backend: the file its GPUs keep MIG state in "
        "(default simulated-gpus.json in the plugin's state dir)",
    )
    p.add_argument(
        "--nvidia-driver-root",
        default=env.get("NVIDIA_DRIVER_ROOT"),
        help="env NVIDIA_DRIVER_ROOT; the host directory the NVIDIA driver is installed "
        "under: / (default), /run/nvidia/driver for the GPU Operator's driver container. "
        "Its libraries, firmware, utilities and sockets go into every GPU container. With "
        "--backend simulated, only when given",
    )
    p.add_argument(
        "--container-driver-root",
        default=env.get("CONTAINER_DRIVER_ROOT"),
        help="env CONTAINER_DRIVER_ROOT; where this process sees --nvidia-driver-root "
        "(the chart mounts it at /driver-root); default: the same path",
    )
    p.add_argument(
        "--nvidia-cdi-hook-path",
        default=env.get("NVIDIA_CDI_HOOK_PATH"),
        help="env NVIDIA_CDI_HOOK_PATH; the host path of NVIDIA's nvidia-cdi-hook; "
        f"default: the one in the image ({BUNDLED_CDI_HOOK}), copied to the plugin's "
        "state dir on the host",
    )
    p.add_argument(
        "--cdi-hooks",
        choices=CDI_HOOKS,
        default=env.get("CDI_HOOKS", "enabled"),
        help="env CDI_HOOKS; disabled leaves nvidia-cdi-hook's hooks out of CDI specs, "
        "for runtimes that refuse hooks",
    )
    p.add_argument(
        "--vendors",
        default=env.get("VENDORS", "nvidia"),
        help="env VENDORS; the GPU vendors this node serves, comma-separated: nvidia, amd, "
        "or auto (each vendor whose kernel driver has GPUs here); --backend simulated "
        "takes them from --simulated-profile",
    )
    p.add_argument(
        "--amd-sysfs-root",
        default=env.get("AMD_SYSFS_ROOT", "/sys"),
        help="env AMD_SYSFS_ROOT; where amdgpu's sysfs tree is read; for tests",
    )
    p.add_argument(
        "--amd-partition-mode",
        choices=PARTITION_MODES,
        default=env.get("AMD_PARTITION_MODE", "static"),
        help="env AMD_PARTITION_MODE; DRA mode: static publishes AMD GPUs in the compute "
        "partition mode they are in; dynamic publishes every partition of MI300-class GPUs "
        "and switches the GPU's mode at prepare (docs/amd.md#dynamic-partitions)",
    )
    p.add_argument(
        "--device-plugin-resources",
        default=env.get("DEVICE_PLUGIN_RESOURCES", ",".join(DEVICE_PLUGIN_RESOURCES)),
        help="env DEVICE_PLUGIN_RESOURCES; DRA mode: comma-separated extended resources "
        "(shell wildcards allowed) of other device plugins; while the Node has one "
        "allocatable, drasil publishes none of that vendor's GPUs, so that no GPU has two "
        "holders (empty: never; docs/migrating.md)",
    )
    p.add_argument(
        "--host-resources-per-gpu",
        default=env.get("HOST_RESOURCES_PER_GPU", ""),
        help="env HOST_RESOURCES_PER_GPU; DRA mode: host resources each Pod using a whole "
        "GPU takes from the node's allocatable, e.g. cpu=8,memory=32Gi (published as the "
        "GPU's nodeAllocatableResources; needs the DRANodeAllocatableResources feature "
        "gate; docs/kubelet-plugin.md#host-resources-with-a-gpu); empty: none",
    )
    p.add_argument(
        "--node-labels",
        choices=NODE_LABELS,
        default=env.get("NODE_LABELS", "drasil"),
        help="env NODE_LABELS; DRA mode: label the node with its GPUs (product, count, "
        "memory, family, compute capability, driver and CUDA versions, MIG and MPS) under "
        "drasil.dev/ (drasil), also under GPU Feature Discovery's nvidia.com/ names (gfd), "
        "or not at all (off); docs/migrating.md",
    )
    p.add_argument(
        "--nfd-features-dir",
        default=env.get("NFD_FEATURES_DIR", ""),
        help="env NFD_FEATURES_DIR; write the labels to Node Feature Discovery's local "
        "feature directory (features.d) instead of patching this node's Node",
    )
    p.add_argument(
        "--amd-resource-name",
        default=env.get("AMD_RESOURCE_NAME", "amd.com/gpu"),
        help="device-plugin mode: the extended resource of AMD GPUs (ROCm's plugin's)",
    )
    p.add_argument(
        "--proc-root",
        default=env.get("PROC_ROOT", "/proc"),
        help="env PROC_ROOT; where the NVIDIA driver's /proc entries are read (MIG "
        "capability numbers); for tests",
    )
    p.add_argument(
        "--boot-id-file",
        default=env.get("BOOT_ID_FILE", str(BOOT_ID_PATH)),
        help="env BOOT_ID_FILE; the file holding the id of the current boot: prepared "
        "claims, MIG instances and MPS daemons of another boot are made again; for test "
        "rigs that simulate a node reboot",
    )
    return p


def _env_int(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "0")
    try:
        return int(value)
    except ValueError:
        raise OptionsError(f"env {name}: {value!r} is not an integer") from None


def _check_addr(flag: str, value: str) -> None:
    try:
        parse_addr(value)
    except ValueError as err:
        raise OptionsError(f"{flag}: {err}") from None


def _check_choice(name: str, value: str, allowed: Sequence[str]) -> None:
    # argparse checks choices only for values given as flags, not for env defaults.
    if value not in allowed:
        raise OptionsError(f"{name}: unsupported value {value!r}; allowed values are {allowed}")


def parse_options(argv: Sequence[str], env: Mapping[str, str] | None = None) -> PluginOptions:
    """Parse flags, falling back to the environment, and check what argparse cannot."""
    env = os.environ if env is None else env
    ns = _parser(env).parse_args(list(argv))
    if not ns.node_name:
        raise OptionsError("--node-name (or env NODE_NAME) is required")
    _check_choice("--backend", ns.backend, BACKENDS)
    _check_choice("--log-format", ns.log_format, LOG_FORMATS)
    _check_choice("--mode", ns.mode, MODES)
    _check_addr("--metrics-addr", ns.metrics_addr)
    _check_addr("--health-addr", ns.health_addr)
    _check_choice("--mig-strategy", ns.mig_strategy, MIG_STRATEGIES)
    _check_choice("--mig-mode", ns.mig_mode, MIG_MODES)
    _check_choice("--amd-partition-mode", ns.amd_partition_mode, PARTITION_MODES)
    _check_choice("--gpu-sharing", ns.gpu_sharing, GPU_SHARING)
    _check_choice("--node-labels", ns.node_labels, NODE_LABELS)
    _check_choice("--cdi-hooks", ns.cdi_hooks, CDI_HOOKS)
    for flag, value in (
        ("--nvidia-driver-root", ns.nvidia_driver_root),
        ("--container-driver-root", ns.container_driver_root),
        ("--nvidia-cdi-hook-path", ns.nvidia_cdi_hook_path),
        ("--proc-root", ns.proc_root),
        ("--amd-sysfs-root", ns.amd_sysfs_root),
        ("--boot-id-file", ns.boot_id_file),
        ("--nfd-features-dir", ns.nfd_features_dir),
    ):
        if value and not value.startswith("/"):
            raise OptionsError(f"{flag}: {value!r} is not an absolute path")
    daemon_pod = _daemon_pod(ns.mps_daemon_pod)
    if ns.mps_daemon_image and not ns.pod_namespace:
        raise OptionsError("--mps-daemon-image needs --pod-namespace (or env POD_NAMESPACE)")
    if ns.time_slicing_replicas < 1:
        raise OptionsError(f"--time-slicing-replicas: {ns.time_slicing_replicas} is less than 1")
    return PluginOptions(
        node_name=ns.node_name,
        driver_name=ns.driver_name,
        backend=ns.backend,
        simulated_profile=ns.simulated_profile,
        kubeconfig=ns.kubeconfig,
        registrar_dir=Path(ns.registrar_dir),
        plugins_dir=Path(ns.plugins_dir),
        cdi_root=Path(ns.cdi_root),
        pod_uid=ns.pod_uid,
        metrics_addr=ns.metrics_addr,
        health_addr=ns.health_addr,
        log_format=ns.log_format,
        verbosity=ns.verbosity,
        mode=ns.mode,
        device_plugins_dir=Path(ns.device_plugins_dir),
        resource_name=ns.resource_name,
        time_slicing_replicas=ns.time_slicing_replicas,
        mig_strategy=ns.mig_strategy,
        mig_mode=ns.mig_mode,
        gpu_sharing=ns.gpu_sharing,
        mps_multiuser=ns.mps_multiuser,
        mps_whole_devices=ns.mps_whole_devices,
        mps_daemon_image=ns.mps_daemon_image or None,
        mps_daemon_pod=daemon_pod,
        pod_namespace=ns.pod_namespace or None,
        simulated_state=Path(ns.simulated_state) if ns.simulated_state else None,
        nvidia_driver_root=ns.nvidia_driver_root or None,
        container_driver_root=Path(ns.container_driver_root) if ns.container_driver_root else None,
        nvidia_cdi_hook_path=ns.nvidia_cdi_hook_path or None,
        cdi_hooks=ns.cdi_hooks,
        bundled_cdi_hook=Path(env.get("DRASIL_BUNDLED_CDI_HOOK", BUNDLED_CDI_HOOK)),
        proc_root=Path(ns.proc_root),
        boot_id_file=Path(ns.boot_id_file),
        vendors=_vendors(ns.vendors),
        amd_sysfs_root=Path(ns.amd_sysfs_root),
        amd_resource_name=ns.amd_resource_name,
        amd_partition_mode=ns.amd_partition_mode,
        device_plugin_resources=_resource_patterns(ns.device_plugin_resources),
        node_labels=ns.node_labels,
        nfd_features_dir=Path(ns.nfd_features_dir) if ns.nfd_features_dir else None,
        host_resources_per_gpu=_host_resources(ns.host_resources_per_gpu),
    )


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

"""Where the node of a run keeps its files, and what its configuration files say.

`NodeFiles` holds the layout (see `e2e.harness.cluster.node` for the whole picture) and writes
containerd's config, the CNI network, kubelet's configuration, its serving certificate
and kubeconfig; `new_config` picks what one node of a run uses (ports, cgroup, bridge,
subnet, kubelet's root dir). `e2e.harness.cluster.node.Node` runs it all.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e.harness import pluginproc, versions
from e2e.harness.cluster import host, pki
from e2e.harness.cluster.rundir import RunDir

NODE_NAME = "drasil-node"
DEFAULT_PROFILE = "h100-80gb:8"
# Unix socket paths are limited to 108 bytes (107 and the NUL); the plugin binds a
# temporary name 10 bytes longer first.
MAX_SOCKET_PATH = 97
POD_SUBNET_BASE = ipaddress.IPv4Network("10.244.0.0/16")
# kubelet's --root-dir of each run is <this>/<8 hex digits of the run dir's hash>. Not
# under the run dir, and not named by the run id: the plugin's
# <root>/plugins_registry/<driver>-<13 chars of its Pod UID>-reg.sock (the chart's
# per-Pod socket names) must fit a unix socket path (the plugin allows 97 bytes, as it
# binds a temporary name first), and the cache dir alone can take half of that.
KUBELET_ROOT_BASE = Path("/var/lib/drasil-e2e")
# kubelet asks a plugin again for a Pod whose prepare failed only at its next pod sync:
# a FailedPrepareDynamicResources ends the sync without an error, so no 10 s backoff
# applies, and `syncFrequency` (default 1m, plus up to half of it in jitter) decides.
# The tests run kubelet with 10s so that a refused prepare is retried within seconds;
# `make bench-churn` runs it with kubelet's default (bench/churn.py), as nodes do.
KUBELET_SYNC_ENV = "DRASIL_E2E_KUBELET_SYNC"
KUBELET_SYNC = "10s"


class NodeError(RuntimeError):
    """The node could not be started, checked or stopped; says what and why."""


@dataclass(frozen=True)
class NodeConfig:
    """What one node of a run uses; saved in cluster.json under "node"."""

    name: str
    profile: str
    kubelet_port: int
    healthz_port: int
    cgroup_root: str  # without the leading slash
    bridge: str
    subnet: str
    kubelet_root: str

    @property
    def node_ip(self) -> str:
        """The bridge's address: kubelet refuses a loopback node IP, and this one is
        reachable from this machine (and its Pods) only."""
        return str(next(ipaddress.ip_network(self.subnet).hosts()))

    @property
    def bridge_address(self) -> str:
        """The node IP with the prefix length of the Pod subnet, for `ip addr add`."""
        return f"{self.node_ip}/{ipaddress.ip_network(self.subnet).prefixlen}"


def possible_node_ips() -> tuple[str, ...]:
    """Every node IP a run may get: the first address of each /24 of POD_SUBNET_BASE.
    The API server's certificate names them all, so that a Pod on the Pod network can
    reach it at its node's IP (e2e.harness.apirelay) before that node exists."""
    return tuple(str(next(net.hosts())) for net in POD_SUBNET_BASE.subnets(new_prefix=24))


def new_config(run: RunDir, *, name: str, profile: str) -> NodeConfig:
    """Free ports, a free Pod subnet, and names derived from the run's id."""
    run_id = run.run_dir.name
    digest = hashlib.sha256(str(run.run_dir).encode()).hexdigest()
    subnet = host.free_subnet(POD_SUBNET_BASE, seed=run_id)
    if subnet is None:
        raise NodeError(f"no free /24 in {POD_SUBNET_BASE} for the Pod network")
    kubelet_port, healthz_port = host.free_ports(2)
    return NodeConfig(
        name=name,
        profile=profile,
        kubelet_port=kubelet_port,
        healthz_port=healthz_port,
        cgroup_root=f"drasil-e2e-{run_id}",
        bridge=f"drasil{digest[:8]}",
        subnet=subnet,
        kubelet_root=str(KUBELET_ROOT_BASE / digest[:8]),
    )


class NodeFiles:
    """The files of the node of one run (`NodeFiles(run)` reads its config from the
    run's state)."""

    def __init__(self, cluster: RunDir) -> None:
        self.cluster = cluster
        self.run_dir = cluster.run_dir

    @property
    def config(self) -> NodeConfig:
        raw = self.cluster.state().get("node")
        if not raw:
            raise NodeError(f"{self.run_dir} has no node (start one with `up --with-node`)")
        return NodeConfig(**raw["config"])

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def conf_dir(self) -> Path:
        return self.run_dir / "node"

    @property
    def containerd_dir(self) -> Path:
        return self.run_dir / "containerd"

    @property
    def containerd_socket(self) -> Path:
        return self.run_dir / "containerd.sock"

    @property
    def kubelet_root(self) -> Path:
        """kubelet's --root-dir: plugins_registry/ and plugins/ live here. Outside the
        run dir (`<run dir>/kubelet` links to it): the plugin's registration socket
        path must stay short (see KUBELET_ROOT_BASE)."""
        return Path(self.config.kubelet_root)

    @property
    def registrar_dir(self) -> Path:
        return self.kubelet_root / "plugins_registry"

    @property
    def plugins_dir(self) -> Path:
        return self.kubelet_root / "plugins"

    @property
    def cdi_dir(self) -> Path:
        return self.run_dir / "cdi"

    @property
    def pod_logs_dir(self) -> Path:
        return self.run_dir / "pod-logs"

    @property
    def cni_conf_dir(self) -> Path:
        return self.conf_dir / "cni" / "net.d"

    @property
    def kubelet_kubeconfig(self) -> Path:
        return self.cluster.kubeconfigs_dir / f"kubelet-{self.name}.kubeconfig"

    def log(self, component: str) -> Path:
        return self.cluster.log(component)

    def bin(self, name: str) -> Path:
        return self.cluster.bin(name)

    @property
    def cni_bin_dir(self) -> Path:
        return self.bin("kubelet").parent.parent / "cni-bin"

    # -- configuration files ----------------------------------------------------------

    def _containerd_toml(self) -> str:
        c = self.containerd_dir
        cdi_dirs = ["/etc/cdi", "/var/run/cdi", str(self.cdi_dir)]

        def q(value: str) -> str:
            return json.dumps(value)  # a TOML basic string is a JSON string

        def arr(values: Sequence[str]) -> str:
            return "[" + ", ".join(q(v) for v in values) + "]"

        return f"""\
# Written by e2e.harness.cluster.node for {self.run_dir}
version = 3
root = {q(str(c / "root"))}
state = {q(str(c / "state"))}
temp = {q(str(c / "tmp"))}
# Plugins that would use host-global paths (NRI's socket, /opt/containerd) or that
# this node does not need.
disabled_plugins = [
  "io.containerd.nri.v1.nri",
  "io.containerd.internal.v1.opt",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = {q(str(self.containerd_socket))}

[ttrpc]
  address = {q(str(self.containerd_socket) + ".ttrpc")}

[debug]
  level = "info"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    # Imported from our OCI archive; no registry is reachable.
    sandbox = {q(versions.PAUSE_IMAGE)}

[plugins.'io.containerd.cri.v1.runtime']
  # CDI is on by default in containerd 2.x; the plugin's CDI root is added.
  cdi_spec_dirs = {arr(cdi_dirs)}
  netns_mounts_under_state_dir = true
  # No CAP_SYS_RESOURCE on some CI machines: runc could not lower a sandbox's
  # oom_score_adj to kubelet's -998. Clamp to containerd's own instead.
  restrict_oom_score_adj = true
  enable_unprivileged_ports = true
  enable_unprivileged_icmp = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = {q(str(self.bin("runc")))}
        Root = {q(str(c / "runc"))}
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = {arr([str(self.cni_bin_dir)])}
    conf_dir = {q(str(self.cni_conf_dir))}
    max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""

    def _cni_conflist(self, config: NodeConfig) -> dict[str, Any]:
        return {
            "cniVersion": "1.0.0",
            "name": "drasil-e2e",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": config.bridge,
                    # The bridge and its address (the node IP) are made by `start`. No
                    # gateway (it would turn on the host's ip_forward) and no masquerade
                    # (no iptables): Pods reach the host and each other, nothing else.
                    "isGateway": False,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": config.subnet}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.conf_dir / "cni" / "ipam"),
                    },
                }
            ],
        }

    def _kubelet_config(self, config: NodeConfig) -> dict[str, Any]:
        p = self.cluster.pki_dir
        resolv = Path("/etc/resolv.conf")
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # The node IP: kube-apiserver reaches kubelet there for logs and exec.
            "address": config.node_ip,
            "port": config.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": config.healthz_port,
            "tlsCertFile": str(p / f"kubelet-{config.name}-serving.crt"),
            "tlsPrivateKeyFile": str(p / f"kubelet-{config.name}-serving.key"),
            "rotateCertificates": False,
            "serverTLSBootstrap": False,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(p / "ca.crt")},
            },
            "authorization": {"mode": "Webhook"},
            # cgroup v1 here: kubelet 1.35+ refuses it unless told otherwise.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{config.cgroup_root}",
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "imageServiceEndpoint": f"unix://{self.containerd_socket}",
            "featureGates": dict(versions.FEATURE_GATES),
            "podLogsDir": str(self.pod_logs_dir),
            # Never evict or garbage-collect on a full CI disk: our images cannot be
            # pulled again.
            "evictionHard": {
                "memory.available": "50Mi",
                "nodefs.available": "1%",
                "nodefs.inodesFree": "1%",
                "imagefs.available": "1%",
                "imagefs.inodesFree": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "resolvConf": str(resolv) if resolv.exists() else "",
            "shutdownGracePeriod": "0s",
            "shutdownGracePeriodCriticalPods": "0s",
            "protectKernelDefaults": False,
            "enableDebuggingHandlers": True,
            "nodeStatusReportFrequency": "10s",
            "syncFrequency": os.environ.get(KUBELET_SYNC_ENV, KUBELET_SYNC),
            "maxPods": 110,
        }

    def kubelet_argv(self) -> list[str]:
        cfg = self.config
        return [
            str(self.bin("kubelet")),
            f"--config={self.conf_dir / 'kubelet.yaml'}",
            f"--kubeconfig={self.kubelet_kubeconfig}",
            f"--root-dir={self.kubelet_root}",
            f"--cert-dir={self.kubelet_root / 'pki'}",
            f"--hostname-override={cfg.name}",
            f"--node-ip={cfg.node_ip}",
            "--v=2",
            # Plugin registration and every NodePrepare/NodeUnprepare call with its
            # response, without the rest of kubelet at -v=4.
            "--vmodule=dra_plugin*=4",
        ]

    def write_config(self, config: NodeConfig) -> None:
        for d in (
            self.conf_dir,
            self.cni_conf_dir,
            self.containerd_dir,
            self.kubelet_root,
            self.registrar_dir,
            self.plugins_dir,
            self.cdi_dir,
            self.pod_logs_dir,
        ):
            d.mkdir(parents=True, exist_ok=True)
        longest = self.registrar_dir / f"{pluginproc.DRIVER}-reg.sock"
        if len(str(longest)) > MAX_SOCKET_PATH:
            raise NodeError(
                f"socket path {longest} is {len(str(longest))} bytes, more than a unix "
                f"socket allows ({MAX_SOCKET_PATH}); use a shorter DRASIL_CACHE_DIR"
            )
        link = self.run_dir / "kubelet"
        if not link.is_symlink():
            link.symlink_to(self.kubelet_root)
        (self.conf_dir / "containerd.toml").write_text(self._containerd_toml())
        (self.cni_conf_dir / "10-drasil.conflist").write_text(
            json.dumps(self._cni_conflist(config), indent=2)
        )
        (self.conf_dir / "kubelet.yaml").write_text(
            yaml.safe_dump(self._kubelet_config(config), sort_keys=False)
        )
        ca = pki.CertificateAuthority.load(self.cluster.pki_dir)
        ca.issue(
            f"kubelet-{config.name}-serving",
            common_name=f"system:node:{config.name}",
            organizations=("system:nodes",),
            server=True,
            dns_names=(config.name, "localhost"),
            ips=(config.node_ip, "127.0.0.1"),
        )
        # The Node authorizer and NodeRestriction know a kubelet by this identity.
        self.cluster.write_kubeconfig(
            f"kubelet-{config.name}",
            user=f"system:node:{config.name}",
            groups=("system:nodes",),
        )

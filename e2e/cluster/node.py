"""A real node beside the control plane: containerd, kubelet and the drasil kubelet plugin.

`Cluster.start_node()` (or `python -m e2e.cluster up --with-node`) starts, on this
machine, with everything in the cluster's run directory:

    containerd/            containerd's root (content, snapshots), state and runc dirs
    containerd.sock        its socket (CRI, and `ctr`)
    kubelet ->             kubelet's --root-dir, /var/lib/drasil-e2e/<run id>/ (see
                           KUBELET_ROOT_BASE): plugins_registry/ and plugins/ (the DRA
                           plugin's sockets and checkpoint), pods/ (volumes), pki/
    cdi/                   the plugin's CDI root, one of containerd's cdi_spec_dirs
    pod-logs/              kubelet's podLogsDir (container logs, `kubectl logs`)
    node/                  containerd.toml, kubelet.yaml, CNI config and IPAM state
    device-plugin/         with `start_device_plugin`: the plugin's plugins dir in
                           device-plugin mode (its fault file)
    logs/{containerd,kubelet,drasil-plugin,drasil-device-plugin}.log

Outside it: kubelet's root dir, a cgroup `/drasil-e2e-<run id>` in every cgroup
hierarchy (kubelet's cgroupRoot: the node's Pods live under it and `down` finds every
process), a Linux bridge `drasil<hex>` whose address is the node IP, shim sockets in
/run/containerd/s and kubelet's hard-coded /var/log/containers links and
/var/lib/kubelet/device-plugins socket. `down` removes all of it, unmounts whatever
kubelet and containerd mounted, and checks that no process is left.

The kubelet is a real one: it registers `system:node:<name>` with its own client
certificate (so the Node authorizer and NodeRestriction apply), serves its API on the
node IP with a certificate from the cluster CA (so `kubectl logs/exec` work), and finds
the plugin through its plugin watcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

# A module import: e2e.pluginproc imports e2e.cluster (procs), which imports this.
from e2e import build, node_images, pluginproc, versions
from e2e.cluster import pki, procs

if TYPE_CHECKING:
    from e2e.cluster.control_plane import Cluster

NODE_NAME = "drasil-node"
NODE_COMPONENTS = ("containerd", "kubelet", "drasil-plugin")
DEFAULT_PROFILE = "h100-80gb:8"
# Unix socket paths are limited to 108 bytes (107 and the NUL); the plugin binds a
# temporary name 10 bytes longer first.
MAX_SOCKET_PATH = 97
POD_SUBNET_BASE = ipaddress.IPv4Network("10.244.0.0/16")
MNT_DETACH = 2
# Logged at -v=3 by kubelet's dra_plugin_manager.go (our --vmodule turns it on).
KUBELET_STARTUP_WIPE = '"Deleted ResourceSlices" logger="DRA registration handler.startup"'
# kubelet's --root-dir of each run is <this>/<run id>. Not under the run dir: the
# plugin's <root>/plugins_registry/gpu.drasil.dev-reg.sock must fit a unix socket path
# (the plugin allows 97 bytes, as it binds a temporary name first), and the cache dir
# alone can take half of that.
KUBELET_ROOT_BASE = Path("/var/lib/drasil-e2e")
# Host paths kubelet uses whatever its --root-dir (kubelet 1.37 hard-codes them).
CONTAINER_LOG_LINKS = "/var/log/containers"
DEVICE_PLUGIN_SOCKET = "/var/lib/kubelet/device-plugins/kubelet.sock"
DEVICE_CHECKPOINT = "kubelet_internal_checkpoint"  # kubelet's device manager, beside it
NOT_READY_TAINTS = frozenset({"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"})


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


def _tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return "\n".join(lines[-n:])


def cgroup_mounts() -> list[Path]:
    """Mount points of every cgroup (v1) and cgroup2 hierarchy."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fstype = post.split()[0] if post else ""
        if fstype in ("cgroup", "cgroup2"):
            found.append(Path(_unescape(pre.split()[4])))
    return found


def _unescape(path: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, char)
    return path


def mounts_under(root: Path) -> list[Path]:
    """Mount points at or below `root`, deepest (latest) first."""
    prefix = str(root).rstrip("/") + "/"
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = _unescape(line.split()[4])
        if point == str(root) or point.startswith(prefix):
            found.append(Path(point))
    return list(reversed(found))


def unmount_all(root: Path) -> list[str]:
    """Unmount everything under `root` (lazily when busy); returns what failed."""
    libc = ctypes.CDLL(None, use_errno=True)
    failed: list[str] = []
    for _ in range(5):  # stacked mounts need more than one pass
        points = mounts_under(root)
        if not points:
            return []
        failed = []
        for point in points:
            path = str(point).encode()
            if libc.umount2(path, 0) != 0 and libc.umount2(path, MNT_DETACH) != 0:
                failed.append(f"{point}: {os.strerror(ctypes.get_errno())}")
    return failed or [str(p) for p in mounts_under(root)]


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets: list[ipaddress.IPv4Network] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/route").read_text().splitlines()[1:]:
            fields = line.split()
            dest, mask = int(fields[1], 16), int(fields[7], 16)
            if mask == 0:
                continue
            addr = ipaddress.IPv4Address(dest.to_bytes(4, "little"))
            prefix = bin(mask).count("1")
            nets.append(ipaddress.IPv4Network(f"{addr}/{prefix}", strict=False))
    return nets


def pick_subnet(seed: str) -> str:
    """A /24 of 10.244.0.0/16 that no route of this machine overlaps (other runs'
    bridges included), starting from one derived from `seed`."""
    used = _used_networks()
    subnets = list(POD_SUBNET_BASE.subnets(new_prefix=24))
    start = int(hashlib.sha256(seed.encode()).hexdigest(), 16) % len(subnets)
    for i in range(len(subnets)):
        candidate = subnets[(start + i) % len(subnets)]
        if not any(candidate.overlaps(n) for n in used):
            return str(candidate)
    raise NodeError(f"no free /24 in {POD_SUBNET_BASE} for the Pod network")


class Node:
    """The node of one Cluster run. `Node(cluster)` attaches to the node recorded in
    the run's state (to stop or restart it from another process)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.run_dir = cluster.run_dir
        self._procs: dict[str, procs.Proc] = {}
        self._plugin: pluginproc.PluginProcess | None = None
        self._device_plugin: pluginproc.PluginProcess | None = None

    # -- where things are ---------------------------------------------------------

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

    @property
    def plugin(self) -> pluginproc.PluginProcess:
        """The drasil kubelet plugin beside this kubelet (started, stopped and killed
        through its pid file from any process)."""
        if self._plugin is None:
            self._plugin = self._plugin_process("drasil-plugin", root=self.kubelet_root)
        return self._plugin

    @property
    def device_plugin(self) -> pluginproc.PluginProcess:
        """drasil's plugin in device-plugin mode beside the DRA one, for the same
        simulated GPUs: it serves `drasil.dev/gpu` in kubelet's device-plugins/ dir.
        Started on demand (`start_device_plugin`); its own plugins dir keeps its fault
        file apart from the DRA plugin's."""
        if self._device_plugin is None:
            self._device_plugin = self._plugin_process(
                "drasil-device-plugin", root=self.run_dir / "device-plugin", mode="device-plugin"
            )
        return self._device_plugin

    def _plugin_process(
        self, component: str, *, root: Path, mode: str = "dra"
    ) -> pluginproc.PluginProcess:
        return pluginproc.PluginProcess(
            root=root,
            kubeconfig=self.cluster.kubeconfig,
            node_name=self.name,
            profile=self.config.profile,
            cdi_dir=self.cdi_dir,
            log_file=self.log(component),
            pid_file=self.cluster.pids_dir / f"{component}.pid",
            detach=True,
            die_with_parent=self.cluster.die_with_parent,
            mode=mode,
        )

    def _proc(self, name: str) -> procs.Proc | None:
        return self._procs.get(name) or procs.read_pid_file(self.cluster.pids_dir / f"{name}.pid")

    # -- configuration --------------------------------------------------------------

    def _containerd_toml(self) -> str:
        c = self.containerd_dir
        cdi_dirs = ["/etc/cdi", "/var/run/cdi", str(self.cdi_dir)]

        def q(value: str) -> str:
            return json.dumps(value)  # a TOML basic string is a JSON string

        def arr(values: Sequence[str]) -> str:
            return "[" + ", ".join(q(v) for v in values) + "]"

        return f"""\
# Written by e2e.cluster.node for {self.run_dir}
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
            "maxPods": 110,
        }

    def _kubelet_argv(self) -> list[str]:
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

    def _write_config(self, config: NodeConfig) -> None:
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

    def _make_cgroups(self, config: NodeConfig) -> None:
        for mount in cgroup_mounts():
            target = mount / config.cgroup_root
            target.mkdir(exist_ok=True)
            # A new cpuset cgroup starts with no CPUs and no memory nodes.
            for name in ("cpuset.cpus", "cpuset.mems"):
                mine, parent = target / name, mount / name
                if mine.exists() and not mine.read_text().strip():
                    mine.write_text(parent.read_text())

    # -- lifecycle ------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        bin_dir = str(self.bin("containerd").parent)
        path = os.environ.get(
            "PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        )
        # containerd finds containerd-shim-runc-v2 on PATH.
        return {"PATH": f"{bin_dir}:{path}", "HOME": str(self.run_dir), "LANG": "C.UTF-8"}

    def _start(self, name: str, argv: Sequence[str]) -> procs.Proc:
        proc = procs.spawn(
            name,
            argv,
            log=self.log(name),
            pid_file=self.cluster.pids_dir / f"{name}.pid",
            env=self._env(),
            die_with_parent=self.cluster.die_with_parent,
        )
        self._procs[name] = proc
        return proc

    def _wait(self, what: str, check: Callable[[], tuple[bool, str]], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for proc in self._procs.values():
                if not proc.alive():
                    raise NodeError(
                        f"{proc.name} exited while waiting for {what}; last lines of "
                        f"{self.log(proc.name)}:\n{_tail(self.log(proc.name))}"
                    )
            ok, last = check()
            if ok:
                return
            if time.monotonic() > deadline:
                raise NodeError(f"timed out after {timeout:.0f}s waiting for {what}: {last}")
            time.sleep(0.2)

    def ctr(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """`ctr --address <our socket> -n k8s.io <args>`."""
        return subprocess.run(
            [str(self.bin("ctr")), "--address", str(self.containerd_socket), "-n", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def _containerd_ready(self) -> tuple[bool, str]:
        if not self.containerd_socket.exists():
            return False, "no socket yet"
        done = self.ctr("version", timeout=10)
        return done.returncode == 0, (done.stderr or done.stdout).strip()[-300:]

    def _api(self, path: str) -> tuple[int, Any]:
        ctx = ssl.create_default_context(cafile=str(self.cluster.pki_dir / "ca.crt"))
        ctx.load_cert_chain(
            str(self.cluster.pki_dir / "admin.crt"), str(self.cluster.pki_dir / "admin.key")
        )
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(
                f"{self.cluster.server}{path}", timeout=5, context=ctx
            ) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (OSError, ValueError) as e:
            return 0, str(e)

    def _kubelet_healthy(self) -> tuple[bool, str]:
        import urllib.request

        try:
            port = self.config.healthz_port
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                return r.status == 200, f"/healthz: {r.status}"
        except OSError as e:
            return False, f"/healthz: {e}"

    def node_ready(self) -> tuple[bool, str]:
        """The Node object is Ready and carries no not-ready taint."""
        code, node = self._api(f"/api/v1/nodes/{self.name}")
        if code != 200:
            return False, f"GET node: {code} {str(node)[:200]}"
        conditions = {c["type"]: c for c in node.get("status", {}).get("conditions") or []}
        ready = conditions.get("Ready", {})
        taints = [t["key"] for t in node.get("spec", {}).get("taints") or []]
        if ready.get("status") != "True":
            return False, f"Ready={ready.get('status')}: {ready.get('message', '')}"
        if NOT_READY_TAINTS & set(taints):
            return False, f"Ready, still tainted {taints}"
        return True, "Ready"

    def devices_published(self, count: int | None) -> tuple[bool, str]:
        """(whether `count` devices of the plugin are published for this node, detail);
        `count` None: any."""
        code, body = self._api(
            f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName={self.name}"
        )
        if code != 200:
            return False, f"list ResourceSlices: {code}"
        devices = [
            d
            for s in body.get("items", [])
            if s["spec"].get("driver") == pluginproc.DRIVER
            for d in s["spec"].get("devices") or []
        ]
        if count is None:
            return bool(devices), f"{len(devices)} devices published"
        return len(devices) == count, f"{len(devices)} of {count} devices published"

    def startup_wipes(self) -> int:
        """How often a starting kubelet deleted this node's ResourceSlices (it does at
        every start, before any plugin can have registered)."""
        try:
            text = self.log("kubelet").read_text(errors="replace")
        except OSError:
            return 0
        return text.count(KUBELET_STARTUP_WIPE)

    def _wait_startup_wipe(self, *, after: int, timeout: float) -> None:
        # Otherwise the wipe may delete what the plugin has just published.
        self._wait(
            "kubelet's start-up deletion of the node's ResourceSlices",
            lambda: (self.startup_wipes() > after, f"{self.startup_wipes()} wipes logged"),
            timeout,
        )

    def registrations(self) -> int:
        """How often the plugin has been told by kubelet that it is registered."""
        return self.plugin.registrations()

    def wait_plugin_registered(self, *, after: int, timeout: float = 60.0) -> None:
        """Until kubelet's plugin watcher registered the plugin more than `after` times."""
        self.wait_registered(self.plugin, after=after, timeout=timeout)

    def wait_registered(
        self, plugin: pluginproc.PluginProcess, *, after: int, timeout: float = 60.0
    ) -> None:
        """Until kubelet registered `plugin` (either mode) more than `after` times."""
        self._wait(
            f"kubelet to register {plugin.log_path.stem}",
            lambda: (plugin.registrations() > after, f"{plugin.registrations()} registrations"),
            timeout,
        )

    def start(
        self, *, name: str = NODE_NAME, profile: str = DEFAULT_PROFILE, timeout: float = 180.0
    ) -> float:
        """Build what is missing, start containerd, kubelet and the plugin, wait until
        the Node is Ready and the plugin's devices are published; seconds taken."""
        started = time.monotonic()
        out = self.cluster._out
        build.ensure_binaries(build.NODE_BINARY_NAMES, out=out)
        build.ensure_host_tools(["ip"], out=out)
        imgs = node_images.ensure_images(out=out)
        run_id = self.run_dir.name
        digest = hashlib.sha256(str(self.run_dir).encode()).hexdigest()
        from e2e.cluster.control_plane import free_ports

        kubelet_port, healthz_port = free_ports(2)
        config = NodeConfig(
            name=name,
            profile=profile,
            kubelet_port=kubelet_port,
            healthz_port=healthz_port,
            cgroup_root=f"drasil-e2e-{run_id}",
            bridge=f"drasil{digest[:8]}",
            subnet=pick_subnet(run_id),
            kubelet_root=str(KUBELET_ROOT_BASE / run_id),
        )
        self.cluster._save_state(node={"config": asdict(config), "state": "starting"})
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(deadline - time.monotonic(), 1.0)

        self._write_config(config)
        self._make_cgroups(config)
        self._make_bridge(config)
        self._say(f"starting containerd ({self.containerd_socket})")
        self._start(
            "containerd",
            [str(self.bin("containerd")), f"--config={self.conf_dir / 'containerd.toml'}"],
        )
        self._wait("containerd to answer", self._containerd_ready, left())
        for image in imgs.values():
            done = self.ctr("images", "import", "--no-unpack=false", str(image.archive))
            if done.returncode != 0:
                done = self.ctr("images", "import", str(image.archive))
            if done.returncode != 0:
                raise NodeError(
                    f"ctr images import {image.archive} failed:\n{done.stderr or done.stdout}"
                )
        self._say(f"starting kubelet for Node {name} (root dir {self.kubelet_root})")
        self._start("kubelet", self._kubelet_argv())
        self._wait("kubelet /healthz", self._kubelet_healthy, left())
        self._wait(f"Node {name} Ready", self.node_ready, left())
        self._wait_startup_wipe(after=0, timeout=left())
        self._say(f"starting the drasil kubelet plugin ({profile})")
        self.plugin.start(timeout=left())
        self.wait_plugin_registered(after=0, timeout=left())
        count = _profile_size(profile)
        self._wait(
            f"the devices of {name} published",
            lambda: self.devices_published(count),
            left(),
        )
        seconds = time.monotonic() - started
        self.cluster._save_state(
            node={"config": asdict(config), "state": "up", "up_seconds": round(seconds, 2)}
        )
        return seconds

    def _say(self, msg: str) -> None:
        self.cluster._say(msg)

    def stop_kubelet(self) -> None:
        proc = self._proc("kubelet")
        if proc is not None and not procs.stop(proc, grace=10):
            raise NodeError(f"kubelet (pid {proc.pid}) did not stop")
        self._procs.pop("kubelet", None)

    def start_kubelet(self, *, timeout: float = 60.0) -> None:
        """Start kubelet (again) with the same configuration; waits for /healthz and
        for its start-up deletion of the node's ResourceSlices."""
        wipes = self.startup_wipes()
        self._start("kubelet", self._kubelet_argv())
        self._wait("kubelet /healthz", self._kubelet_healthy, timeout)
        self._wait_startup_wipe(after=wipes, timeout=timeout)

    def restart_kubelet(self, *, timeout: float = 60.0) -> None:
        """What a kubelet upgrade or crash looks like to the plugin and the Pods: the
        plugin must be registered again; running Pods keep running."""
        before = self.registrations()
        self.stop_kubelet()
        self.start_kubelet(timeout=timeout)
        self.wait_plugin_registered(after=before, timeout=timeout)

    def restart_plugin(self, *, kill: bool = True, timeout: float = 60.0) -> None:
        """kill -9 (or stop) the plugin and start it again; waits until registered."""
        before = self.registrations()
        if kill:
            self.plugin.kill()
        else:
            self.plugin.stop()
        self.plugin.start(timeout=timeout)
        self.wait_plugin_registered(after=before, timeout=timeout)

    # -- device-plugin mode -----------------------------------------------------------

    def extended_resource(self, name: str) -> tuple[int, int]:
        """(capacity, allocatable) of extended resource `name` in the Node's status."""
        code, node = self._api(f"/api/v1/nodes/{self.name}")
        if code != 200:
            raise NodeError(f"GET node {self.name}: {code} {str(node)[:200]}")
        status = node.get("status", {})
        return (
            int(status.get("capacity", {}).get(name, 0)),
            int(status.get("allocatable", {}).get(name, 0)),
        )

    def wait_extended_resource(
        self, name: str, *, capacity: int | None = None, allocatable: int, timeout: float = 60.0
    ) -> None:
        """Until the Node reports `allocatable` (and `capacity`, if given) of `name`."""

        def check() -> tuple[bool, str]:
            cap, alloc = self.extended_resource(name)
            ok = alloc == allocatable and capacity in (None, cap)
            return ok, f"capacity {cap}, allocatable {alloc}"

        want = f"allocatable {allocatable}" + (f", capacity {capacity}" if capacity else "")
        self._wait(f"Node {self.name} to report {name} {want}", check, timeout)

    def check_device_plugin_socket(self) -> None:
        """Our kubelet must own kubelet's hard-coded kubelet.sock: a second node run on
        this machine (a demo, another test session) takes it over when it starts."""
        kubelet = self._proc("kubelet")
        owners = socket_owners(Path(DEVICE_PLUGIN_SOCKET))
        if kubelet is None or kubelet.pid not in owners:
            raise NodeError(
                f"{DEVICE_PLUGIN_SOCKET} is served by pid(s) {sorted(owners) or 'none'}, not "
                f"by this node's kubelet ({kubelet.pid if kubelet else 'not running'}): "
                "another node run on this machine took it over (kubelet hard-codes the "
                "path); stop that run first"
            )

    def start_device_plugin(self, *, timeout: float = 60.0) -> None:
        """Start the device plugin and wait until kubelet registered it and the Node
        reports every device as allocatable `drasil.dev/gpu`."""
        self.check_device_plugin_socket()
        self._say(f"starting the drasil device plugin ({pluginproc.GPU_RESOURCE})")
        before = self.device_plugin.registrations()
        self.device_plugin.start(timeout=timeout)
        self.wait_registered(self.device_plugin, after=before, timeout=timeout)
        count = _profile_size(self.config.profile)
        if count is not None:
            self.wait_extended_resource(
                pluginproc.GPU_RESOURCE, capacity=count, allocatable=count, timeout=timeout
            )

    def stop_device_plugin(self, *, timeout: float = 60.0) -> None:
        """Stop it; kubelet then counts none of its devices as allocatable, so
        kube-scheduler serves `drasil.dev/gpu` on this node through DRA again."""
        self.device_plugin.stop()
        self.wait_extended_resource(pluginproc.GPU_RESOURCE, allocatable=0, timeout=timeout)

    def status(self) -> list[tuple[str, int | None, bool, bool, str]]:
        """(component, pid, alive, healthy, detail) of containerd, kubelet, plugin."""
        result = []
        for name in NODE_COMPONENTS:
            proc = self._proc(name)
            alive = proc is not None and proc.alive()
            if not alive:
                result.append((name, proc.pid if proc else None, False, False, ""))
                continue
            if name == "containerd":
                healthy, detail = self._containerd_ready()
                detail = "ctr version: ok" if healthy else detail
            elif name == "kubelet":
                healthy, detail = self._kubelet_healthy()
                if healthy:
                    ready, why = self.node_ready()
                    healthy, detail = ready, f"{detail}, Node {self.name}: {why}"
            else:
                healthy = self.plugin.reg_socket.exists() and self.plugin.dra_socket.exists()
                detail = f"{self.registrations()} registrations with kubelet"
            result.append((name, proc.pid if proc else None, alive, healthy, detail))
        if (dp := self.device_plugin.attached()) is not None:  # only when started
            try:
                cap, alloc = self.extended_resource(pluginproc.GPU_RESOURCE)
                detail = f"{pluginproc.GPU_RESOURCE}: capacity {cap}, allocatable {alloc}"
            except NodeError as e:
                detail = str(e)
            healthy = self.device_plugin.device_plugin_socket.is_socket()
            result.append(("drasil-device-plugin", dp.pid, True, healthy, detail))
        return result

    # -- teardown -------------------------------------------------------------------

    def _cgroup_dirs(self, config: NodeConfig) -> list[Path]:
        return [
            m / config.cgroup_root for m in cgroup_mounts() if (m / config.cgroup_root).is_dir()
        ]

    def _cgroup_pids(self, config: NodeConfig) -> set[int]:
        pids: set[int] = set()
        for top in self._cgroup_dirs(config):
            for dirpath, _, files in os.walk(top):
                if "cgroup.procs" in files:
                    with contextlib.suppress(OSError):
                        text = (Path(dirpath) / "cgroup.procs").read_text()
                        pids.update(int(p) for p in text.split())
        return pids

    def _kill_pods(self, config: NodeConfig, timeout: float = 15.0) -> list[int]:
        """SIGKILL every process in the node's cgroups (the Pods' containers and
        sandboxes) until none is left; returns those that would not die."""
        deadline = time.monotonic() + timeout
        while True:
            pids = self._cgroup_pids(config)
            if not pids:
                return []
            if time.monotonic() > deadline:
                return sorted(pids)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)

    def _remove_cgroups(self, config: NodeConfig) -> list[str]:
        failed = []
        for top in self._cgroup_dirs(config):
            for dirpath, _, _ in sorted(os.walk(top), key=lambda t: -len(t[0])):
                try:
                    os.rmdir(dirpath)
                except OSError as e:
                    failed.append(f"{dirpath}: {e.strerror}")
        return failed

    def _make_bridge(self, config: NodeConfig) -> None:
        prefix = ipaddress.ip_network(config.subnet).prefixlen
        steps = [
            ["ip", "link", "add", "name", config.bridge, "type", "bridge"],
            ["ip", "addr", "add", f"{config.node_ip}/{prefix}", "dev", config.bridge],
            ["ip", "link", "set", config.bridge, "up"],
        ]
        if Path(f"/sys/class/net/{config.bridge}").exists():
            steps = steps[2:]
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise NodeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")

    def _clean_host_paths(self) -> None:
        """What kubelet writes to fixed host paths whatever its --root-dir: symlinks to
        container logs in /var/log/containers, and in /var/lib/kubelet/device-plugins
        the registration socket and the device manager's checkpoint (left alone while
        a kubelet serves the socket, and the checkpoint if it names others' resources)."""
        logs = Path(CONTAINER_LOG_LINKS)
        for link in logs.glob("*.log") if logs.is_dir() else ():
            with contextlib.suppress(OSError):
                if link.is_symlink() and os.readlink(link).startswith(f"{self.pod_logs_dir}/"):
                    link.unlink()
        sock = Path(DEVICE_PLUGIN_SOCKET)
        if not _listening(sock):
            sock.unlink(missing_ok=True)
            if _only_drasil_resources(sock.parent / DEVICE_CHECKPOINT):
                (sock.parent / DEVICE_CHECKPOINT).unlink()
        for d in (logs, sock.parent, sock.parent.parent):
            with contextlib.suppress(OSError):
                d.rmdir()  # only when empty: then nothing else uses it

    def _delete_bridge(self, config: NodeConfig) -> None:
        if Path(f"/sys/class/net/{config.bridge}").exists():
            subprocess.run(
                ["ip", "link", "delete", config.bridge], capture_output=True, check=False
            )

    def down(self, *, grace: float = 10.0) -> list[str]:
        """Stop kubelet, the plugin, every Pod process and containerd; unmount what
        they mounted under the run dir; remove the node's cgroups and bridge.
        Idempotent. Returns what could not be cleaned up (empty when all is gone)."""
        try:
            config = self.config
        except NodeError:
            return []
        problems = []
        kubelet = self._proc("kubelet")
        if kubelet is not None and not procs.stop(kubelet, grace=grace):
            problems.append(f"kubelet (pid {kubelet.pid})")
        for plugin in (self.plugin, self.device_plugin):
            plugin.stop()
            if plugin.attached() is not None:
                problems.append(plugin.log_path.stem)
        stuck = self._kill_pods(config)
        problems += [f"pod process {pid}" for pid in stuck]
        containerd = self._proc("containerd")
        if containerd is not None and not procs.stop(containerd, grace=grace):
            problems.append(f"containerd (pid {containerd.pid})")
        for name in NODE_COMPONENTS:
            proc = self._proc(name)
            if proc is None or not proc.alive():
                (self.cluster.pids_dir / f"{name}.pid").unlink(missing_ok=True)
        self._procs.clear()
        # Shims (and anything else run from our binaries for this run) outlive
        # containerd by design.
        from e2e.cluster.control_plane import stop_strays

        problems += stop_strays(
            self.bin("containerd").parent,
            self.run_dir,
            grace=grace,
            names=("containerd", "containerd-shim-runc-v2", "runc", "ctr"),
        )
        left_mounted = unmount_all(self.run_dir) + unmount_all(self.kubelet_root)
        problems += [f"mount {m}" for m in left_mounted]
        if not left_mounted:
            # Pod volumes, kubelet's and the plugin's state: nothing outside the run dir
            # stays behind (the logs, CDI dir and configs are in the run dir).
            shutil.rmtree(self.kubelet_root, ignore_errors=True)
        problems += [f"cgroup {c}" for c in self._remove_cgroups(config)]
        self._delete_bridge(config)
        self._clean_host_paths()
        raw = self.cluster.state().get("node") or {}
        self.cluster._save_state(node={**raw, "state": "down"})
        return problems


def socket_owners(path: Path) -> set[int]:
    """The pids that hold the listening unix socket bound at `path` (via /proc)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == str(path):
                inodes.add(f"socket:[{fields[6]}]")
    owners = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd") if inodes else ():
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in fd_dir.iterdir()):
                owners.add(int(fd_dir.parent.name))
    return owners


def _only_drasil_resources(checkpoint: Path) -> bool:
    """Whether kubelet's device-manager checkpoint names only drasil.dev/* resources,
    so that it was written for our device plugin, not for a real kubelet's."""
    try:
        data = json.loads(checkpoint.read_text()).get("Data") or {}
    except (OSError, ValueError):
        return False
    names = set(data.get("RegisteredDevices") or {})
    names |= {e.get("ResourceName", "") for e in data.get("PodDeviceEntries") or []}
    return all(n.startswith("drasil.dev/") for n in names)


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def _profile_size(profile: str) -> int | None:
    """How many devices a simulated profile such as `h100-80gb:8,l4:2` publishes; None
    for MIG profiles (their partitions add devices)."""
    total = 0
    for part in profile.split(","):
        name, _, count = part.partition(":")
        if "mig" in name:
            return None
        total += int(count or 1)
    return total


def describe(node: Node) -> str:
    """Where things are, for the CLI and the demo."""
    cfg = node.config
    ctr = f"{node.bin('ctr')} --address {node.containerd_socket} -n k8s.io"
    lines = [
        f"node {cfg.name}: kubelet root {node.kubelet_root}, cgroup /{cfg.cgroup_root}, "
        f"Pod network {cfg.subnet} on bridge {cfg.bridge}",
        f"  plugin sockets: {node.plugin.reg_socket}, {node.plugin.dra_socket}",
        f"  CDI specs: {node.cdi_dir}; checkpoint: {node.plugin.state_dir / 'checkpoint.json'}",
        f"  containers: {ctr} containers ls",
    ]
    if node.device_plugin.running():
        dp = node.device_plugin
        lines.append(
            f"  device plugin: {dp.device_plugin_socket} ({pluginproc.GPU_RESOURCE}); "
            f"faults: drasil fault inject gpu-3 --plugins-dir {dp.plugins_dir}"
        )
    return "\n".join(lines)

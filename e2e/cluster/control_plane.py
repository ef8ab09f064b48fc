"""A real Kubernetes control plane on 127.0.0.1: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler, with DRA enabled.

Each `Cluster` owns one run directory (`<cache>/e2e/runs/<id>/`, see `e2e.paths`):

    cluster.json          ports, binaries, state, how long `up` took
    admin.kubeconfig      system:masters; what `env` prints and the tests use
    kubeconfigs/          one per component (and any made by write_kubeconfig)
    pki/                  CA, serving and client certs, service-account key
    logs/<component>.log  everything each component printed
    pids/<component>.pid  `<pid> <start time>` of what `up` started
    etcd-data/            removed by `down`

All listeners bind to 127.0.0.1 on ports picked free at `up`, so clusters run side by side.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from e2e import build, node_images, paths, versions
from e2e.cluster import pki, procs
from e2e.cluster.node import DEFAULT_PROFILE, NODE_NAME, Node, NodeError
from e2e.cluster.node import mounts_under as node_mounts

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
SERVICE_CIDR = "10.0.0.0/24"
KUBERNETES_SERVICE_IP = "10.0.0.1"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
STATE_FILE = "cluster.json"
KEEP_STOPPED_RUNS = 20
LOG_TAIL_LINES = 30
# The node-lifecycle controller marks a Node NotReady (and taints it) when its kubelet
# stops heartbeating. Test Nodes have no kubelet, so the grace period outlives any test
# run; Nodes with a real kubelet still get their not-ready taint removed once Ready.
NODE_GRACE_PERIOD = "8760h"


class ClusterError(RuntimeError):
    """The control plane could not be started, checked or stopped; says what and why."""


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    pid: int | None
    alive: bool
    healthy: bool
    detail: str


@dataclass(frozen=True)
class ClusterStatus:
    run_dir: Path
    state: str
    server: str | None
    components: tuple[ComponentStatus, ...]

    @property
    def running(self) -> bool:
        return bool(self.components) and all(c.alive and c.healthy for c in self.components)

    def format(self) -> str:
        lines = [f"run dir: {self.run_dir}", f"state:   {self.state}"]
        if self.server:
            lines.append(f"server:  {self.server}")
        for c in self.components:
            pid = str(c.pid) if c.pid else "-"
            alive = "running" if c.alive else "not running"
            lines.append(f"  {c.name:24} pid {pid:>8}  {alive:12} {c.detail}")
        return "\n".join(lines)


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports: all sockets stay bound until every port is picked."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return ports


def _tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return "\n".join(lines[-n:])


def _get(url: str, context: ssl.SSLContext | None, timeout: float = 2.0) -> tuple[int, str]:
    """(status, body) of a GET; (0, reason) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, ssl.SSLError) as e:
        return 0, str(getattr(e, "reason", e))


def _runs() -> list[tuple[float, Path, dict[str, Any]]]:
    """(created, run dir, state) of every run, oldest first."""
    root = paths.runs_dir()
    found = []
    for d in root.iterdir() if root.is_dir() else ():
        try:
            state = json.loads((d / STATE_FILE).read_text())
        except (OSError, ValueError):
            continue
        found.append((float(state.get("created", 0.0)), d, state))
    found.sort(key=lambda t: t[0])
    return found


def _live(run_dir: Path) -> bool:
    """Whether any process this run started still runs."""
    for pid_file in (run_dir / "pids").glob("*.pid"):
        proc = procs.read_pid_file(pid_file)
        if proc is not None and proc.alive():
            return True
    return False


def _prune_stopped_runs() -> None:
    # Stopped: taken down, failed, or whose processes all died without a `down` (e.g. the
    # Python that started them was killed); not one another `up` is starting right now.
    settled = time.time() - 600
    stopped = [
        (d, s)
        for created, d, s in _runs()
        if s.get("state") in ("down", "failed") or (created < settled and not _live(d))
    ]
    for created, d, state in _runs():
        node = state.get("node") or {}
        # A node whose processes all died without `down` (the Python that started it was
        # SIGKILLed, so they died with it): its Pods' processes (the shims' children),
        # mounts, cgroups and bridge are still there. "up" means its processes ran.
        dead = node.get("state") == "up" or (node.get("state") == "starting" and created < settled)
        if dead and not _live(d):
            with contextlib.suppress(Exception):
                Node(Cluster(d)).down(grace=2.0)
    for d, _ in stopped[:-KEEP_STOPPED_RUNS]:
        if not node_mounts(d):  # rmtree must never walk into a mount
            shutil.rmtree(d, ignore_errors=True)
    # Run dirs of an `up` that failed before it wrote any state (e.g. the build failed).
    hour_ago = time.time() - 3600
    for d in paths.runs_dir().iterdir():
        with contextlib.suppress(OSError):
            if not (d / STATE_FILE).exists() and d.stat().st_mtime < hour_ago:
                shutil.rmtree(d, ignore_errors=True)


def _new_run_dir() -> Path:
    root = paths.runs_dir()
    root.mkdir(parents=True, exist_ok=True)
    _prune_stopped_runs()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        d = root / f"{stamp}-{os.getpid()}-{n}"
        try:
            d.mkdir()
        except FileExistsError:
            continue
        return d
    raise ClusterError(f"cannot create a run directory under {root}")


def stop_strays(
    bin_dir: Path, run_dir: Path, *, grace: float, names: Collection[str] | None = None
) -> list[str]:
    """Stop what `_strays` finds (only binaries called `names`, if given); returns
    those still running."""
    leftovers = []
    for pid in _strays(bin_dir, run_dir, names):
        start = procs.start_time(pid)
        if start is not None and not procs.stop(procs.Proc(f"pid {pid}", pid, start), grace=grace):
            leftovers.append(f"pid {pid}")
    return leftovers


def _strays(bin_dir: Path, run_dir: Path, names: Collection[str] | None = None) -> list[int]:
    """Pids running one of our binaries with our run dir in their arguments: a process
    of this run that has no pid file (`down` must not leave it behind)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            exe = os.readlink(entry / "exe")
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if not exe.startswith(f"{bin_dir}/") or str(run_dir) not in cmdline:
            continue
        if names is None or Path(exe.removesuffix(" (deleted)")).name in names:
            found.append(int(entry.name))
    return found


class Cluster:
    """One control plane and its run directory.

    `Cluster()` makes a new run directory; `Cluster(run_dir)` attaches to an existing one
    (for `down`, `status`, `env` from another process); `Cluster.latest()` finds the newest.
    """

    def __init__(
        self,
        run_dir: Path | str | None = None,
        *,
        die_with_parent: bool = False,
        out: TextIO | None = None,
    ) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else _new_run_dir()
        self.die_with_parent = die_with_parent
        self._out = out
        self._procs: dict[str, procs.Proc] = {}
        self._node: Node | None = None

    # -- where things are -------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.run_dir / "admin.kubeconfig"

    @property
    def pki_dir(self) -> Path:
        return self.run_dir / "pki"

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def pids_dir(self) -> Path:
        return self.run_dir / "pids"

    @property
    def kubeconfigs_dir(self) -> Path:
        return self.run_dir / "kubeconfigs"

    @property
    def etcd_data_dir(self) -> Path:
        return self.run_dir / "etcd-data"

    def log(self, component: str) -> Path:
        return self.logs_dir / f"{component}.log"

    def state(self) -> dict[str, Any]:
        try:
            data = json.loads((self.run_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports.apiserver}"

    @property
    def ports(self) -> Ports:
        raw = self.state().get("ports")
        if not raw:
            raise ClusterError(f"{self.run_dir} has no {STATE_FILE} with ports: never started?")
        return Ports(**raw)

    def bin(self, name: str) -> Path:
        """A binary of the pinned release (the one this cluster runs, if it ran)."""
        return Path(self.state().get("bin_dir") or paths.bin_dir()) / name

    @classmethod
    def latest(cls) -> Cluster | None:
        """The newest run with a process still running, else the newest run at all."""
        runs = _runs()
        live = [d for _, d, s in runs if s.get("state") not in ("down", "failed") and _live(d)]
        if live:
            return cls(live[-1])
        return cls(runs[-1][1]) if runs else None

    # -- lifecycle --------------------------------------------------------------------

    def _say(self, msg: str) -> None:
        if self._out is not None:
            print(f"e2e.cluster: {msg}", file=self._out, flush=True)

    def _save_state(self, **changes: Any) -> None:
        state = self.state()
        state.update(changes)
        tmp = self.run_dir / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
        os.replace(tmp, self.run_dir / STATE_FILE)

    def _component_env(self) -> dict[str, str]:
        # Nothing of the caller's environment leaks in (etcd reads ETCD_* variables).
        return {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": str(self.run_dir),
            "LANG": "C.UTF-8",
        }

    def _start(self, name: str, argv: Sequence[str]) -> procs.Proc:
        proc = procs.spawn(
            name,
            argv,
            log=self.log(name),
            pid_file=self.pids_dir / f"{name}.pid",
            env=self._component_env(),
            die_with_parent=self.die_with_parent,
        )
        self._procs[name] = proc
        return proc

    def _client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki_dir / "ca.crt"))
        ctx.load_cert_chain(str(self.pki_dir / "admin.crt"), str(self.pki_dir / "admin.key"))
        return ctx

    @staticmethod
    def _unverified_context() -> ssl.SSLContext:
        # Scheduler and controller-manager serve /healthz with a self-signed cert on
        # loopback; their health is all we ask them.
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def _health_checks(self) -> dict[str, Callable[[], tuple[bool, str]]]:
        ports = self.ports

        def etcd() -> tuple[bool, str]:
            code, body = _get(f"http://127.0.0.1:{ports.etcd_client}/health", None)
            return code == 200 and '"true"' in body, f"/health: {code or body}"

        def apiserver() -> tuple[bool, str]:
            code, body = _get(f"{self.server}/readyz", self._client_context())
            if code == 200:
                return True, "/readyz: ok"
            failing = [ln for ln in body.splitlines() if "failed" in ln]
            return False, f"/readyz: {code or body} {' '.join(failing)}".strip()

        def healthz(port: int) -> Callable[[], tuple[bool, str]]:
            def check() -> tuple[bool, str]:
                code, body = _get(f"https://127.0.0.1:{port}/healthz", self._unverified_context())
                return code == 200, f"/healthz: {code or body}"

            return check

        return {
            "etcd": etcd,
            "kube-apiserver": apiserver,
            "kube-controller-manager": healthz(ports.controller_manager),
            "kube-scheduler": healthz(ports.scheduler),
        }

    def _wait(self, what: str, check: Callable[[], tuple[bool, str]], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            for proc in self._procs.values():
                if not proc.alive():
                    raise ClusterError(
                        f"{proc.name} exited while waiting for {what}; "
                        f"last lines of {self.log(proc.name)}:\n{_tail(self.log(proc.name))}"
                    )
            ok, last = check()
            if ok:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}: {last}")
            time.sleep(0.1)

    def _write_pki(self, ports: Ports) -> None:
        ca = pki.CertificateAuthority.create(self.pki_dir)
        apiserver = ca.issue(
            "apiserver",
            common_name="kube-apiserver",
            server=True,
            dns_names=(
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
            ips=("127.0.0.1", "::1", KUBERNETES_SERVICE_IP),
        )
        del apiserver  # its paths are fixed; kept for readability of the call above
        # The front proxy (aggregation layer) has its own CA. Nothing aggregated runs
        # here, but without it every component that delegates authentication logs an
        # error about the missing request-header CA.
        front_proxy = pki.CertificateAuthority.create(
            self.pki_dir, name="front-proxy-ca", common_name="drasil-e2e-front-proxy-ca"
        )
        front_proxy.issue("front-proxy-client", common_name="front-proxy-client", client=True)
        ca.issue(
            "apiserver-kubelet-client",
            common_name="kube-apiserver-kubelet-client",
            organizations=("system:masters",),
            client=True,
        )
        pki.write_service_account_key(self.pki_dir)
        server = f"https://127.0.0.1:{ports.apiserver}"
        for name, cn, orgs in (
            ("admin", "kubernetes-admin", ("system:masters",)),
            ("kube-controller-manager", "system:kube-controller-manager", ()),
            ("kube-scheduler", "system:kube-scheduler", ()),
        ):
            client = ca.issue(name, common_name=cn, organizations=orgs, client=True)
            target = (
                self.kubeconfig if name == "admin" else self.kubeconfigs_dir / f"{name}.kubeconfig"
            )
            pki.write_kubeconfig(
                target, server=server, ca=ca.pair, client=client, user=cn, cluster="drasil-e2e"
            )

    def write_kubeconfig(self, name: str, *, user: str, groups: Sequence[str] = ()) -> Path:
        """A kubeconfig for any identity, e.g. `system:node:<node>` in `system:nodes`
        for a kubelet, with a client cert from this run's CA."""
        ca = pki.CertificateAuthority.load(self.pki_dir)
        client = ca.issue(name, common_name=user, organizations=groups, client=True)
        return pki.write_kubeconfig(
            self.kubeconfigs_dir / f"{name}.kubeconfig",
            server=self.server,
            ca=ca.pair,
            client=client,
            user=user,
            cluster="drasil-e2e",
        )

    def _argv(self, name: str, bins: dict[str, Path], ports: Ports) -> list[str]:
        p = self.pki_dir
        gates = ",".join(f"{k}={str(v).lower()}" for k, v in versions.FEATURE_GATES.items())
        if name == "etcd":
            client = f"http://127.0.0.1:{ports.etcd_client}"
            peer = f"http://127.0.0.1:{ports.etcd_peer}"
            return [
                str(bins["etcd"]),
                "--name=e2e",
                f"--data-dir={self.etcd_data_dir}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=e2e={peer}",
                "--initial-cluster-state=new",
                # A test cluster's data is thrown away; fsync only costs time.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ]
        if name == "kube-apiserver":
            runtime = ",".join(f"{k}={str(v).lower()}" for k, v in versions.RUNTIME_CONFIG.items())
            return [
                str(bins["kube-apiserver"]),
                f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                # The endpoint reconciler refuses loopback addresses, and nothing in
                # the cluster routes to the kubernetes Service without kube-proxy anyway.
                "--endpoint-reconciler-type=none",
                f"--secure-port={ports.apiserver}",
                f"--cert-dir={self.run_dir / 'kube-apiserver'}",
                f"--tls-cert-file={p / 'apiserver.crt'}",
                f"--tls-private-key-file={p / 'apiserver.key'}",
                f"--client-ca-file={p / 'ca.crt'}",
                f"--kubelet-client-certificate={p / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={p / 'apiserver-kubelet-client.key'}",
                f"--requestheader-client-ca-file={p / 'front-proxy-ca.crt'}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-uid-headers=X-Remote-Uid",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={p / 'front-proxy-client.crt'}",
                f"--proxy-client-key-file={p / 'front-proxy-client.key'}",
                # A real kubelet (the node) serves on 127.0.0.1 with a cert from our
                # CA; its Hostname address does not resolve.
                f"--kubelet-certificate-authority={p / 'ca.crt'}",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=true",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={p / 'sa.pub'}",
                f"--service-account-signing-key-file={p / 'sa.key'}",
                f"--feature-gates={gates}",
                f"--runtime-config={runtime}",
                "--profiling=false",
                "--v=2",
            ]
        kubeconfig = self.kubeconfigs_dir / f"{name}.kubeconfig"
        common = [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--cert-dir={self.run_dir / name}",
            "--leader-elect=false",
            f"--feature-gates={gates}",
            "--profiling=false",
            "--v=2",
        ]
        if name == "kube-controller-manager":
            return [
                str(bins[name]),
                *common,
                f"--secure-port={ports.controller_manager}",
                # Every default controller, and explicitly the two DRA needs most.
                "--controllers=*,resourceclaim-controller,serviceaccount-token-controller",
                "--use-service-account-credentials=true",
                f"--root-ca-file={p / 'ca.crt'}",
                f"--service-account-private-key-file={p / 'sa.key'}",
                f"--cluster-signing-cert-file={p / 'ca.crt'}",
                f"--cluster-signing-key-file={p / 'ca.key'}",
                f"--node-monitor-grace-period={NODE_GRACE_PERIOD}",
                f"--node-startup-grace-period={NODE_GRACE_PERIOD}",
            ]
        if name == "kube-scheduler":
            return [str(bins[name]), *common, f"--secure-port={ports.scheduler}"]
        raise ValueError(name)

    # -- the node -----------------------------------------------------------------------

    @property
    def node(self) -> Node | None:
        """The real node (containerd, kubelet, plugin) of this run, if one was started."""
        if self._node is None and self.state().get("node"):
            self._node = Node(self)
        return self._node

    def start_node(
        self, *, name: str = NODE_NAME, profile: str = DEFAULT_PROFILE, timeout: float = 180.0
    ) -> Node:
        """Start containerd, kubelet and the drasil plugin beside this control plane and
        wait until the Node is Ready and its devices are published. On failure the node
        is stopped again and ClusterError says what failed."""
        if self.state().get("state") != "up":
            raise ClusterError(f"{self.run_dir}: the control plane is not up")
        if (self.state().get("node") or {}).get("state") in ("starting", "up"):
            raise ClusterError(f"{self.run_dir} already has a node")
        node = self._node = Node(self)
        try:
            seconds = node.start(name=name, profile=profile, timeout=timeout)
        except BaseException as e:
            problems = node.down()
            self._save_state(node={**(self.state().get("node") or {}), "state": "failed"})
            if isinstance(e, NodeError):
                extra = f"\n(and after stopping it: {', '.join(problems)})" if problems else ""
                raise ClusterError(f"node {name}: {e}{extra}") from e
            raise
        self._say(f"node {name} up in {seconds:.1f}s")
        return node

    def up(
        self,
        *,
        timeout: float = 120.0,
        with_node: bool = False,
        node_profile: str = DEFAULT_PROFILE,
    ) -> float:
        """Build what is missing, start everything, wait until healthy; seconds taken.
        With `with_node`, also a real node (`start_node`).

        On failure everything started is stopped again and ClusterError says which
        component failed, with the tail of its log.
        """
        if self.state().get("state") in ("starting", "up"):
            raise ClusterError(f"{self.run_dir} is already {self.state()['state']}")
        started = time.monotonic()
        progress = self._out if self._out is not None else sys.stderr
        bins = build.ensure_binaries(
            [*COMPONENTS, "kubectl", *(build.NODE_BINARY_NAMES if with_node else ())],
            out=progress,
        )
        if with_node:
            node_images.ensure_images(out=progress)
        built = time.monotonic() - started
        ports = Ports(*free_ports(5))
        for d in (self.pki_dir, self.logs_dir, self.pids_dir, self.kubeconfigs_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._save_state(
            kubernetes=versions.KUBERNETES,
            etcd=versions.ETCD,
            created=time.time(),
            bin_dir=str(paths.bin_dir()),
            ports=asdict(ports),
            server=f"https://127.0.0.1:{ports.apiserver}",
            kubeconfig=str(self.kubeconfig),
            state="starting",
        )
        try:
            self._write_pki(ports)
            checks = self._health_checks()
            deadline = time.monotonic() + timeout

            def left() -> float:
                return max(deadline - time.monotonic(), 1.0)

            self._say(f"starting etcd on 127.0.0.1:{ports.etcd_client}")
            self._start("etcd", self._argv("etcd", bins, ports))
            self._wait("etcd /health", checks["etcd"], left())
            self._say(f"starting kube-apiserver on {self.server}")
            self._start("kube-apiserver", self._argv("kube-apiserver", bins, ports))
            self._wait("kube-apiserver /readyz", checks["kube-apiserver"], left())
            for name in ("kube-controller-manager", "kube-scheduler"):
                self._say(f"starting {name}")
                self._start(name, self._argv(name, bins, ports))
            self._wait(
                "kube-controller-manager /healthz", checks["kube-controller-manager"], left()
            )
            self._wait("kube-scheduler /healthz", checks["kube-scheduler"], left())
            # The service-account controllers run once this exists; pods need it.
            self._wait("ServiceAccount default/default", self._default_sa_exists, left())
        except BaseException:
            # Also on KeyboardInterrupt: nothing we started may outlive a failed `up`.
            self._save_state(state="failed")
            with contextlib.suppress(ClusterError):
                self.down()
            self._save_state(state="failed")
            raise
        seconds = time.monotonic() - started
        self._save_state(state="up", up_seconds=round(seconds, 2), build_seconds=round(built, 2))
        if with_node:
            try:
                self.start_node(profile=node_profile)
            except BaseException:
                with contextlib.suppress(ClusterError):
                    self.down()
                self._save_state(state="failed")
                raise
            seconds = time.monotonic() - started
            self._save_state(up_seconds=round(seconds, 2))
        return seconds

    def _default_sa_exists(self) -> tuple[bool, str]:
        code, body = _get(
            f"{self.server}/api/v1/namespaces/default/serviceaccounts/default",
            self._client_context(),
        )
        return code == 200, f"GET serviceaccounts/default: {code or body}"

    def _known_procs(self) -> list[procs.Proc]:
        found = []
        for name in COMPONENTS:
            proc = self._procs.get(name) or procs.read_pid_file(self.pids_dir / f"{name}.pid")
            if proc is not None:
                found.append(proc)
        return found

    def down(self, *, grace: float = 10.0) -> None:
        """Stop every process of this run (reverse start order, SIGTERM then SIGKILL),
        check that none is left, remove pid files and etcd data. Idempotent."""
        leftovers = []
        node = self.node
        if node is not None:
            # First, while the API server still answers: kubelet, plugin, Pods,
            # containerd, mounts, cgroups.
            leftovers += node.down(grace=grace)
        for proc in reversed(self._known_procs()):
            if not procs.stop(proc, grace=grace):
                leftovers.append(f"{proc.name} (pid {proc.pid})")
        # Anything else still naming our run dir was started by us too.
        leftovers += stop_strays(self.bin("etcd").parent, self.run_dir, grace=grace)
        if leftovers:
            raise ClusterError(f"still running after down: {', '.join(leftovers)}")
        self._procs.clear()
        for pid_file in self.pids_dir.glob("*.pid"):
            pid_file.unlink(missing_ok=True)
        shutil.rmtree(self.etcd_data_dir, ignore_errors=True)
        if self.state():
            self._save_state(state="down")

    def status(self) -> ClusterStatus:
        state = self.state()
        checks = self._health_checks() if state.get("ports") else {}
        components = []
        for name in COMPONENTS:
            proc = procs.read_pid_file(self.pids_dir / f"{name}.pid")
            alive = proc is not None and proc.alive()
            healthy, detail = checks[name]() if alive and name in checks else (False, "")
            components.append(
                ComponentStatus(name, proc.pid if proc else None, alive, healthy, detail)
            )
        node = self.node
        if node is not None and (state.get("node") or {}).get("state") != "down":
            for name, pid, alive, healthy, detail in node.status():
                components.append(ComponentStatus(name, pid, alive, healthy, detail))
        return ClusterStatus(
            run_dir=self.run_dir,
            state=str(state.get("state", "unknown")),
            server=state.get("server"),
            components=tuple(components),
        )


@contextlib.contextmanager
def running_cluster(**kwargs: Any) -> Iterator[Cluster]:
    """`with running_cluster() as c:` starts a cluster and always takes it down."""
    cluster = Cluster(**kwargs)
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()

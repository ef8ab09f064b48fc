"""A real Kubernetes control plane on 127.0.0.1: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler, with DRA enabled.

Each `Cluster` owns one run directory (`e2e.harness.cluster.rundir`: its layout, its state
file, finding runs again). All listeners bind to 127.0.0.1 on ports picked free at
`up`, so clusters run side by side.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import ssl
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from e2e.harness import binaries, node_images, paths, procs, recipes, versions
from e2e.harness.cluster import pki, rundir
from e2e.harness.cluster.fleet import DEFAULT_FLEET_PROFILE, KwokFleet
from e2e.harness.cluster.host import free_ports, mounts_under
from e2e.harness.cluster.node import DEFAULT_PROFILE, NODE_NAME, Node, NodeError
from e2e.harness.cluster.nodeconfig import possible_node_ips
from e2e.harness.cluster.rundir import STATE_FILE, ClusterError, Ports, RunDir, http_get

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
SERVICE_CIDR = "10.0.0.0/24"
KUBERNETES_SERVICE_IP = "10.0.0.1"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
KEEP_STOPPED_RUNS = 20
# The node-lifecycle controller marks a Node NotReady (and taints it) when its kubelet
# stops heartbeating. Test Nodes have no kubelet, so the grace period outlives any test
# run; Nodes with a real kubelet still get their not-ready taint removed once Ready.
NODE_GRACE_PERIOD = "8760h"
# With a fleet, kube-controller-manager and kube-scheduler talk to the API server at up
# to this many requests per second (their defaults: 20 and 50).
FLEET_API_QPS = 500
# With a fleet (`up --fake-nodes`), the API server logs every write, with its user and
# user agent, to logs/audit.log: bench/scale.py tells drasil's writes from the others'.
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  verbs: [create, update, patch, delete, deletecollection]
- level: None
"""


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


def _prune_stopped_runs() -> None:
    """Clean up after runs of any checkout that nobody took down, and drop all but the
    newest KEEP_STOPPED_RUNS stopped runs."""
    # Stopped: taken down, failed, or whose processes all died without a `down` (e.g. the
    # Python that started them was killed); not one another `up` is starting right now.
    settled = time.time() - 600
    found = rundir.runs()
    stopped = [
        r
        for r in found
        if r.state.get("state") in ("down", "failed")
        or (r.created < settled and not rundir.live(r.path))
    ]
    for r in found:
        node = r.state.get("node") or {}
        # A node whose processes all died without `down` (the Python that started it was
        # SIGKILLed, so they died with it): its Pods' processes (the shims' children),
        # mounts, cgroups and bridge are still there. "up" means its processes ran.
        state = node.get("state")
        dead = state == "up" or (state == "starting" and r.created < settled)
        if dead and not rundir.live(r.path):
            with contextlib.suppress(Exception):
                Node(RunDir(r.path)).down(grace=2.0)
    for r in stopped[:-KEEP_STOPPED_RUNS]:
        if not mounts_under(r.path):  # rmtree must never walk into a mount
            shutil.rmtree(r.path, ignore_errors=True)
    # Run dirs of an `up` that failed before it wrote any state (e.g. the build failed).
    hour_ago = time.time() - 3600
    for d in paths.runs_dir().iterdir():
        with contextlib.suppress(OSError):
            if not (d / STATE_FILE).exists() and d.stat().st_mtime < hour_ago:
                shutil.rmtree(d, ignore_errors=True)


def _new_run_dir() -> Path:
    paths.runs_dir().mkdir(parents=True, exist_ok=True)
    _prune_stopped_runs()
    return rundir.new_run_dir()


class Cluster(RunDir):
    """One control plane and its run directory.

    `Cluster()` makes a new run directory; `Cluster(run_dir)` attaches to an existing one
    (for `down`, `status`, `env` from another process); `Cluster.latest()` finds the
    newest run of this checkout.
    """

    def __init__(
        self,
        run_dir: Path | str | None = None,
        *,
        die_with_parent: bool = False,
        out: TextIO | None = None,
    ) -> None:
        super().__init__(
            run_dir if run_dir is not None else _new_run_dir(),
            die_with_parent=die_with_parent,
            out=out,
        )
        self._procs: dict[str, procs.Proc] = {}
        self._node: Node | None = None
        self._audit = False

    @classmethod
    def latest(cls) -> Cluster | None:
        """The newest run of this checkout with a process still running, else its
        newest run at all (see `rundir.latest`)."""
        found = rundir.latest()
        return cls(found) if found is not None else None

    # -- lifecycle --------------------------------------------------------------------

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
            pid_file=self.pid_file(name),
            env=self._component_env(),
            die_with_parent=self.die_with_parent,
        )
        self._procs[name] = proc
        return proc

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
            code, body = http_get(f"http://127.0.0.1:{ports.etcd_client}/health", None)
            return code == 200 and '"true"' in body, f"/health: {code or body}"

        def apiserver() -> tuple[bool, str]:
            code, body = self.api_get("/readyz")
            if code == 200:
                return True, "/readyz: ok"
            failing = [ln for ln in body.splitlines() if "failed" in ln]
            return False, f"/readyz: {code or body} {' '.join(failing)}".strip()

        def healthz(port: int) -> Callable[[], tuple[bool, str]]:
            def check() -> tuple[bool, str]:
                url = f"https://127.0.0.1:{port}/healthz"
                code, body = http_get(url, self._unverified_context())
                return code == 200, f"/healthz: {code or body}"

            return check

        return {
            "etcd": etcd,
            "kube-apiserver": apiserver,
            "kube-controller-manager": healthz(ports.controller_manager),
            "kube-scheduler": healthz(ports.scheduler),
        }

    def _wait(self, what: str, check: Callable[[], tuple[bool, str]], timeout: float) -> None:
        procs.wait_until(
            what,
            check,
            timeout,
            watching=self._procs.values(),
            log=self.log,
            error=ClusterError,
            interval=0.1,
        )

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
            # Every node IP too: Pods on the Pod network reach it there through a relay
            # (e2e.harness.apirelay).
            ips=("127.0.0.1", "::1", KUBERNETES_SERVICE_IP, *possible_node_ips()),
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
                *self._audit_args(),
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
                *self._fleet_qps(),
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
            return [
                str(bins[name]),
                *common,
                *self._fleet_qps(),
                f"--secure-port={ports.scheduler}",
            ]
        raise ValueError(name)

    def _fleet_qps(self) -> list[str]:
        """With a fleet: the client QPS of the controller-manager and the scheduler
        raised, as large clusters run them. At the defaults (20 and 50) the claim
        controller (2 writes per Pod) and the scheduler (about 5) cap everything at 10
        Pods/s, whatever drasil does (docs/scale.md)."""
        if not self._audit:  # set together: a cluster with a fleet
            return []
        return [f"--kube-api-qps={FLEET_API_QPS}", f"--kube-api-burst={2 * FLEET_API_QPS}"]

    def _audit_args(self) -> list[str]:
        if not self._audit:
            return []
        policy = self.run_dir / "audit-policy.yaml"
        policy.write_text(AUDIT_POLICY)
        return [
            f"--audit-policy-file={policy}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            "--audit-log-maxsize=0",  # never rotated: a benchmark reads the whole window
            "--audit-log-mode=batch",
        ]

    @property
    def audit_log(self) -> Path:
        return self.logs_dir / "audit.log"

    # -- the fleet ----------------------------------------------------------------------

    @property
    def fleet(self) -> KwokFleet | None:
        """KWOK, its fake Nodes and the fleet publisher, if this run has them."""
        return KwokFleet(self) if self.state().get("fleet") else None

    def start_fleet(self, count: int, *, profile: str = DEFAULT_FLEET_PROFILE) -> KwokFleet:
        """KWOK, `count` fake Nodes and one publisher of their pools (e2e.harness.cluster.fleet)."""
        fleet = KwokFleet(self)
        try:
            seconds = fleet.start(count, profile=profile)
        except BaseException:
            fleet.down(grace=5.0)
            raise
        self.say(f"fleet of {count} fake nodes up in {seconds:.1f}s")
        return fleet

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
            self.save_state(node={**(self.state().get("node") or {}), "state": "failed"})
            if isinstance(e, NodeError):
                extra = f"\n(and after stopping it: {', '.join(problems)})" if problems else ""
                raise ClusterError(f"node {name}: {e}{extra}") from e
            raise
        self.say(f"node {name} up in {seconds:.1f}s")
        return node

    def up(
        self,
        *,
        timeout: float = 120.0,
        with_node: bool = False,
        node_profile: str = DEFAULT_PROFILE,
        fake_nodes: int = 0,
        fleet_profile: str = DEFAULT_FLEET_PROFILE,
    ) -> float:
        """Build what is missing, start everything, wait until healthy; seconds taken.
        With `with_node`, also a real node (`start_node`); with `fake_nodes`, a fleet
        of that many KWOK nodes and their publisher (`start_fleet`), and an audit log.

        On failure everything started is stopped again and ClusterError says which
        component failed, with the tail of its log.
        """
        if self.state().get("state") in ("starting", "up"):
            raise ClusterError(f"{self.run_dir} is already {self.state()['state']}")
        started = time.monotonic()
        progress = self.out if self.out is not None else sys.stderr
        self._audit = fake_nodes > 0
        bins = binaries.ensure_binaries(
            [
                *COMPONENTS,
                "kubectl",
                *(recipes.NODE_BINARY_NAMES if with_node else ()),
                *(("kwok", "helm") if fake_nodes else ()),
            ],
            out=progress,
        )
        if with_node:
            node_images.ensure_images(out=progress)
        built = time.monotonic() - started
        ports = Ports(*free_ports(5))
        for d in (self.pki_dir, self.logs_dir, self.pids_dir, self.kubeconfigs_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.save_state(
            kubernetes=versions.KUBERNETES,
            etcd=versions.ETCD,
            created=time.time(),
            bin_dir=str(paths.bin_dir()),
            ports=asdict(ports),
            server=f"https://127.0.0.1:{ports.apiserver}",
            kubeconfig=str(self.kubeconfig),
            checkout=str(paths.CHECKOUT),
            state="starting",
        )
        try:
            self._write_pki(ports)
            checks = self._health_checks()
            deadline = time.monotonic() + timeout

            def left() -> float:
                return max(deadline - time.monotonic(), 1.0)

            self.say(f"starting etcd on 127.0.0.1:{ports.etcd_client}")
            self._start("etcd", self._argv("etcd", bins, ports))
            self._wait("etcd /health", checks["etcd"], left())
            self.say(f"starting kube-apiserver on {self.server}")
            self._start("kube-apiserver", self._argv("kube-apiserver", bins, ports))
            self._wait("kube-apiserver /readyz", checks["kube-apiserver"], left())
            for name in ("kube-controller-manager", "kube-scheduler"):
                self.say(f"starting {name}")
                self._start(name, self._argv(name, bins, ports))
            self._wait(
                "kube-controller-manager /healthz", checks["kube-controller-manager"], left()
            )
            self._wait("kube-scheduler /healthz", checks["kube-scheduler"], left())
            # The service-account controllers run once this exists; pods need it.
            self._wait("ServiceAccount default/default", self._default_sa_exists, left())
        except BaseException:
            # Also on KeyboardInterrupt: nothing we started may outlive a failed `up`.
            self.save_state(state="failed")
            with contextlib.suppress(ClusterError):
                self.down()
            self.save_state(state="failed")
            raise
        seconds = time.monotonic() - started
        self.save_state(state="up", up_seconds=round(seconds, 2), build_seconds=round(built, 2))
        extras: list[Callable[[], object]] = []
        if with_node:
            extras.append(lambda: self.start_node(profile=node_profile))
        if fake_nodes:
            extras.append(lambda: self.start_fleet(fake_nodes, profile=fleet_profile))
        for start in extras:
            try:
                start()
            except BaseException:
                with contextlib.suppress(ClusterError):
                    self.down()
                self.save_state(state="failed")
                raise
            seconds = time.monotonic() - started
            self.save_state(up_seconds=round(seconds, 2))
        return seconds

    def restart_apiserver(self, *, down_seconds: float = 0.0, timeout: float = 120.0) -> None:
        """Stop kube-apiserver (SIGTERM, as an upgrade or a crash-looping control plane
        does), leave it down `down_seconds`, start it with the same flags and wait
        until /readyz: every watch of every client breaks and must be re-listed."""
        proc = self._procs.get("kube-apiserver") or procs.read_pid_file(
            self.pid_file("kube-apiserver")
        )
        if proc is not None and not procs.stop(proc, grace=30):
            raise ClusterError(f"kube-apiserver (pid {proc.pid}) did not stop")
        time.sleep(down_seconds)
        bins = {"kube-apiserver": self.bin("kube-apiserver")}
        self._start("kube-apiserver", self._argv("kube-apiserver", bins, self.ports))
        self._wait("kube-apiserver /readyz", self._health_checks()["kube-apiserver"], timeout)

    def _default_sa_exists(self) -> tuple[bool, str]:
        code, body = self.api_get("/api/v1/namespaces/default/serviceaccounts/default")
        return code == 200, f"GET serviceaccounts/default: {code or body}"

    def _known_procs(self) -> list[procs.Proc]:
        found = []
        for name in COMPONENTS:
            proc = self._procs.get(name) or procs.read_pid_file(self.pid_file(name))
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
        fleet = self.fleet
        if fleet is not None:
            leftovers += fleet.down(grace=grace)
        for proc in reversed(self._known_procs()):
            if not procs.stop(proc, grace=grace):
                leftovers.append(f"{proc.name} (pid {proc.pid})")
        # Anything else still naming our run dir was started by us too.
        leftovers += procs.stop_strays(self.bin("etcd").parent, self.run_dir, grace=grace)
        if leftovers:
            raise ClusterError(f"still running after down: {', '.join(leftovers)}")
        self._procs.clear()
        for pid_file in self.pids_dir.glob("*.pid"):
            pid_file.unlink(missing_ok=True)
        shutil.rmtree(self.etcd_data_dir, ignore_errors=True)
        if self.state():
            self.save_state(state="down")

    def status(self) -> ClusterStatus:
        state = self.state()
        checks = self._health_checks() if state.get("ports") else {}
        components = []
        for name in COMPONENTS:
            proc = procs.read_pid_file(self.pid_file(name))
            alive = proc is not None and proc.alive()
            healthy, detail = checks[name]() if alive and name in checks else (False, "")
            components.append(
                ComponentStatus(name, proc.pid if proc else None, alive, healthy, detail)
            )
        node = self.node
        if node is not None and (state.get("node") or {}).get("state") != "down":
            for name, pid, alive, healthy, detail in node.status():
                components.append(ComponentStatus(name, pid, alive, healthy, detail))
        fleet = self.fleet
        if fleet is not None and fleet.state.get("state") != "down":
            for name, pid, alive, healthy, detail in fleet.status():
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

"""One run directory of the harness (`<cache>/e2e/runs/<id>/`, see `e2e.harness.paths`), and
finding runs again from another process.

    cluster.json          ports, binaries, state, how long `up` took, the checkout
    admin.kubeconfig      system:masters; what `env` prints and the tests use
    kubeconfigs/          one per component (and any made by write_kubeconfig)
    pki/                  CA, serving and client certs, service-account key
    logs/<component>.log  everything each component printed
    pids/<component>.pid  `<pid> <start time>` of what `up` started
    etcd-data/            removed by `down`

Every run records the checkout that started it (`checkout` in cluster.json). Without
an explicit run directory, `python -m tools.cluster down|status|env` and the demo only
consider runs of their own checkout (`latest`): several checkouts share one cache, and
one must never stop another's cluster.
"""

from __future__ import annotations

import json
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from e2e.harness import paths, procs
from e2e.harness.cluster import pki

STATE_FILE = "cluster.json"


class ClusterError(RuntimeError):
    """A run could not be found, or its control plane started, checked or stopped; says
    what and why."""


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int


@dataclass(frozen=True)
class Run:
    """A run directory as `runs()` found it."""

    path: Path
    created: float
    state: dict[str, Any]

    @property
    def checkout(self) -> str | None:
        """The checkout whose harness started the run (None: a run from before runs
        recorded it)."""
        value = self.state.get("checkout")
        return str(value) if value else None

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.created))
        checkout = self.checkout or "an unknown checkout"
        return f"{self.path} ({self.state.get('state', 'unknown')}, {started}, from {checkout})"


def http_get(url: str, context: ssl.SSLContext | None, timeout: float = 2.0) -> tuple[int, str]:
    """(status, body) of a GET; (0, reason) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, ssl.SSLError) as e:
        return 0, str(getattr(e, "reason", e))


def runs() -> list[Run]:
    """Every run on this machine with a state file, oldest first."""
    root = paths.runs_dir()
    found = []
    for d in root.iterdir() if root.is_dir() else ():
        try:
            state = json.loads((d / STATE_FILE).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(state, dict):
            found.append(Run(d, float(state.get("created", 0.0)), state))
    found.sort(key=lambda r: r.created)
    return found


def live(run_dir: Path) -> bool:
    """Whether any process this run started still runs."""
    for pid_file in (run_dir / "pids").glob("*.pid"):
        proc = procs.read_pid_file(pid_file)
        if proc is not None and proc.alive():
            return True
    return False


def latest(checkout: Path = paths.CHECKOUT) -> Path | None:
    """The newest run of `checkout` with a process still running, else its newest run
    at all; None when it has none."""
    own = [r for r in runs() if r.checkout == str(checkout)]
    running = [r for r in own if r.state.get("state") not in ("down", "failed") and live(r.path)]
    if running:
        return running[-1].path
    return own[-1].path if own else None


def pick(run_dir: Path | None, checkout: Path = paths.CHECKOUT) -> Path:
    """`run_dir` if it is one, else the `latest` run of `checkout`. The error says
    which runs exist and that --run-dir picks one of them."""
    if run_dir is not None:
        if not run_dir.is_dir():
            raise ClusterError(f"no run directory {run_dir}")
        return run_dir
    found = latest(checkout)
    if found is not None:
        return found
    others = runs()
    if not others:
        raise ClusterError("no cluster run found; start one with `python -m tools.cluster up`")
    listed = "\n".join(f"  {r.describe()}" for r in reversed(others))
    raise ClusterError(
        f"no cluster run of this checkout ({checkout}); start one with `python -m "
        f"e2e.harness.cluster up`, or name another run with --run-dir. Runs on this machine, "
        f"newest first:\n{listed}"
    )


def new_run_dir() -> Path:
    root = paths.runs_dir()
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        d = root / f"{stamp}-{os.getpid()}-{n}"
        try:
            d.mkdir()
        except FileExistsError:
            continue
        return d
    raise ClusterError(f"cannot create a run directory under {root}")


class RunDir:
    """Where a run keeps its files and its state; what the control plane and the node
    of one run share."""

    def __init__(
        self, run_dir: Path | str, *, die_with_parent: bool = False, out: TextIO | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        # Whether what the run starts is killed by the kernel when this process dies.
        self.die_with_parent = die_with_parent
        self.out = out

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

    def pid_file(self, component: str) -> Path:
        return self.pids_dir / f"{component}.pid"

    def state(self) -> dict[str, Any]:
        try:
            data = json.loads((self.run_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def save_state(self, **changes: Any) -> None:
        state = self.state()
        state.update(changes)
        tmp = self.run_dir / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
        os.replace(tmp, self.run_dir / STATE_FILE)

    @property
    def ports(self) -> Ports:
        raw = self.state().get("ports")
        if not raw:
            raise ClusterError(f"{self.run_dir} has no {STATE_FILE} with ports: never started?")
        return Ports(**raw)

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports.apiserver}"

    def bin(self, name: str) -> Path:
        """A binary of the pinned release (the one this run uses, if it ran)."""
        return Path(self.state().get("bin_dir") or paths.bin_dir()) / name

    def say(self, msg: str) -> None:
        if self.out is not None:
            print(f"cluster: {msg}", file=self.out, flush=True)

    def admin_context(self) -> ssl.SSLContext:
        """TLS as the admin (system:masters) of this run's API server."""
        ctx = ssl.create_default_context(cafile=str(self.pki_dir / "ca.crt"))
        ctx.load_cert_chain(str(self.pki_dir / "admin.crt"), str(self.pki_dir / "admin.key"))
        return ctx

    def api_get(self, path: str, *, timeout: float = 2.0) -> tuple[int, str]:
        """(status, body) of a GET of `path` from the API server, as the admin."""
        return http_get(f"{self.server}{path}", self.admin_context(), timeout)

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

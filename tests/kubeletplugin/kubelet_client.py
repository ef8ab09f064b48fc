"""What the kubelet plugin tests share: short socket dirs, claims, a Preparer, gRPC.

The ClaimReader here is the plugin's own Protocol (``drasil.kubeletplugin.dra.prepare``)
answered from claim JSON the test writes, so the Preparer's logic can be driven
without an API server. Tests that need the real API server live in ``e2e/``.

The module is imported by the test files (pytest puts this folder on ``sys.path``)
and by the crash-test subprocesses (which put it there themselves).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from drasil.driver.checkpoint import CHECKPOINT_DIR, CheckpointStore
from drasil.driver.claims.plan import ClaimRef
from drasil.driver.devices import Device
from drasil.driver.files import CRASH_ENV, CRASH_EXIT_CODE
from drasil.driver.kubeapi import checked_name
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.simulated.nvml import simulated_library
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.metrics import devices_gauge
from drasil.kubeletplugin.node import NodeRuntime
from drasil.kubeletplugin.options import parse_options
from drasil.kubeletplugin.sockets import UnixSocketServer
from drasil.kubeletplugin.vendors.registry import open_vendors

DRIVER = "gpu.drasil.dev"
NODE = "n1"
PROFILE = "h100-80gb:4"
CONFIG_API = "resource.drasil.dev/v1beta1"
DEADLINE = 20.0  # generous: a poll ends as soon as its condition holds

Claim = dict[str, Any]


def simulated_node(tmp_path: Path, profile: str, *extra: str) -> NodeRuntime:
    """The node daemon's runtime over simulated GPUs of `profile`, its dirs under
    `tmp_path`, no HTTP; `extra` flags on top (e.g. ``--mig-mode=dynamic``)."""
    flags = [
        f"--node-name={NODE}",
        "--backend=simulated",
        f"--simulated-profile={profile}",
        f"--plugins-dir={tmp_path / 'plugins'}",
        f"--registrar-dir={tmp_path / 'registry'}",
        "--metrics-addr=0",
        "--health-addr=0",
        *extra,
    ]
    opts = parse_options(flags, {})
    return NodeRuntime(
        opts, vendors=open_vendors(opts)[1], devices_gauge=devices_gauge(CollectorRegistry())
    )


def node_devices(profile: str = PROFILE, *, node: str = NODE) -> dict[str, Device]:
    """The devices discovery finds on a simulated node, by name."""
    result = discover(simulated_library(profile, node_name=node), node_name=node)
    return {d.name: d for d in result.devices}


@contextmanager
def short_dir(prefix: str = "drs") -> Iterator[Path]:
    """A temp dir with a short path: pytest's tmp_path can exceed a socket path's limit."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def wait_until(condition: Callable[[], object], *, what: str, deadline: float = DEADLINE) -> None:
    """Poll ``condition`` until it is true; fail with ``what`` after ``deadline`` s."""
    end = time.monotonic() + deadline
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline}s waiting for {what}")
        time.sleep(0.01)


# ---- claims -------------------------------------------------------------------------


def result(
    device: str,
    *,
    request: str = "gpu",
    pool: str = NODE,
    driver: str = DRIVER,
    admin_access: bool = False,
    share_id: str | None = None,
) -> dict[str, Any]:
    """One ``status.allocation.devices.results`` entry."""
    entry: dict[str, Any] = {"request": request, "driver": driver, "pool": pool, "device": device}
    if admin_access:
        entry["adminAccess"] = True
    if share_id is not None:
        entry["shareID"] = share_id
    return entry


def gpu_config(strategy: str = "Exclusive", *, requests: Sequence[str] = ()) -> dict[str, Any]:
    """One opaque ``FromClaim`` config entry carrying a GpuConfig."""
    return {
        "source": "FromClaim",
        "requests": list(requests),
        "opaque": {
            "driver": DRIVER,
            "parameters": {
                "apiVersion": CONFIG_API,
                "kind": "GpuConfig",
                "sharing": {"strategy": strategy},
            },
        },
    }


def claim_json(
    uid: str,
    *results: dict[str, Any],
    name: str | None = None,
    namespace: str = "default",
    config: Sequence[dict[str, Any]] = (),
) -> Claim:
    """A ResourceClaim as the API server returns it (only the fields prepare reads)."""
    return {
        "metadata": {"name": name or f"claim-{uid[:8]}", "namespace": namespace, "uid": uid},
        "status": {"allocation": {"devices": {"results": list(results), "config": list(config)}}},
    }


def ref_of(claim: Mapping[str, Any]) -> ClaimRef:
    meta = claim["metadata"]
    return ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


class MemoryClaims:
    """A ClaimReader over claims held in memory; counts its calls.

    ``stale`` holds what a ``cached=True`` read answers instead (a watch cache that
    lags behind); without an entry there, a cached read sees the current claim.
    """

    def __init__(self, *claims: Claim) -> None:
        self._claims: dict[tuple[str, str], Claim] = {}
        self.stale: dict[tuple[str, str], Claim | None] = {}
        self.calls = 0
        self.cached_calls = 0
        self._lock = threading.Lock()
        for claim in claims:
            self.put(claim)

    def put(self, claim: Claim) -> None:
        meta = claim["metadata"]
        self._claims[(meta["namespace"], meta["name"])] = claim

    def delete(self, namespace: str, name: str) -> None:
        del self._claims[(namespace, name)]

    def get_claim(
        self, namespace: str, name: str, *, cached: bool = False
    ) -> Mapping[str, Any] | None:
        key = (namespace, name)
        with self._lock:
            self.calls += 1
            self.cached_calls += cached
        if cached and key in self.stale:
            return self.stale[key]
        return self._claims.get(key)


class KubeNames:
    """The claim reader with KubeApi's name check in front, as in the daemon."""

    def __init__(self, reader: MemoryClaims) -> None:
        self.reader = reader

    def get_claim(self, namespace: str, name: str, *, cached: bool = False) -> Any:
        checked_name(namespace, what="namespace", label=True)
        checked_name(name, what="ResourceClaim name")
        return self.reader.get_claim(namespace, name, cached=cached)


class FileClaims:
    """A ClaimReader over ``<dir>/<namespace>_<name>.json`` files, for subprocesses."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def put(self, claim: Claim) -> None:
        meta = claim["metadata"]
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{meta['namespace']}_{meta['name']}.json"
        path.write_text(json.dumps(claim))

    def get_claim(
        self, namespace: str, name: str, *, cached: bool = False
    ) -> Mapping[str, Any] | None:
        try:
            data: Mapping[str, Any] = json.loads(
                (self.directory / f"{namespace}_{name}.json").read_text()
            )
        except FileNotFoundError:
            return None
        return data


def make_preparer(
    root: Path,
    claims: Any,
    *,
    devices: Mapping[str, Device] | None = None,
    pool: str = NODE,
) -> Preparer:
    """A Preparer with its state in ``root/state`` and CDI specs in ``root/cdi``."""
    state_dir = root / "state"
    cdi_root = root / "cdi"
    state_dir.mkdir(parents=True, exist_ok=True)
    cdi_root.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore(state_dir / CHECKPOINT_DIR)
    store.load()
    return Preparer(
        driver=DRIVER,
        pool=pool,
        devices=node_devices() if devices is None else devices,
        claims=claims,
        store=store,
        cdi_root=cdi_root,
        state_dir=state_dir,
    )


def spec_file(root: Path, uid: str) -> Path:
    return root / "cdi" / f"k8s.{DRIVER}-claim_{uid}.json"


# ---- gRPC -----------------------------------------------------------------------------


@contextmanager
def serving(
    add_servicers: Callable[[grpc.Server], None], *, name: str = "dra.sock"
) -> Iterator[tuple[UnixSocketServer, grpc.Channel]]:
    """A real gRPC server on a temp unix socket, and a channel to it (as kubelet dials)."""
    with short_dir() as directory:
        server = UnixSocketServer(directory / name, add_servicers)
        server.start()
        try:
            with grpc.insecure_channel(f"unix://{server.path}") as channel:
                grpc.channel_ready_future(channel).result(timeout=DEADLINE)
                yield server, channel
        finally:
            server.stop(grace=None)


# ---- crash tests --------------------------------------------------------------------

_CRASH_CHILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
preparer = getattr(__import__(sys.argv[2]), sys.argv[8])
from drasil.driver.claims.plan import ClaimRef

root = Path(sys.argv[3])
ref = ClaimRef(namespace=sys.argv[5], name=sys.argv[6], uid=sys.argv[7])
p = preparer(root)
error = p.prepare(ref).error if sys.argv[4] == "prepare" else p.unprepare(ref)
print(json.dumps({"error": error}))
"""


def crash_in_child(
    module: str,
    root: Path,
    operation: str,
    ref: ClaimRef,
    point: str,
    *,
    factory: str = "preparer",
) -> None:
    """Run ``operation`` (prepare or unprepare) of ``ref`` in a child process whose
    Preparer comes from ``<module>.<factory>(root)``, killed at crash point ``point``."""
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    env[CRASH_ENV] = point
    args = [str(Path(__file__).parent), module, str(root), operation]
    done = subprocess.run(
        [sys.executable, "-c", _CRASH_CHILD, *args, ref.namespace, ref.name, ref.uid, factory],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == CRASH_EXIT_CODE, done.stderr

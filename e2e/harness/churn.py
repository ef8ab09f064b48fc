"""Churn: Pods with claims made and deleted without pause on the real node, each one
checking that its container sees exactly its devices, and the ledger of what happened.

The load (`Churn`) runs in threads beside whoever disrupts the node (e2e/test_churn.py,
bench/churn.py): kubelet, the plugin, the API server restarted, the node rebooted. Each
worker loops over one kind of claim (`Kind`), on GPUs of its own (by minor) so that a
kind's waits measure drasil, not the packing of the other kinds:

- ``gpu``: a whole GPU (under consumable sharing, an MPS client with all its memory);
- ``mig``: a dynamic MIG placement;
- ``share``: an MPS share of a GPU's memory;
- ``pair``: one ResourceClaim used by two Pods.

One cycle: a ResourceClaim, its Pod(s) (restartPolicy Always, as a Deployment's, so a
reboot restarts them rather than failing them), the wait until every container runs,
the check of the devices each printed (`visible_uuids` against the claim's allocation),
a short life, the Pods deleted, the claim deleted. With `probe`, the Pods are of the
probe image and first load the driver's libraries: the version each loaded is kept by
phase. A monitor thread reads the plugin's checkpoint every second for devices held by
two claims at once. `phase` names what happens from now on; `wait_caught_up` waits
until no Pod of an earlier phase is still waited for, so that a Pod refused during one
disruption (kubelet asks again only at its next pod sync) does not meet the next.

The ledger (`Ledger`) is what an operator asks after an upgrade: Pods started, Pods that
did not start (and why), prepare errors kubelet retried, the longest wait of a new Pod
for its devices, and, from `leaks` once the load is gone, what the node still holds
without a claim (checkpoint entries, CDI specs, metadata files, MIG instances, MPS
daemons).
"""

from __future__ import annotations

import functools
import json
import os
import random
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from e2e.harness import versions
from e2e.harness.cluster.node import Node
from e2e.harness.kube import RESOURCE, Kube, NotYet, gone, wait_for
from e2e.harness.pluginproc import DRIVER, checkpoint_claims, checkpoint_gpus
from e2e.harness.pods import visible_uuids

# Prints the env at every start of the container, then waits; exits at once on SIGTERM.
COMMAND = "env | sort; trap 'exit 0' TERM; sleep 3600 & wait"
# The same in the probe image, first printing what loading the driver gave (one line
# of JSON: gpu-probe dlopens libcuda.so.1 and libnvidia-ml.so.1 by SONAME).
PROBE_COMMAND = "echo \"DRASIL_PROBE=$(gpu-probe 2>&1 | tr -d '\\n')\"; " + COMMAND
PREPARE_RETRIED = "FailedPrepareDynamicResources"
# What kubelet says when no plugin of the driver answered its call: none registered,
# or the registered one's socket refused or vanished (gRPC Unavailable).
UNSERVED = ("is not registered", "code = Unavailable")
# Where a churn test writes its ledger (`<dir>/<test>.json`) when set: bench/churn.py.
LEDGER_ENV = "DRASIL_CHURN_LEDGER"
# A Pod not running by then did not start. bench/churn.py gives more: with kubelet's
# default pod sync (1m plus jitter) a Pod refused through a long disruption waits for
# two or three of kubelet's retries.
START_TIMEOUT_ENV = "DRASIL_CHURN_START_TIMEOUT"
START_TIMEOUT = float(os.environ.get(START_TIMEOUT_ENV, "180"))


@dataclass(frozen=True)
class Target:
    """The plugin the churn loads: its driver, its node, where it keeps its state and
    writes its CDI specs."""

    driver: str
    node: str
    state_dir: Path
    cdi_dir: Path

    @classmethod
    def of(cls, node: Node, driver: str = DRIVER) -> Target:
        """The node's own plugin (`driver` gpu.drasil.dev), or a chart's beside it."""
        return cls(driver, node.name, node.plugins_dir / driver, node.cdi_dir)


@dataclass(frozen=True)
class Kind:
    """One kind of claim the churn makes, on GPUs of `minors` only."""

    name: str
    device_class: str
    minors: tuple[int, ...]
    driver: str = DRIVER
    pods: int = 1
    profile: str | None = None  # a MIG profile: a dynamic MIG placement of it
    memory: str | None = None  # a consumable share of this much memory
    exclusive: bool = True  # no other claim's container may see its devices meanwhile

    def requests(self) -> list[dict[str, Any]]:
        attrs = f'device.attributes["{self.driver}"]'
        cel = f"{attrs}.minor in [{', '.join(str(m) for m in self.minors)}]"
        if self.profile is not None:
            cel += f' && {attrs}.profile == "{self.profile}"'
        exactly: dict[str, Any] = {
            "deviceClassName": self.device_class,
            "selectors": [{"cel": {"expression": cel}}],
        }
        if self.memory is not None:
            exactly["capacity"] = {"requests": {"memory": self.memory}}
        return [{"name": "gpu", "exactly": exactly}]


# Dynamic MIG makes MIG-capable GPUs unshareable (they keep their counters for the
# MIG placements), so the node that churns has both: H100s to cut, L4s to share.
CHURN_PROFILE = "h100-80gb:4,l4:4"


def standard_kinds(
    *, gpu_class: str, mig_class: str, shared_class: str, driver: str = DRIVER
) -> dict[str, Kind]:
    """The four kinds on a node of CHURN_PROFILE in dynamic MIG with consumable
    sharing: minors 0-3 are the H100s, 4-7 the L4s."""
    kinds = (
        Kind("mig", mig_class, (0, 1), driver, profile="1g.10gb"),
        Kind("gpu", gpu_class, (2, 3), driver),
        Kind("share", shared_class, (4, 5), driver, memory="10Gi", exclusive=False),
        Kind("pair", gpu_class, (6, 7), driver, pods=2),
    )
    return {k.name: k for k in kinds}


def unserved_retry(message: str) -> bool:
    """Whether a FailedPrepareDynamicResources message says kubelet found no plugin to
    serve it (rather than a plugin that refused the claim)."""
    return any(text in message for text in UNSERVED)


@dataclass
class Ledger:
    """What the churn saw; `leaks` is filled by `Churn.stop`."""

    cycles: int = 0
    pods_started: int = 0
    pods_failed: list[str] = field(default_factory=list)  # "<pod>: why"
    wrong_devices: list[str] = field(default_factory=list)  # "<pod>: saw X, claim has Y"
    prepare_retries: int = 0  # FailedPrepareDynamicResources events on the Pods
    retry_messages: list[str] = field(default_factory=list)  # the first few, to read
    # Of those, the ones where kubelet had no plugin to ask (the driver not registered,
    # its socket gone or refusing), by the phase the Pod was created in: a plugin
    # handover with a surge must leave none.
    unserved_by_phase: dict[str, int] = field(default_factory=dict)
    waits: list[float] = field(default_factory=list)  # Pod created -> running, seconds
    # The Pods created in each phase (`Churn.phase`) that started, and the longest wait
    # among them.
    started_by_phase: dict[str, int] = field(default_factory=dict)
    longest_wait_by_phase: dict[str, float] = field(default_factory=dict)
    double_booked: list[str] = field(default_factory=list)
    # With `Churn(probe=True)`: the driver version each Pod loaded, by phase, and the
    # Pods that could not load it.
    driver_versions: dict[str, dict[str, int]] = field(default_factory=dict)
    driver_failures: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the churn's own API calls that failed
    leaks: dict[str, list[str]] = field(default_factory=dict)

    @property
    def longest_wait(self) -> float:
        return max(self.waits, default=0.0)

    def wait_at(self, fraction: float) -> float:
        """The wait below which `fraction` (0..1) of the waits lie."""
        ordered = sorted(self.waits)
        return ordered[min(int(fraction * len(ordered)), len(ordered) - 1)] if ordered else 0.0

    def summary(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("waits")
        data.update(
            longest_wait_s=round(self.longest_wait, 2),
            p50_wait_s=round(self.wait_at(0.5), 2),
            p95_wait_s=round(self.wait_at(0.95), 2),
        )
        return data

    def keep(self, test: str, **extra: Any) -> None:
        """Written to `$DRASIL_CHURN_LEDGER/<test>.json` with `extra`, when that is set."""
        if out := os.environ.get(LEDGER_ENV):
            path = Path(out) / f"{test}.json"
            path.write_text(json.dumps({**extra, **self.summary()}, indent=1) + "\n")

    def assert_clean(self) -> None:
        """Pods started and no problem; the whole summary in the error if not."""
        assert self.pods_started > 0, self.summary()
        assert not self.problems(), json.dumps(self.summary(), indent=1)

    def problems(self) -> list[str]:
        """Everything that must be empty after a churn: drasil's failures."""
        found = [f"did not start: {p}" for p in self.pods_failed]
        found += [f"wrong devices: {w}" for w in self.wrong_devices]
        found += [f"held twice: {d}" for d in self.double_booked]
        found += [f"driver not loaded: {d}" for d in self.driver_failures]
        found += [f"left without a claim: {k}: {v}" for k, v in self.leaks.items() if v]
        return found


class Churn:
    """The load; `start`, disrupt, `stop` (returns the ledger)."""

    def __init__(
        self,
        kubeconfig: Path,
        target: Target,
        namespace: str,
        kinds: Iterable[Kind],
        *,
        lifetime: tuple[float, float] = (1.0, 4.0),
        seed: int = 0,
        probe: bool = False,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.target = target
        self.namespace = namespace
        self.kinds = tuple(kinds)
        self.lifetime = lifetime
        self.probe = probe  # Pods of the probe image: each loads the driver's libraries
        self.ledger = Ledger()
        self._seed = seed
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._seen: dict[
            str, str
        ] = {}  # uuid of an exclusive device -> the claim whose Pod sees it
        self._uuids: dict[str, str] = {}  # published device name -> uuid
        self._phase = "steady"
        self._waiting: dict[str, str] = {}  # worker -> the phase its waited-for Pods began in

    def phase(self, name: str) -> None:
        """Name what happens from now on (a disruption): the ledger keeps the longest
        wait of the Pods created in each phase."""
        with self._lock:
            self._phase = name

    def wait_caught_up(self, *, timeout: float = START_TIMEOUT + 30.0) -> None:
        """Until no worker waits for Pods created before the current phase: those
        started, or were noted as not started. (kubelet retries a failed prepare about
        once a minute, so a Pod that met one disruption must not meet the next.)"""

        def caught_up() -> Any:
            with self._lock:
                behind = {k: v for k, v in self._waiting.items() if v != self._phase}
            return True if not behind else NotYet(behind)

        wait_for(caught_up, timeout=timeout, what="churn Pods of earlier phases", interval=0.5)

    def wait_started(self, count: int, *, timeout: float = 180.0) -> None:
        """Until `count` more Pods started (the load is warm, or runs again)."""
        with self._lock:
            target = self.ledger.pods_started + count

        def enough() -> Any:
            with self._lock:
                ledger = self.ledger
                done = ledger.pods_started >= target
                return True if done else NotYet(ledger.summary())

        wait_for(enough, timeout=timeout, what=f"{count} churn Pods to start", interval=0.5)

    # ---- running --------------------------------------------------------------------

    def start(self) -> None:
        for index, kind in enumerate(self.kinds):
            rng = random.Random(self._seed * 100 + index)
            self._spawn(f"churn-{kind.name}", functools.partial(self._loop, kind, rng))
        self._spawn("churn-monitor", self._monitor)

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self, *, timeout: float = 300.0) -> Ledger:
        """Let each worker finish its cycle (Pods and claim deleted), then read what the
        node still holds."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 1.0))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise AssertionError(f"churn workers still running after {timeout:.0f}s: {alive}")
        self.ledger.leaks = wait_for_no_leaks(self.target, Kube(self.kubeconfig))
        return self.ledger

    def _loop(self, kind: Kind, rng: random.Random) -> None:
        kube = Kube(self.kubeconfig)
        while not self._stopping.is_set():
            try:
                self._cycle(kube, kind, rng)
            except Exception as err:  # an API call of ours: note it, keep churning
                self._note(self.ledger.errors, f"{kind.name}: {type(err).__name__}: {err}"[:300])
                time.sleep(1.0)

    def _note(self, into: list[str], what: str) -> None:
        with self._lock:
            into.append(what)

    def _cycle(self, kube: Kube, kind: Kind, rng: random.Random) -> None:
        claim = f"churn-{kind.name}-{secrets.token_hex(3)}"
        self._create_claim(kube, kind, claim)
        pods = [f"{claim}-{i}" for i in range(kind.pods)]
        try:
            created = time.monotonic()
            with self._lock:
                phase = self._waiting[kind.name] = self._phase
            try:
                for pod in pods:
                    self._create_pod(kube, pod, claim)
                started = self._started(kube, pods, created, phase)
            finally:
                with self._lock:
                    del self._waiting[kind.name]
            if started:
                self._check_devices(kube, kind, claim, pods, phase)
                self._stopping.wait(rng.uniform(*self.lifetime))
        finally:
            for pod in pods:
                _delete(kube, "v1", "Pod", pod, self.namespace)
            self._release(claim)
            _delete(kube, RESOURCE, "ResourceClaim", claim, self.namespace)
            with self._lock:
                self.ledger.cycles += 1

    def _create_claim(self, kube: Kube, kind: Kind, name: str) -> None:
        kube.create(claim_manifest(name, kind), self.namespace)

    def _create_pod(self, kube: Kube, name: str, claim: str) -> None:
        kube.create(pod_manifest(name, claim, self.target.node, probe=self.probe), self.namespace)

    def _started(self, kube: Kube, pods: list[str], created: float, phase: str) -> bool:
        """Wait until every Pod runs; a Pod that does not is noted with why."""
        for pod in pods:
            why = self._wait_running(kube, pod, created + START_TIMEOUT)
            self._count_retries(kube, pod, phase)
            if why is not None:
                self._note(self.ledger.pods_failed, f"{pod}: {why}")
                return False
            waited = time.monotonic() - created
            with self._lock:
                ledger = self.ledger
                ledger.pods_started += 1
                ledger.waits.append(waited)
                ledger.started_by_phase[phase] = ledger.started_by_phase.get(phase, 0) + 1
                longest = ledger.longest_wait_by_phase.get(phase, 0.0)
                ledger.longest_wait_by_phase[phase] = round(max(longest, waited), 2)
        return True

    def _wait_running(self, kube: Kube, pod: str, deadline: float) -> str | None:
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                last = kube.get("v1", "Pod", pod, self.namespace)
            except Exception:  # the API server restarting: ask again
                time.sleep(1.0)
                continue
            status = last.get("status") or {}
            containers = status.get("containerStatuses") or []
            if status.get("phase") == "Running" and containers and containers[0].get("ready"):
                return None
            if status.get("phase") in ("Failed", "Succeeded"):
                break
            time.sleep(0.25)
        phase = (last.get("status") or {}).get("phase")
        return f"phase {phase} after {START_TIMEOUT:.0f}s; events: {self._events(kube, pod)}"

    def _events(self, kube: Kube, pod: str) -> list[str]:
        items = kube.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={pod}", _request_timeout=30
        ).items
        return [f"{e.reason} x{e.count or 1}: {(e.message or '')[:200]}" for e in items]

    def _count_retries(self, kube: Kube, pod: str, phase: str) -> None:
        items = kube.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={pod}", _request_timeout=30
        ).items
        retried = [e for e in items if e.reason == PREPARE_RETRIED]
        unserved = sum(e.count or 1 for e in retried if unserved_retry(e.message or ""))
        with self._lock:
            self.ledger.prepare_retries += sum(e.count or 1 for e in retried)
            if unserved:
                by_phase = self.ledger.unserved_by_phase
                by_phase[phase] = by_phase.get(phase, 0) + unserved
            for e in retried:
                if len(self.ledger.retry_messages) < 20:
                    self.ledger.retry_messages.append(f"{pod}: {(e.message or '')[:300]}")

    # ---- what a container sees --------------------------------------------------------

    def _check_devices(
        self, kube: Kube, kind: Kind, claim: str, pods: list[str], phase: str
    ) -> None:
        obj = kube.get(RESOURCE, "ResourceClaim", claim, self.namespace)
        expected = self._expected_uuids(obj)
        for pod in pods:
            env = printed_env(kube, self.namespace, pod)
            seen = visible_uuids(env)
            if seen != expected:
                self._note(self.ledger.wrong_devices, f"{pod}: saw {seen}, claim has {expected}")
            if self.probe:
                self._check_driver(pod, env.get("DRASIL_PROBE", ""), phase)
        if kind.exclusive:
            self._hold(claim, expected)

    def _check_driver(self, pod: str, printed: str, phase: str) -> None:
        version = loaded_driver(printed)
        if version is None:
            self._note(self.ledger.driver_failures, f"{pod}: {printed[:300]}")
            return
        with self._lock:
            counts = self.ledger.driver_versions.setdefault(phase, {})
            counts[version] = counts.get(version, 0) + 1

    def _expected_uuids(self, claim: dict[str, Any]) -> list[str]:
        """The UUIDs of the claim's devices: a MIG instance's from the checkpoint (it
        has none before it is cut), a GPU's as published."""
        results = claim["status"]["allocation"]["devices"]["results"]
        record = checkpoint_claims(self.target.state_dir).get(claim["metadata"]["uid"])
        migs = [d["mig"]["uuid"] for d in (record or {}).get("devices", []) if d.get("mig")]
        gpus = [self._uuid(r["device"]) for r in results if "-mig-" not in r["device"]]
        return sorted(migs + gpus)

    def _uuid(self, device: str) -> str:
        if device not in self._uuids:
            self._uuids.update(published_uuids(Kube(self.kubeconfig), self.target))
        return self._uuids.get(device, f"<{device} not published>")

    def _hold(self, claim: str, uuids: list[str]) -> None:
        with self._lock:
            for uuid in uuids:
                other = self._seen.get(uuid)
                if other is not None and other != claim:
                    self.ledger.double_booked.append(f"{uuid}: seen by {other} and {claim}")
                self._seen[uuid] = claim

    def _release(self, claim: str) -> None:
        with self._lock:
            for uuid in [u for u, c in self._seen.items() if c == claim]:
                del self._seen[uuid]

    # ---- the checkpoint, every second --------------------------------------------------

    def _monitor(self) -> None:
        while not self._stopping.wait(1.0):
            try:
                twice = held_twice(checkpoint_claims(self.target.state_dir))
            except (OSError, ValueError):  # mid-write, or the plugin's dir gone in a reboot
                continue
            with self._lock:
                for what in twice:
                    if what not in self.ledger.double_booked:
                        self.ledger.double_booked.append(what)


def claim_manifest(name: str, kind: Kind) -> dict[str, Any]:
    """A ResourceClaim of `kind`."""
    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceClaim",
        "metadata": {"name": name, "labels": {"drasil.dev/churn": kind.name}},
        "spec": {"devices": {"requests": kind.requests()}},
    }


def pod_manifest(name: str, claim: str, node: str, *, probe: bool = False) -> dict[str, Any]:
    """A Pod on `node` whose one container uses `claim` and prints its env at every
    start (`probe`: of the probe image, and what loading the driver gave first);
    restartPolicy Always, as a Deployment's Pod."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "restartPolicy": "Always",
            "dnsPolicy": "Default",
            "terminationGracePeriodSeconds": 5,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [
                {
                    "name": "c",
                    "image": versions.PROBE_IMAGE if probe else versions.TEST_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", PROBE_COMMAND if probe else COMMAND],
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }


@contextmanager
def churning(churn: Churn) -> Iterator[Churn]:
    """`churn` running for the block; stopped (and its ledger complete) after it."""
    churn.start()
    try:
        yield churn
    finally:
        churn.stop()


def loaded_driver(printed: str) -> str | None:
    """The driver version a probe Pod printed (`DRASIL_PROBE`), or None when it could
    not load and call into the driver's libraries."""
    try:
        result = json.loads(printed)
    except ValueError:
        return None
    if not isinstance(result, dict) or "error" in result:
        return None
    if result.get("cuInit") != 0 or result.get("nvmlInit") != 0:
        return None
    version = result.get("driverVersion")
    return str(version) if version else None


def printed_env(kube: Kube, namespace: str, pod: str) -> dict[str, str]:
    def printed() -> Any:
        log = kube.core.read_namespaced_pod_log(pod, namespace, container="c", _request_timeout=30)
        return log if "PATH=" in log else NotYet(log)

    log: str = wait_for(printed, timeout=60, what=f"the env in the log of {namespace}/{pod}")
    return dict(line.split("=", 1) for line in log.splitlines() if "=" in line)


def _delete(kube: Kube, api: str, kind: str, name: str, namespace: str) -> None:
    """Delete and wait until gone; API errors (a restarting API server) are retried."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            kube.delete(api, kind, name, namespace)
            if gone(kube, api, kind, name, namespace) is True:
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"{kind} {namespace}/{name} not deleted in {START_TIMEOUT:.0f}s")
        time.sleep(0.5)


def published_uuids(kube: Kube, target: Target) -> dict[str, str]:
    """Device name -> uuid attribute of the node's devices (empty for a MIG placement
    not cut yet)."""
    slices = kube.resource(RESOURCE, "ResourceSlice").get(
        field_selector=f"spec.nodeName={target.node},spec.driver={target.driver}",
        _request_timeout=30,
    )
    return {
        d["name"]: str(d.get("attributes", {}).get("uuid", {}).get("string", ""))
        for s in slices.items
        for d in s.to_dict()["spec"].get("devices") or []
    }


# ---- what the node holds -------------------------------------------------------------------


def held_twice(claims: dict[str, Any]) -> list[str]:
    """Devices two recorded claims hold at once: one device without a share on both
    sides (admin access aside), or two MIG instances overlapping on one GPU."""
    whole: dict[str, str] = {}
    slices: dict[tuple[str, int], str] = {}
    found = []
    for uid, record in sorted(claims.items()):
        for device in record.get("devices", []):
            if device.get("adminAccess"):
                continue
            if (mig := device.get("mig")) is not None:
                start, size = mig["placementStart"], mig["placementSize"]
                for unit in range(start, start + size):
                    other = slices.setdefault((mig["parentUuid"], unit), uid)
                    if other != uid:
                        found.append(f"MIG slice {unit} of {mig['parentUuid']}: {other} and {uid}")
                continue
            if device.get("shareId"):
                continue
            key = f"{device.get('poolName')}/{device.get('deviceName')}"
            other = whole.setdefault(key, uid)
            if other != uid:
                found.append(f"{key}: {other} and {uid}")
    return sorted(set(found))


def leaks(target: Target, live: set[str]) -> dict[str, list[str]]:
    """What the node holds for no claim: checkpoint entries of claims not in `live`
    (the UIDs of the ResourceClaims that exist), and CDI specs, metadata files, MIG
    instances and MPS daemons of no checkpoint entry."""
    state = target.state_dir
    claims = checkpoint_claims(state)
    gone_claims = {uid: c for uid, c in claims.items() if uid not in live}
    specs = [
        p.name
        for p in target.cdi_dir.glob(f"k8s.{target.driver}-claim_*.json")
        if p.stem.rsplit("_", 1)[-1] not in claims
    ]
    metadata_dir = state / "dra-device-metadata"
    metadata = [p.name for p in metadata_dir.iterdir()] if metadata_dir.is_dir() else []
    return {
        "checkpoint entries": sorted(f"{c['namespace']}/{c['name']}" for c in gone_claims.values()),
        "CDI specs": sorted(specs),
        "metadata files": sorted(m for m in metadata if m not in claims),
        "MIG instances": _mig_instances(state, claims),
        "MPS daemons": _mps_daemons(state, claims),
    }


def _mps_daemons(state: Path, claims: dict[str, Any]) -> list[str]:
    """Daemons recorded or running while no claim holds a share (the churn's shares
    are all gone when this is asked)."""
    if any(d.get("shareId") for c in claims.values() for d in c.get("devices", [])):
        return []
    recorded = [f"recorded for {u}" for u, g in checkpoint_gpus(state).items() if g.get("mps")]
    mark = str(state / "mps")
    running = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if mark in cmdline:
                running.append(f"pid {entry.name} running")
    return sorted(recorded + running)


def _mig_instances(state: Path, claims: dict[str, Any]) -> list[str]:
    path = state / "simulated-gpus.json"
    if not path.exists():
        return []
    held = {
        (d["mig"]["parentUuid"], d["mig"]["placementStart"])
        for c in claims.values()
        for d in c.get("devices", [])
        if d.get("mig")
    }
    gpus = json.loads(path.read_text()).get("gpus", {})
    return sorted(
        f"{uuid} at {gi['start']}"
        for uuid, gpu in gpus.items()
        for gi in gpu.get("gpuInstances") or []
        if (uuid, gi["start"]) not in held
    )


def live_claims(kube: Kube) -> set[str]:
    """The UIDs of every ResourceClaim in the cluster."""
    items = kube.resource(RESOURCE, "ResourceClaim").get(_request_timeout=30).items
    return {c.metadata.uid for c in items}


def wait_for_no_leaks(target: Target, kube: Kube, *, timeout: float = 60.0) -> dict[str, list[str]]:
    """`leaks` once kubelet had time to unprepare the last claims (its unprepare
    follows the Pod's deletion), else what is left at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        found = leaks(target, live_claims(kube))
        if not any(found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(1.0)

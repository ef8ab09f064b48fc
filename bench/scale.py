"""``make bench-scale``: drasil and the scheduler on a fleet of KWOK nodes (docs/scale.md).

For each fleet size N (``--nodes 50,200,500``) a fresh cluster with N fake nodes of
``--profile`` (8 H100s each), their pools published by drasil's own slice code
(``python -m tools.cluster up --fake-nodes N``), the controller with its chart RBAC, and:

1. **scheduling**: ``--pods-per-node`` (8: every GPU) Pods per node, each with a one-GPU
   ResourceClaimTemplate, in waves of 2 Pods per node whose class goes A B B A:
   ``gpu.drasil.dev`` plus a CEL selector on ``productName`` (drasil's class and slice
   shape), then the same over a minimal DeviceClass (a driver selector only). Each
   wave is created by 8 threads and waited for; Pods/s and p50/p99 create→scheduled
   (seen on a watch) per class, and the ratio drasil/minimal;
2. **the controller**: RSS and CPU seconds after each phase, p99 time from creating a
   Pod whose claim can never be allocated (the fleet is full) to the controller's
   ``Unsatisfiable`` Event on it, for a burst of N/10 (at least 10) such Pods created
   at once, and Events per minute since;
3. **drasil explain** for such a claim against the whole fleet: the CLI's wall time,
   and in-process the fetch and the evaluation apart;
4. **one health flip** of one device on one node in the fleet publisher: the writes it
   took (its own count, and the API server's audit log);
5. **idle**: ``--idle-minutes`` with nothing happening: writes per minute by verb and
   resource from the API server's ``apiserver_request_total``, and by user from its
   audit log (drasil's users: the fleet publisher and the controller).

``python -m bench.scale [--nodes 50,200] [--idle-minutes 10]`` writes
bench/results/scale.json and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from bench.stats import percentile
from drasil.api.limits import allow_nesting
from drasil.controller.heap import ENV as HEAP_ENV
from drasil.driver.explain.fromapi import explain_fetched, fetch_inputs
from drasil.driver.simulated.gpus import parse_profile_spec
from e2e.harness import chart
from e2e.harness.cluster.control_plane import Cluster
from e2e.harness.cluster.fleet import DEFAULT_FLEET_PROFILE, DRIVER, KwokFleet
from e2e.harness.controllerproc import ControllerProcess
from e2e.harness.kube import Kube, NotYet, wait_for
from tools.fleet import api_from_kubeconfig

RESULTS = Path(__file__).parent / "results" / "scale.json"
NAMESPACE = "scale"
USER_AGENT = "drasil-scale-bench"
BENCH_LABEL = "drasil.dev/scale-bench"
MINIMAL_CLASS = "minimal.drasil.dev"
PRODUCT = "NVIDIA H100 80GB HBM3"
CLASSES = ("drasil", "minimal")
WAVE_PODS_PER_NODE = 2
CREATORS = 8
EXPLAIN_AFTER = 5  # the controller's --explain-after for this benchmark (default 10)
WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE", "APPLY", "DELETECOLLECTION"})


@dataclass(frozen=True)
class Params:
    nodes: int
    profile: str = DEFAULT_FLEET_PROFILE
    pods_per_node: int = 8
    idle_minutes: float = 10.0
    # Pods created at once on the full fleet, whose claims stay pending: a burst the
    # controller must explain; 0 means one per 10 nodes, at least 10.
    probes: int = 0

    @property
    def burst(self) -> int:
        return self.probes or max(10, self.nodes // 10)

    explain_runs: int = 5
    # Where the controller's heap reports go (DRASIL_TRACEMALLOC, controller/heap.py):
    # one after scheduling and one after the idle window; None: not traced.
    tracemalloc: Path | None = None


# ---- small helpers ----------------------------------------------------------------


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "count": len(values),
        "p50": round(percentile(values, 50), 3),
        "p99": round(percentile(values, 99), 3),
        "max": round(max(values, default=0.0), 3),
    }


def api_client(kubeconfig: Path, *, pool: int = CREATORS * 2) -> client.ApiClient:
    """An API client for this benchmark's own requests: its own user agent (the audit
    log tells them apart), a connection pool for the creating threads."""
    configuration = client.Configuration()
    config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=str(kubeconfig), client_configuration=configuration, persist_config=False
    )
    configuration.connection_pool_maxsize = pool
    api = client.ApiClient(configuration)
    api.user_agent = USER_AGENT
    return api


def process_usage(pid: int) -> dict[str, float]:
    """RSS, peak RSS (MiB) and CPU seconds (user + system) of a live process."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return {
        "rss_mib": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
        "peak_rss_mib": round(int(fields["VmHWM"].split()[0]) / 1024, 1),
        "cpu_seconds": round((int(stat[11]) + int(stat[12])) / ticks, 2),
    }


# ---- the objects ------------------------------------------------------------------


def device_classes() -> list[dict[str, Any]]:
    """drasil's own gpu.drasil.dev (from the chart) and a minimal class beside it."""
    ours = [
        o
        for o in chart.render(namespace="drasil-system")
        if o["kind"] == "DeviceClass" and o["metadata"]["name"] == "gpu.drasil.dev"
    ]
    minimal = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": MINIMAL_CLASS},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    }
    return [*ours, minimal]


def claim_template(kind: str) -> dict[str, Any]:
    """One GPU: drasil's class and a selector on productName, or the minimal class."""
    request: dict[str, Any] = {"name": "gpu", "exactly": {"count": 1}}
    if kind == "drasil":
        expression = f'device.attributes["{DRIVER}"].productName == "{PRODUCT}"'
        request["exactly"] |= {
            "deviceClassName": "gpu.drasil.dev",
            "selectors": [{"cel": {"expression": expression}}],
        }
    else:
        request["exactly"]["deviceClassName"] = MINIMAL_CLASS
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": f"{kind}-gpu", "namespace": NAMESPACE},
        "spec": {"spec": {"devices": {"requests": [request]}}},
    }


def pod(name: str, kind: str, *, phase: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {BENCH_LABEL: phase, "drasil.dev/class": kind},
        },
        "spec": {
            "containers": [
                {
                    "name": "work",
                    "image": "drasil.local/e2e/busybox:1.0",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": f"{kind}-gpu"}],
            "terminationGracePeriodSeconds": 0,
        },
    }


def create_objects(kube: Kube) -> None:
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    wait_for(lambda: _has_default_sa(kube), timeout=60, what=f"ServiceAccount {NAMESPACE}/default")
    for obj in device_classes():
        kube.create(obj)
    for kind in CLASSES:
        kube.create(claim_template(kind), NAMESPACE)


def _has_default_sa(kube: Kube) -> Any:
    found = kube.core.list_namespaced_service_account(NAMESPACE).items
    names = [s.metadata.name for s in found if s.metadata is not None]
    return "default" in names or NotYet(names)


# ---- scheduling -------------------------------------------------------------------


@dataclass
class PodTimes:
    """When each Pod was created (before the POST) and first seen bound, monotonic."""

    created: dict[str, float] = field(default_factory=dict)
    scheduled: dict[str, float] = field(default_factory=dict)
    nodes: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def bound(self, names: Sequence[str]) -> int:
        with self.lock:
            return sum(1 for n in names if n in self.scheduled)


@contextlib.contextmanager
def watching_pods(api: client.ApiClient, times: PodTimes) -> Iterator[None]:
    """A watch on the benchmark's Pods that records when each gets its node."""
    stop = threading.Event()
    core = client.CoreV1Api(api)

    def record(pods: Sequence[Any]) -> None:
        now = time.monotonic()
        with times.lock:
            for obj in pods:
                node = obj.spec.node_name if obj.spec is not None else None
                if node and obj.metadata is not None:
                    times.scheduled.setdefault(obj.metadata.name, now)
                    times.nodes[obj.metadata.name] = node

    def follow() -> None:
        version: str | None = None
        while not stop.is_set():
            if version is None:  # (re)list: at the start, and when the watch expired
                listed = core.list_namespaced_pod(NAMESPACE, _request_timeout=120)
                record(listed.items)
                version = listed.metadata.resource_version if listed.metadata else None
            try:
                version = watch_once(version)
            except (ApiException, OSError, ValueError):
                version = None

    def watch_once(version: str | None) -> str | None:
        stream = watch.Watch().stream(  # type: ignore[no-untyped-call]
            core.list_namespaced_pod,
            NAMESPACE,
            resource_version=version,
            timeout_seconds=5,
            allow_watch_bookmarks=True,
            _request_timeout=30,
        )
        for event in stream:
            obj = event["object"]
            if event["type"] == "ERROR" or isinstance(obj, dict):
                return None  # e.g. 410 Gone: list again
            version = obj.metadata.resource_version
            if event["type"] != "BOOKMARK":
                record([obj])
            if stop.is_set():
                break
        return version

    thread = threading.Thread(target=follow, name="pod-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)


def create_pods(api: client.ApiClient, pods: Sequence[dict[str, Any]], times: PodTimes) -> None:
    core = client.CoreV1Api(api)

    def create(obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        with times.lock:
            times.created[name] = time.monotonic()
        core.create_namespaced_pod(NAMESPACE, cast(Any, obj), _request_timeout=60)

    with ThreadPoolExecutor(CREATORS) as pool:
        list(pool.map(create, pods))


def _all_bound(times: PodTimes, batch: Sequence[str]) -> Callable[[], bool | NotYet]:
    def check() -> bool | NotYet:
        bound = times.bound(batch)
        return bound == len(batch) or NotYet(f"{bound}/{len(batch)} bound")

    return check


def run_waves(api: client.ApiClient, params: Params, times: PodTimes) -> dict[str, Any]:
    """All scheduling waves; per class: Pods/s over its waves, latencies."""
    waves = max(1, params.pods_per_node // WAVE_PODS_PER_NODE)
    per_wave = params.nodes * WAVE_PODS_PER_NODE
    spent: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
    names: dict[str, list[str]] = {k: [] for k in CLASSES}
    for wave in range(waves):
        # A B B A ...: each class gets the emptier and the fuller waves alike.
        kind = CLASSES[(wave + wave // 2) % 2]
        batch = [f"{kind}-w{wave}-{i}" for i in range(per_wave)]
        started = time.monotonic()
        create_pods(api, [pod(n, kind, phase="fleet") for n in batch], times)
        wait_for(
            _all_bound(times, batch),
            timeout=max(600, per_wave),
            interval=0.5,
            what=f"wave {wave} ({len(batch)} {kind} Pods) scheduled",
        )
        spent[kind] += max(times.scheduled[n] for n in batch) - started
        names[kind] += batch
        print(
            f"bench.scale: N={params.nodes} wave {wave} {kind}: {len(batch)} Pods in "
            f"{time.monotonic() - started:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    result: dict[str, Any] = {}
    for kind in CLASSES:
        latencies = [times.scheduled[n] - times.created[n] for n in names[kind]]
        result[kind] = {
            "pods": len(names[kind]),
            "seconds": round(spent[kind], 2),
            "pods_per_second": round(len(names[kind]) / spent[kind], 1) if spent[kind] else 0.0,
            "create_to_scheduled_s": summary(latencies),
        }
    d, m = result["drasil"], result["minimal"]
    result["ratio_drasil_to_minimal"] = {
        "pods_per_second": round(d["pods_per_second"] / m["pods_per_second"], 3)
        if m["pods_per_second"]
        else None,
        "p50": _ratio(d["create_to_scheduled_s"]["p50"], m["create_to_scheduled_s"]["p50"]),
        "p99": _ratio(d["create_to_scheduled_s"]["p99"], m["create_to_scheduled_s"]["p99"]),
    }
    return result


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


# ---- what the scheduler allocated --------------------------------------------------


def allocation_problems(kube: Kube, times: PodTimes) -> list[str]:
    """Each bound Pod's claim allocated one device of its own node's pool, no device
    twice: what is wrong, empty if nothing."""
    claims = kube.resource("resource.k8s.io/v1", "ResourceClaim").get(namespace=NAMESPACE)
    by_pod: dict[str, Mapping[str, Any]] = {}
    for claim in claims.to_dict()["items"]:
        for owner in claim["metadata"].get("ownerReferences") or []:
            by_pod[owner["name"]] = claim
    problems, seen = [], set()
    for name, node in sorted(times.nodes.items()):
        claim = by_pod.get(name)
        results = ((claim or {}).get("status") or {}).get("allocation", {}).get("devices", {})
        results = results.get("results") or []
        if len(results) != 1:
            problems.append(f"Pod {name}: {len(results)} allocated devices")
            continue
        device = (results[0]["pool"], results[0]["device"])
        if device[0] != node:
            problems.append(f"Pod {name} on {node} got {device[0]}/{device[1]}")
        if device in seen:
            problems.append(f"{device[0]}/{device[1]} allocated twice")
        seen.add(device)
    return problems


# ---- the controller ---------------------------------------------------------------


@contextlib.contextmanager
def controller(
    kube: Kube, cluster: Cluster, *, heap: Path | None = None
) -> Iterator[ControllerProcess]:
    """drasil-controller with the chart's RBAC (e2e.harness.chart.chart_identity); with
    ``heap``, tracing its heap and reporting into that file on SIGUSR1 (``heap_report``)."""
    directory = cluster.run_dir / "controller"
    directory.mkdir(parents=True, exist_ok=True)
    with chart.chart_identity(
        kube,
        cluster.kubeconfig,
        component="controller",
        release="drasil-scale",
        driver=DRIVER,
        directory=directory,
    ) as identity:
        proc = ControllerProcess(
            kubeconfig=identity.kubeconfig,
            log_path=cluster.logs_dir / "drasil-controller.log",
            driver=DRIVER,
            lease=identity.lease,
            lease_namespace=identity.namespace,
            identity="bench-scale",
            # The chart's leader-election timings, not the e2e tests' short ones: under
            # this load an API request can take seconds, and a 3 s renew deadline
            # makes the controller give up its lease and exit (seen at N = 200).
            args=[
                f"--explain-after={EXPLAIN_AFTER}",
                "--leader-elect-lease-duration=15",
                "--leader-elect-renew-deadline=10",
                "--leader-elect-retry-period=2",
            ],
            env={HEAP_ENV: str(heap)} if heap is not None else {},
        )
        proc.start()
        proc.wait_logged("leading", timeout=120)
        try:
            yield proc
        finally:
            proc.stop()


def _pid(proc: ControllerProcess) -> int:
    if proc.proc is None or not proc.alive():
        raise RuntimeError(f"the controller exited; its log ends:\n{proc.tail()}")
    return proc.proc.pid


def heap_report(proc: ControllerProcess, traced: Path | None, out: Path) -> None:
    """Have the traced controller write its heap report, and keep it as ``out``."""
    if traced is None:
        return
    traced.unlink(missing_ok=True)
    os.kill(_pid(proc), signal.SIGUSR1)
    wait_for(traced.exists, timeout=300, interval=0.5, what=f"heap report {traced}")
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(traced, out)
    print(f"bench.scale: heap report {out}", file=sys.stderr, flush=True)


def unsatisfiable_times(
    api: client.ApiClient, params: Params, times: PodTimes
) -> tuple[dict[str, float], list[str]]:
    """Create ``probes`` Pods the full fleet cannot serve; seconds from each create to
    the controller's Unsatisfiable Event on it. Returns (times, probe names)."""
    core = client.CoreV1Api(api)
    names = [f"probe-{i}" for i in range(params.burst)]
    create_pods(api, [pod(n, "drasil", phase="probe") for n in names], times)
    seen: dict[str, float] = {}

    def events() -> Any:
        found = core.list_namespaced_event(
            NAMESPACE, field_selector="reason=Unsatisfiable,involvedObject.kind=Pod"
        )
        now = time.monotonic()
        for event in found.items:
            name = event.involved_object.name
            if name in times.created and name not in seen:
                seen[name] = now - times.created[name]
        return len(seen) == len(names) or NotYet(sorted(seen))

    wait_for(events, timeout=300, interval=0.25, what="Unsatisfiable Events on every probe")
    return seen, names


def drasil_events(api: client.ApiClient) -> int:
    core = client.CoreV1Api(api)
    found = core.list_namespaced_event(NAMESPACE, _request_timeout=120)
    return sum(1 for e in found.items if e.source and e.source.component == "drasil-controller")


# ---- drasil explain ---------------------------------------------------------------


def probe_claim(kube: Kube, probe: str) -> str:
    found = kube.get("v1", "Pod", probe, NAMESPACE)
    statuses = (found.get("status") or {}).get("resourceClaimStatuses") or []
    if not statuses:
        raise RuntimeError(f"Pod {probe} has no claim yet: {found.get('status')}")
    return str(statuses[0]["resourceClaimName"])


def explain_latency(cluster: Cluster, claim: str, runs: int) -> dict[str, Any]:
    """``drasil explain`` as a person runs it (a new process each time), and its two
    halves in this process: reading the inputs, evaluating them."""
    wall = []
    for _ in range(runs):
        started = time.perf_counter()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "drasil.driver.cli",
                "explain",
                f"{NAMESPACE}/{claim}",
                f"--kubeconfig={cluster.kubeconfig}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        wall.append(time.perf_counter() - started)
    api = api_from_kubeconfig(cluster.kubeconfig, user_agent=USER_AGENT)
    fetch, evaluate = [], []
    for _ in range(runs):
        started = time.perf_counter()
        inputs = fetch_inputs(api, namespace=NAMESPACE, name=claim, driver=DRIVER)
        fetched = time.perf_counter()
        explain_fetched(inputs, driver=DRIVER)
        fetch.append(fetched - started)
        evaluate.append(time.perf_counter() - fetched)
    return {
        "cli_wall_s": summary(wall),
        "fetch_s": summary(fetch),
        "evaluate_s": summary(evaluate),
        "inputs": {
            "slices": len(inputs.slices),
            "claims": len(inputs.claims),
            "nodes": len(inputs.nodes or ()),
            "pods": len(inputs.pods),
        },
        "output_first_line": out.stdout.splitlines()[0] if out.stdout else "",
    }


# ---- the API server's writes --------------------------------------------------------


def request_totals(cluster: Cluster) -> Counter[tuple[str, str]]:
    """apiserver_request_total of write verbs, by (verb, resource[/subresource])."""
    code, body = cluster.api_get("/metrics", timeout=30)
    if code != 200:
        raise RuntimeError(f"GET /metrics: {code} {body[:200]}")
    totals: Counter[tuple[str, str]] = Counter()
    for line in body.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels_text, _, value = line.rpartition(" ")
        labels = dict(
            part.split("=", 1)
            for part in labels_text[len("apiserver_request_total{") : -1].split(",")
        )
        labels = {k: v.strip('"') for k, v in labels.items()}
        if labels.get("verb") not in WRITE_VERBS:
            continue
        resource = labels.get("resource", "")
        if labels.get("subresource"):
            resource += f"/{labels['subresource']}"
        totals[(labels["verb"], resource)] += int(float(value))
    return totals


def audit_writes(
    cluster: Cluster, since: float, until: float, users: Mapping[str, str]
) -> Counter[tuple[str, str, str]]:
    """Writes in the audit log between two wall-clock times, by (who, verb, resource);
    ``users`` names the users we know (username prefix -> short name)."""
    counts: Counter[tuple[str, str, str]] = Counter()
    with cluster.audit_log.open() as log:
        for line in log:
            entry = json.loads(line)
            when = _rfc3339_seconds(entry.get("stageTimestamp", ""))
            if not since <= when < until:
                continue
            who = _who(entry, users)
            ref = entry.get("objectRef") or {}
            resource = ref.get("resource", "")
            if ref.get("subresource"):
                resource += f"/{ref['subresource']}"
            counts[(who, entry.get("verb", ""), resource)] += 1
    return counts


def _who(entry: Mapping[str, Any], users: Mapping[str, str]) -> str:
    username = (entry.get("user") or {}).get("username", "")
    for prefix, short in users.items():
        if username.startswith(prefix):
            return short
    agent = str(entry.get("userAgent", "")).split("/")[0]
    return f"{username} ({agent})" if agent else username


def _rfc3339_seconds(text: str) -> float:
    if not text:
        return 0.0
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def per_minute(counts: Mapping[Any, int], minutes: float) -> list[dict[str, Any]]:
    rows = []
    for key, count in sorted(counts.items(), key=lambda kv: -kv[1]):
        row = dict(zip(("who", "verb", "resource")[-len(key) :], key, strict=True))
        rows.append({**row, "count": count, "per_minute": round(count / minutes, 2)})
    return rows


# ---- one fleet size ---------------------------------------------------------------


def drasil_users(identity_namespace: str) -> dict[str, str]:
    return {
        "system:serviceaccount:drasil-fleet-system:": "drasil fleet publisher (kubelet-plugin SA)",
        f"system:serviceaccount:{identity_namespace}:": "drasil controller",
    }


def health_flip(cluster: Cluster, fleet: KwokFleet, users: Mapping[str, str]) -> dict[str, Any]:
    """One device of one node unhealthy, then healthy again: the writes of each."""
    node = f"{fleet.state['prefix']}{'0' * len(str(max(fleet.state['nodes'] - 1, 0)))}"
    result = {}
    for healthy in (False, True):
        since = time.time()
        answer = fleet.flip(node, "gpu-3", healthy=healthy)
        time.sleep(1.0)  # the audit log is written as requests complete
        audit = audit_writes(cluster, since - 0.5, time.time(), users)
        fleet_writes = {
            f"{verb} {resource}": n
            for (who, verb, resource), n in audit.items()
            if who.startswith("drasil fleet")
        }
        result["unhealthy" if not healthy else "healthy_again"] = {
            "publisher_writes": answer["writes"],
            "publisher_verbs": answer["verbs"],
            "audit_fleet_writes": fleet_writes,
        }
    return {"node": node, "device": "gpu-3", **result}


def idle_window(
    cluster: Cluster, proc: ControllerProcess, minutes: float, users: Mapping[str, str]
) -> dict[str, Any]:
    before_metrics, before_usage = request_totals(cluster), process_usage(_pid(proc))
    since = time.time()
    print(f"bench.scale: idle for {minutes} min", file=sys.stderr, flush=True)
    time.sleep(minutes * 60)
    until = time.time()
    after_metrics, after_usage = request_totals(cluster), process_usage(_pid(proc))
    by_verb = after_metrics - before_metrics
    audit = audit_writes(cluster, since, until, users)
    drasil = sum(n for (who, _, _), n in audit.items() if who.startswith("drasil"))
    drasil_non_lease = sum(
        n for (who, _, res), n in audit.items() if who.startswith("drasil") and res != "leases"
    )
    return {
        "minutes": minutes,
        "writes_per_minute_total": round(sum(by_verb.values()) / minutes, 2),
        "writes_by_verb_resource": per_minute(by_verb, minutes),
        "writes_by_user": per_minute(audit, minutes),
        "drasil_writes_per_minute": round(drasil / minutes, 2),
        "drasil_writes_per_minute_without_leader_lease": round(drasil_non_lease / minutes, 2),
        "controller_cpu_seconds": round(
            after_usage["cpu_seconds"] - before_usage["cpu_seconds"], 2
        ),
    }


def run_fleet(
    params: Params, *, inspect: Callable[[Cluster, PodTimes], None] | None = None
) -> dict[str, Any]:
    """Everything above for one fleet size, on a cluster of its own; ``inspect`` (a
    test's checks) is called once the fleet's Pods are all scheduled."""
    cluster = Cluster(die_with_parent=True, out=sys.stderr)
    setup = time.monotonic()
    try:
        cluster.up(fake_nodes=params.nodes, fleet_profile=params.profile, timeout=180)
        fleet = cluster.fleet
        assert fleet is not None
        setup_s = time.monotonic() - setup
        kube = Kube(cluster.kubeconfig)
        api = api_client(cluster.kubeconfig)
        create_objects(kube)
        times = PodTimes()
        traced = cluster.run_dir / "controller" / "heap.txt" if params.tracemalloc else None
        heap_dir = params.tracemalloc or Path()
        with controller(kube, cluster, heap=traced) as proc, watching_pods(api, times):
            users = drasil_users("drasil-scale-system")
            usage = {"started": process_usage(_pid(proc))}
            started_at = time.monotonic()
            busy_since = time.time()
            scheduling = run_waves(api, params, times)
            busy_until = time.time()
            busy = audit_writes(cluster, busy_since, busy_until, users)
            problems = allocation_problems(kube, times)
            if inspect is not None:
                inspect(cluster, times)
            usage["after_scheduling"] = process_usage(_pid(proc))
            scheduled_s = time.monotonic() - started_at
            heap_report(proc, traced, heap_dir / f"heap-N{params.nodes}-scheduled.txt")
            events_before = drasil_events(api)
            probe_started = time.monotonic()
            to_event, probes = unsatisfiable_times(api, params, times)
            usage["after_probes"] = process_usage(_pid(proc))
            explain = explain_latency(cluster, probe_claim(kube, probes[0]), params.explain_runs)
            flip = health_flip(cluster, fleet, users)
            idle = idle_window(cluster, proc, params.idle_minutes, users)
            usage["after_idle"] = process_usage(_pid(proc))
            heap_report(proc, traced, heap_dir / f"heap-N{params.nodes}-idle.txt")
            events = drasil_events(api) - events_before
            elapsed_min = (time.monotonic() - probe_started) / 60
            metrics = proc.metrics()
        return {
            "nodes": params.nodes,
            "gpus": params.nodes * sum(n for _, n in parse_profile_spec(params.profile)),
            "pods": len(times.created),
            "fleet_setup_s": round(setup_s, 1),
            "publisher": fleet.publisher_status(),
            "scheduling": scheduling,
            "writes_while_scheduling_by_user": [
                r for r in per_minute(busy, (busy_until - busy_since) / 60) if r["count"] >= 1
            ],
            "allocation_problems": problems[:20],
            "controller": {
                "usage": usage,
                "explain_after_s": EXPLAIN_AFTER,
                "burst_pods": params.burst,
                "create_to_unsatisfiable_event_s": summary(list(to_event.values())),
                "events_since_probes": events,
                "events_per_minute_since_probes": round(events / elapsed_min, 2),
                "explain_seconds_total": metrics.get(
                    "drasil_controller_explain_duration_seconds_sum"
                ),
                "explains": metrics.get("drasil_controller_explain_duration_seconds_count"),
                "explain_ms_per_claim": _per_claim_ms(metrics),
                "cpu_per_scheduled_pod": cpu_per_scheduled_pod(
                    usage, scheduled_s, len(times.created) - params.burst
                ),
            },
            "explain": explain,
            "health_flip": flip,
            "idle": idle,
        }
    finally:
        with contextlib.suppress(Exception):
            cluster.down()


def cpu_per_scheduled_pod(
    usage: Mapping[str, Mapping[str, float]], seconds: float, pods: int
) -> dict[str, float]:
    """The controller's CPU milliseconds per Pod of the waves, from its start to the
    end of scheduling, and how long that took (``seconds``): the controller's CPU per
    watch event rises as the events come slower, and the waves take about 20 times
    longer at N = 500 than at N = 50, the scheduler's pace (docs/scale.md)."""
    spent = usage["after_scheduling"]["cpu_seconds"] - usage["started"]["cpu_seconds"]
    return {"seconds": round(seconds, 1), "ms": round(1000 * spent / max(pods, 1), 2)}


def _per_claim_ms(metrics: Mapping[str, float]) -> float | None:
    total = metrics.get("drasil_controller_explain_duration_seconds_sum")
    count = metrics.get("drasil_controller_explain_duration_seconds_count")
    return round(1000 * total / count, 1) if total is not None and count else None


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg(),
        "note": "shared 2-core machine: other engineers' builds and tests ran meanwhile",
    }


COLUMNS = (
    ("nodes", ("nodes",)),
    ("GPUs", ("gpus",)),
    ("Pods", ("pods",)),
    ("fleet up (s)", ("fleet_setup_s",)),
    ("drasil Pods/s", ("scheduling", "drasil", "pods_per_second")),
    ("minimal Pods/s", ("scheduling", "minimal", "pods_per_second")),
    ("ratio", ("scheduling", "ratio_drasil_to_minimal", "pods_per_second")),
    ("drasil p50 s", ("scheduling", "drasil", "create_to_scheduled_s", "p50")),
    ("drasil p99 s", ("scheduling", "drasil", "create_to_scheduled_s", "p99")),
    ("minimal p50 s", ("scheduling", "minimal", "create_to_scheduled_s", "p50")),
    ("minimal p99 s", ("scheduling", "minimal", "create_to_scheduled_s", "p99")),
    # After scheduling nothing is pending at any N: the figure to compare across N.
    ("ctrl RSS MiB after scheduling", ("controller", "usage", "after_scheduling", "rss_mib")),
    ("ctrl RSS MiB (end)", ("controller", "usage", "after_idle", "rss_mib")),
    ("ctrl CPU s while scheduling", ("controller", "usage", "after_scheduling", "cpu_seconds")),
    ("ctrl CPU s (end)", ("controller", "usage", "after_idle", "cpu_seconds")),
    ("ctrl CPU s in the idle window", ("idle", "controller_cpu_seconds")),
    ("ctrl CPU ms per scheduled Pod", ("controller", "cpu_per_scheduled_pod", "ms")),
    ("burst of pending Pods", ("controller", "burst_pods")),
    ("p50 to Unsatisfiable s", ("controller", "create_to_unsatisfiable_event_s", "p50")),
    ("p99 to Unsatisfiable s", ("controller", "create_to_unsatisfiable_event_s", "p99")),
    ("ctrl ms per explanation", ("controller", "explain_ms_per_claim")),
    ("Events/min", ("controller", "events_per_minute_since_probes")),
    ("explain CLI p50 s", ("explain", "cli_wall_s", "p50")),
    ("explain fetch p50 s", ("explain", "fetch_s", "p50")),
    ("explain evaluate p50 s", ("explain", "evaluate_s", "p50")),
    ("flip writes", ("health_flip", "unhealthy", "publisher_writes")),
    ("idle writes/min, all", ("idle", "writes_per_minute_total")),
    ("idle drasil writes/min", ("idle", "drasil_writes_per_minute")),
    ("idle drasil writes/min w/o Lease", ("idle", "drasil_writes_per_minute_without_leader_lease")),
)


def _pick(run: Mapping[str, Any], path: Sequence[str]) -> Any:
    value: Any = run
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def table(runs: Sequence[Mapping[str, Any]]) -> str:
    """The figures per fleet size as a Markdown table (docs/scale.md): one row per
    figure, one column per N, so the growth reads across."""
    lines = [
        "| figure | " + " | ".join(f"N = {run['nodes']}" for run in runs) + " |",
        "|---|" + "---:|" * len(runs),
    ]
    for name, path in COLUMNS[1:]:
        cells = " | ".join(str(_pick(run, path)) for run in runs)
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    parser.add_argument("--nodes", default="50,200,500", help="fleet sizes, comma-separated")
    parser.add_argument("--idle-minutes", type=float, default=10.0)
    parser.add_argument("--pods-per-node", type=int, default=8)
    parser.add_argument("--profile", default=DEFAULT_FLEET_PROFILE)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--tracemalloc",
        type=Path,
        metavar="DIR",
        help="trace the controller's heap (slower) and write its reports into DIR",
    )
    args = parser.parse_args(argv)
    allow_nesting()  # it explains claims in-process, as the controller does
    sizes = [int(n) for n in args.nodes.split(",") if n.strip()]
    runs = []
    started = time.time()
    for n in sizes:
        params = Params(
            nodes=n,
            profile=args.profile,
            pods_per_node=args.pods_per_node,
            idle_minutes=args.idle_minutes,
            tracemalloc=args.tracemalloc,
        )
        runs.append(run_fleet(params))
        result = {
            "machine": machine(),
            "params": {**asdict(params), "nodes": sizes, "tracemalloc": bool(params.tracemalloc)},
            "started": started,
            "runs": runs,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")  # after each size
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

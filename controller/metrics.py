"""Prometheus metrics of the controller (served on ``--metrics-addr``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Explaining one claim is CPU work over every published device: milliseconds to a second.
_EXPLAIN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# A satisfiable claim's wait: a re-check (30 s) to the scheduler's 5-minute flush and past.
_WAIT_BUCKETS = (30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class ControllerMetrics:
    """One set of metrics per controller process, on its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.events = Counter(
            "drasil_controller_events_posted",
            "Kubernetes Events posted, by reason (InvalidDeviceConfig|Unsatisfiable|"
            "ExplanationIncomplete|SchedulerNotRetried) and the "
            "kind of object they are about.",
            ["reason", "kind"],
            registry=self.registry,
        )
        self.events_deferred = Counter(
            "drasil_controller_events_deferred",
            "Changed explanation texts left for the next re-check because the "
            "controller-wide repost budget was spent, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.pool_publishes = Counter(
            "drasil_controller_pool_publishes",
            "DevicePool reconciliations by result (published|unchanged|invalid|rejected|"
            "conflict|error).",
            ["result"],
            registry=self.registry,
        )
        self.pools_ready = Gauge(
            "drasil_controller_pools_ready",
            "DevicePools of this driver whose Ready condition is True.",
            registry=self.registry,
        )
        self.slice_writes = Counter(
            "drasil_controller_resourceslice_writes",
            "ResourceSlice writes by verb (create|update|delete) and result.",
            ["verb", "result"],
            registry=self.registry,
        )
        self.explain_duration = Histogram(
            "drasil_controller_explain_duration_seconds",
            "Time to explain one pending claim against the published devices.",
            buckets=_EXPLAIN_BUCKETS,
            registry=self.registry,
        )
        self.scheduler_stalls = Counter(
            "drasil_controller_scheduler_stalls",
            "Pending claims that every explanation found satisfiable for --stall-after "
            "seconds while kube-scheduler did not allocate them (once per episode).",
            registry=self.registry,
        )
        self.stalled_claims = Gauge(
            "drasil_controller_stalled_claims",
            "Pending claims satisfiable for --stall-after seconds or longer right now.",
            registry=self.registry,
        )
        self.satisfiable_wait = Histogram(
            "drasil_controller_satisfiable_wait_seconds",
            "How long a claim stayed pending after an explanation first found it "
            "satisfiable, observed when it stops waiting (allocated, deleted, no Pod).",
            buckets=_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.device_status_writes = Counter(
            "drasil_controller_device_status_writes",
            "Server-side applies of a claim's status.devices, by result.",
            ["result"],
            registry=self.registry,
        )
        self.leader = Gauge(
            "drasil_controller_leader",
            "1 while this replica holds the leader Lease (or runs without election).",
            registry=self.registry,
        )

    def slice_write(self, verb: str, ok: bool) -> None:
        """``PoolPublisher.on_write``."""
        self.slice_writes.labels(verb, "success" if ok else "error").inc()

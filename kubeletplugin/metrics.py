"""Prometheus metrics of the node daemon (served on ``--metrics-addr``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Prepare is on the Pod start path: buckets resolve the single-millisecond range.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class PluginMetrics:
    """One set of metrics per plugin process, on its own registry (tests make many)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.operations = Counter(
            "drasil_claim_operations",
            "Claims prepared or unprepared, by operation and result (success|error).",
            ["operation", "result"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "drasil_claim_operation_duration_seconds",
            "Time to prepare or unprepare one claim.",
            ["operation"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.prepared_claims = Gauge(
            "drasil_prepared_claims",
            "Claims recorded as prepared in the checkpoint.",
            registry=self.registry,
        )
        self.devices = Gauge(
            "drasil_devices",
            "Devices of this node by health (Healthy|Unhealthy).",
            ["health"],
            registry=self.registry,
        )
        self.slice_writes = Counter(
            "drasil_resourceslice_writes",
            "ResourceSlice writes by verb (create|update|delete) and result.",
            ["verb", "result"],
            registry=self.registry,
        )

    def observe(self, operation: str, *, seconds: float, error: bool) -> None:
        self.operations.labels(operation, "error" if error else "success").inc()
        self.duration.labels(operation).observe(seconds)

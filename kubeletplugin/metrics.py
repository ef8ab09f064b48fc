"""Prometheus metrics of the node daemon (served on ``--metrics-addr``).

``PluginMetrics`` are DRA mode's, ``DevicePluginMetrics`` device-plugin mode's; both
carry the one ``drasil_devices`` gauge, which ``node.NodeRuntime`` keeps current.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Prepare is on the Pod start path: buckets resolve the single-millisecond range.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def devices_gauge(registry: CollectorRegistry) -> Gauge:
    """``drasil_devices{health}``: one name in both modes, so one dashboard fits every node."""
    return Gauge(
        "drasil_devices",
        "Devices of this node by health (Healthy|Unhealthy).",
        ["health"],
        registry=registry,
    )


def _by_result(name: str, documentation: str, label: str, registry: CollectorRegistry) -> Counter:
    return Counter(name, documentation, [label, "result"], registry=registry)


class PluginMetrics:
    """DRA mode's metrics, on their own registry (tests make many)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.operations = _by_result(
            "drasil_claim_operations",
            "Claims prepared or unprepared, by operation and result (success|error).",
            "operation",
            self.registry,
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
        self.devices = devices_gauge(self.registry)
        self.device_plugin_conflicts = Gauge(
            "drasil_device_plugin_conflicts",
            "Allocatable count of another device plugin's resource on this Node; while "
            "one is above 0 drasil publishes none of that vendor's GPUs.",
            ["resource"],
            registry=self.registry,
        )
        self.slice_writes = _by_result(
            "drasil_resourceslice_writes",
            "ResourceSlice writes by verb (create|update|delete) and result.",
            "verb",
            self.registry,
        )

    def observe(self, operation: str, *, seconds: float, error: bool) -> None:
        self.operations.labels(operation, "error" if error else "success").inc()
        self.duration.labels(operation).observe(seconds)


class DevicePluginMetrics:
    """Device-plugin mode's metrics, on their own registry (tests make many)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.devices = devices_gauge(self.registry)
        self.registrations = _by_result(
            "drasil_device_plugin_registrations",
            "Register calls to kubelet by resource and result (success|error).",
            "resource",
            self.registry,
        )
        self.allocations = _by_result(
            "drasil_device_plugin_allocations",
            "Allocate calls by resource and result (success|error).",
            "resource",
            self.registry,
        )

    def allocated(self, resource: str, ok: bool) -> None:
        self.allocations.labels(resource, "success" if ok else "error").inc()

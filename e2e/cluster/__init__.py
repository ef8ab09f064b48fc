"""`python -m e2e.cluster up|down|status|env` and the `Cluster` API the fixtures use."""

from e2e.cluster.control_plane import (
    COMPONENTS,
    Cluster,
    ClusterError,
    ClusterStatus,
    ComponentStatus,
    running_cluster,
)

__all__ = [
    "COMPONENTS",
    "Cluster",
    "ClusterError",
    "ClusterStatus",
    "ComponentStatus",
    "running_cluster",
]

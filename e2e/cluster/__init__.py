"""`python -m e2e.cluster up|down|status|env` and the `Cluster` API the fixtures use."""

from e2e.cluster.control_plane import (
    COMPONENTS,
    Cluster,
    ClusterError,
    ClusterStatus,
    ComponentStatus,
    running_cluster,
)
from e2e.cluster.node import NODE_NAME, Node, NodeError

__all__ = [
    "COMPONENTS",
    "NODE_NAME",
    "Cluster",
    "ClusterError",
    "ClusterStatus",
    "ComponentStatus",
    "Node",
    "NodeError",
    "running_cluster",
]

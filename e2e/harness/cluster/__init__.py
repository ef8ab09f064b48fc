"""`Cluster`, the API the fixtures, tools and benchmarks use (CLI: `python -m tools.cluster`).

- `rundir`: one run's directory and state, and finding the runs of this checkout;
- `control_plane`: `Cluster`, etcd and the Kubernetes control plane of a run;
- `node`, `nodeconfig`: the run's real node (containerd, kubelet, the plugin), its files;
- `fleet`: the run's simulated fleet (KWOK, fake Nodes, the fleet publisher);
- `host`: what a run changes on this machine (mounts, cgroups, bridge, ports, sockets);
- `pki`: the run's CA, certificates and kubeconfigs.
"""

from e2e.harness.cluster.control_plane import (
    COMPONENTS,
    Cluster,
    ClusterStatus,
    ComponentStatus,
    running_cluster,
)
from e2e.harness.cluster.node import NODE_NAME, Node, NodeError
from e2e.harness.cluster.rundir import ClusterError

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

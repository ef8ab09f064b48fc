"""The node's GPU labels kept on its Node (``--node-labels``).

The labels come from ``drasil.driver.nvidia.nodelabels`` over the devices discovery
found. Two ways to put them on the Node:

- a Node Feature Discovery local feature file (``--nfd-features-dir``, NFD's
  ``features.d``): NFD's worker publishes its lines as labels, the way NFD wants other
  components to label nodes; the plugin needs no write access to Nodes;
- otherwise a merge patch of the plugin's own Node, which the chart's RBAC allows and
  its admission policy narrows to the node the plugin's token is bound to and to the
  keys ``OWN_KEY`` matches.

Only keys ``OWN_KEY`` matches are ever changed or removed: the operator's own labels
stay. Applied at start and every ``INTERVAL`` (someone may have removed one); failures
are retried with backoff and never stop the plugin.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from drasil.driver.files import write_atomic
from drasil.driver.kubeapi import KubeApi

log = logging.getLogger(__name__)

INTERVAL = 300.0
BACKOFF_START = 1.0
BACKOFF_MAX = 60.0
NFD_FILE = "drasil-gpu"


def label_patch(
    current: Mapping[str, str], wanted: Mapping[str, str], *, owned: Callable[[str], object]
) -> dict[str, str | None]:
    """The merge patch from the Node's `current` labels to `wanted` (None removes one):
    wanted keys set where they differ, `owned` keys no longer wanted removed (the
    vendors' own keys: the operator's labels are never touched)."""
    patch: dict[str, str | None] = {k: v for k, v in wanted.items() if current.get(k) != v}
    patch.update({k: None for k in current if owned(k) and k not in wanted})
    return patch


def feature_file(wanted: Mapping[str, str]) -> bytes:
    """NFD's local feature file format: one ``name=value`` per line."""
    lines = ["# drasil's GPU labels of this node (drasil-kubelet-plugin --node-labels)"]
    lines += [f"{k}={v}" for k, v in sorted(wanted.items())]
    return ("\n".join(lines) + "\n").encode()


class NodeLabels:
    """Keeps `wanted` on Node `node_name`: in `nfd_dir` when given, else on the Node."""

    def __init__(
        self,
        api: KubeApi,
        *,
        node_name: str,
        wanted: Mapping[str, str],
        owned: Callable[[str], object],
        nfd_dir: Path | None = None,
    ) -> None:
        self.api = api
        self.node_name = node_name
        self.wanted = dict(wanted)
        self.owned = owned
        self.nfd_dir = nfd_dir

    def apply_once(self) -> int:
        """Put the labels in place; how many keys were written or removed."""
        if self.nfd_dir is not None:
            path = self.nfd_dir / NFD_FILE
            data = feature_file(self.wanted)
            if path.exists() and path.read_bytes() == data:
                return 0
            write_atomic(path, data, crash_tag="nfd-features")
            return len(self.wanted)
        current = self.api.get_node_labels(self.node_name)
        if current is None:
            raise LookupError(f"Node {self.node_name} not found")
        patch = label_patch(current, self.wanted, owned=self.owned)
        if patch and not self.api.patch_node_labels(self.node_name, patch):
            raise LookupError(f"Node {self.node_name} not found")
        return len(patch)

    def run(self, stop: threading.Event, *, interval: float = INTERVAL) -> None:
        backoff = BACKOFF_START
        while not stop.is_set():
            try:
                changed = self.apply_once()
            except Exception as err:  # API server away, Node not there yet: again later
                log.warning(
                    "could not label the node; retrying",
                    extra={"node": self.node_name, "retryIn": backoff, "error": str(err)},
                )
                stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            if changed:
                log.info("node labels applied", extra={"node": self.node_name, "keys": changed})
            backoff = BACKOFF_START
            stop.wait(interval)

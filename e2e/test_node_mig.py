"""Dynamic MIG on the real node: containers get the MIG devices cut for their claims.

The node's plugin is restarted in ``--mig-mode dynamic`` for this module (its eight
simulated H100s are then published whole and as every MIG placement) and put back in
static mode afterwards, with its simulated GPUs reset, so later tests see the node as
before.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from e2e.harness.cluster.node import Node
from e2e.harness.kube import RESOURCE, Kube, NotYet, wait_for
from e2e.harness.pluginproc import DRIVER
from e2e.harness.pods import (
    checkpoint,
    container_env,
    delete_pod,
    pod,
    template,
    visible_uuids,
    wait_running,
)

GPUS = 8
DEVICES_PER_H100 = 26  # the whole GPU and its 25 MIG placements
MIG_CLASS = f"mig-node-e2e.{DRIVER}"


@pytest.fixture(scope="module")
def dynamic(node: Node, kube: Kube) -> Iterator[Node]:
    mig_class = {
        "apiVersion": RESOURCE,
        "kind": "DeviceClass",
        "metadata": {"name": MIG_CLASS},
        "spec": {
            "selectors": [
                {
                    "cel": {
                        "expression": f'device.driver == "{DRIVER}" && '
                        f'device.attributes["{DRIVER}"].type == "mig"'
                    }
                }
            ]
        },
    }
    kube.delete(RESOURCE, "DeviceClass", MIG_CLASS)
    kube.create(mig_class)
    node.restart_plugin_with({"MIG_MODE": "dynamic"}, published=GPUS * DEVICES_PER_H100)
    yield node
    # A GPU reset on the way back: MIG mode off, so static mode publishes whole GPUs.
    node.restart_plugin_with({"MIG_MODE": None}, published=GPUS, reset_gpus=True)
    kube.delete(RESOURCE, "DeviceClass", MIG_CLASS)


def _mig_pod(kube: Kube, ns: str, node: Node, profile: str) -> str:
    """A Pod asking for a MIG device of ``profile`` on the node's first GPU."""
    attributes = f'device.attributes["{DRIVER}"]'
    selector = f'{attributes}.profile == "{profile}" && {attributes}.minor == 0'
    request = {
        "name": "gpu",
        "exactly": {"deviceClassName": MIG_CLASS, "selectors": [{"cel": {"expression": selector}}]},
    }
    return pod(kube, ns, node, template_name=template(kube, ns, requests=[request]))


def _claim_uid(kube: Kube, ns: str, pod: str) -> str:
    statuses = kube.get("v1", "Pod", pod, ns)["status"].get("resourceClaimStatuses") or []
    claim = kube.get(RESOURCE, "ResourceClaim", statuses[0]["resourceClaimName"], ns)
    return str(claim["metadata"]["uid"])


def test_two_pods_on_one_h100_each_see_only_their_own_mig_device(
    kube: Kube, ns: str, dynamic: Node
) -> None:
    pods = [_mig_pod(kube, ns, dynamic, "3g.40gb") for _ in range(2)]
    for name in pods:
        wait_running(kube, ns, name)
    held = checkpoint(dynamic)
    uids = [_claim_uid(kube, ns, name) for name in pods]
    seen = []
    for name, uid in zip(pods, uids, strict=True):
        record = held[uid]
        mig = record["devices"][0]["mig"]
        assert mig["state"] == "Created"
        assert visible_uuids(container_env(kube, ns, name)) == [mig["uuid"]]
        seen.append(mig["uuid"])
    assert len(set(seen)) == 2
    for name in pods:
        delete_pod(kube, ns, name)
    wait_for(
        lambda: NotYet(checkpoint(dynamic)) if set(uids) & set(checkpoint(dynamic)) else True,
        timeout=120,
        what="both claims unprepared and their instances destroyed",
    )
    state = json.loads((dynamic.plugin.state_dir / "simulated-gpus.json").read_text())
    assert all(not gpu.get("gpuInstances") for gpu in state["gpus"].values()), state

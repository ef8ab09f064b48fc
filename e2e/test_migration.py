"""Pods written for NVIDIA's device plugin run unchanged on a drasil DRA node.

The chart's DeviceClasses, rendered with the values docs/migrating.md gives
(`deviceClasses.extendedResourceName: nvidia.com/gpu`, `migProfiles: [1g.10gb]` with
`migExtendedResourcePrefix: nvidia.com/mig-`), are created on the cluster as Helm would
create them, and the node's plugin runs in dynamic MIG mode (its eight simulated H100s
published whole and as every MIG placement; put back in static mode afterwards, its
GPUs reset). Expected end states:

- the plugin (`NODE_LABELS=gfd`) labels its Node from discovery under drasil.dev/ and
  GPU Feature Discovery's nvidia.com/ names (product, count, memory, family, compute
  capability, MIG and MPS); a Pod with `resources.limits: {nvidia.com/gpu: 1}` and a
  node selector on `nvidia.com/gpu.product`, nothing else of DRA, runs; the scheduler
  made its claim from the class of that extended resource, and its container sees
  exactly one GPU, the whole GPU allocated;
- a Pod with `resources.limits: {nvidia.com/mig-1g.10gb: 1}` runs; its claim holds a
  1g.10gb MIG instance cut for it, and its container sees exactly that instance;
- both Pods deleted, the node holds nothing of their claims (instance destroyed);
- another device plugin registered for the same GPUs (drasil's own device-plugin mode
  standing in for NVIDIA's, its resource `drasil.dev/gpu` named in the DRA plugin's
  `DEVICE_PLUGIN_RESOURCES`): the DRA plugin publishes none of its devices and posts a
  `DevicePluginConflict` Node Event naming the resource, its count and the way out; a
  Pod with a claim for a GPU does not start: kube-scheduler finds no device
  (FailedScheduling), or, where its informer had not yet seen the devices go, the
  plugin refuses the prepare, naming the conflict; the device plugin stopped (the Node
  reports 0), the devices are published again (`DevicePluginConflictCleared`) and the
  Pod runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from e2e.harness.chart import render
from e2e.harness.cluster.node import Node
from e2e.harness.kube import RESOURCE, Kube, NotYet, wait_for
from e2e.harness.pluginproc import DRIVER, GPU_RESOURCE
from e2e.harness.pods import (
    checkpoint,
    container_env,
    device_uuid,
    drain_namespace,
    events,
    node_events,
    pod,
    template,
    visible_uuids,
    wait_running,
)
from e2e.test_node import allocated_device, pod_claim
from e2e.test_node_mig import DEVICES_PER_H100, GPUS

# docs/migrating.md, "Pods that ask for nvidia.com/gpu".
MIGRATION_VALUES = [
    f"driverName={DRIVER}",
    "deviceClasses.extendedResourceName=nvidia.com/gpu",
    "deviceClasses.migProfiles={1g.10gb}",
    "deviceClasses.migExtendedResourcePrefix=nvidia.com/mig-",
]
CLASSES = ("gpu.drasil.dev", "mig-1g.10gb.drasil.dev")
DEVICE_PLUGIN_RESOURCES = "DEVICE_PLUGIN_RESOURCES"  # the DRA plugin's env
NODE_LABELS = "NODE_LABELS"  # the DRA plugin's env
PRODUCT = "NVIDIA-H100-80GB-HBM3"  # the simulated H100's productName as a label value
# kubeletplugin/dra/doublebooking.py's Event reasons
CONFLICT_REASON = "DevicePluginConflict"
CLEARED_REASON = "DevicePluginConflictCleared"


@pytest.fixture(scope="module")
def migrated(kube: Kube, node: Node) -> Iterator[Node]:
    """The chart's classes for whole GPUs and 1g.10gb instances; the plugin in dynamic
    MIG mode."""
    rendered = render(namespace="drasil-system", sets=MIGRATION_VALUES)
    classes = [o for o in rendered if o["kind"] == "DeviceClass"]
    chosen = [c for c in classes if c["metadata"]["name"] in CLASSES]
    assert len(chosen) == len(CLASSES), [c["metadata"]["name"] for c in classes]
    for obj in chosen:
        kube.delete(RESOURCE, "DeviceClass", obj["metadata"]["name"])
        kube.create(obj)
    env = {"MIG_MODE": "dynamic", NODE_LABELS: "gfd"}
    node.restart_plugin_with(env, published=GPUS * DEVICES_PER_H100)
    yield node
    back: dict[str, str | None] = {"MIG_MODE": None, NODE_LABELS: None}
    node.restart_plugin_with(back, published=GPUS, reset_gpus=True)
    for name in CLASSES:
        kube.delete(RESOURCE, "DeviceClass", name)


@pytest.fixture
def moved(namespace: str, kube: Kube, migrated: Node) -> Iterator[str]:
    yield namespace
    drain_namespace(kube, migrated, namespace)


def _labelled(kube: Kube, node: str) -> Any:
    """The Node's labels once the plugin put GFD's names on it."""
    labels = kube.get("v1", "Node", node)["metadata"].get("labels") or {}
    return labels if "nvidia.com/gpu.product" in labels else NotYet(labels)


def _record(node: Node, claim: dict[str, Any]) -> dict[str, Any]:
    """The node's checkpoint record of the claim's one device."""
    (device,) = checkpoint(node)[claim["metadata"]["uid"]]["devices"]
    return dict(device)


def test_a_pod_selecting_gfd_labels_asking_for_nvidia_com_gpu_gets_one_whole_gpu(
    kube: Kube, moved: str, migrated: Node
) -> None:
    labels = wait_for(
        lambda: _labelled(kube, migrated.name), timeout=60, what="the node's GPU labels"
    )  # fmt: skip
    for prefix in ("drasil.dev/", "nvidia.com/"):
        assert labels[prefix + "gpu.product"] == PRODUCT
        assert labels[prefix + "gpu.count"] == str(GPUS)
        assert labels[prefix + "gpu.memory"] == "81920"  # MiB, as GFD has it
        assert labels[prefix + "gpu.family"] == "hopper"
        assert (labels[prefix + "gpu.compute.major"], labels[prefix + "gpu.compute.minor"]) == (
            "9",
            "0",
        )
        assert labels[prefix + "mig.capable"] == labels[prefix + "mps.capable"] == "true"
    assert labels["drasil.dev/mig.mode"] == "dynamic"
    selector = {"nvidia.com/gpu.product": PRODUCT}
    name = pod(kube, moved, migrated, limits={"nvidia.com/gpu": 1}, node_selector=selector)
    wait_running(kube, moved, name)
    claim = pod_claim(kube, moved, name)
    annotations = claim["metadata"]["annotations"]
    assert annotations["resource.kubernetes.io/extended-resource-claim"] == "true"
    device = allocated_device(kube, claim)
    assert "mig" not in _record(migrated, claim), device  # a whole GPU, nothing cut
    uuid = device_uuid(kube, migrated, device)
    assert uuid.startswith("GPU-")
    assert visible_uuids(container_env(kube, moved, name)) == [uuid]


def test_a_pod_asking_for_a_mig_profile_gets_an_instance_of_it(
    kube: Kube, moved: str, migrated: Node
) -> None:
    name = pod(kube, moved, migrated, limits={"nvidia.com/mig-1g.10gb": 1})
    wait_running(kube, moved, name)
    claim = pod_claim(kube, moved, name)
    annotations = claim["metadata"]["annotations"]
    assert annotations["resource.kubernetes.io/extended-resource-claim"] == "true"
    mig = _record(migrated, claim)["mig"]
    assert (mig["profile"], mig["state"]) == ("1g.10gb", "Created")
    assert visible_uuids(container_env(kube, moved, name)) == [mig["uuid"]]


def test_another_device_plugin_for_the_same_gpus_makes_dra_withhold_them(
    kube: Kube, moved: str, migrated: Node
) -> None:
    node, published = migrated, GPUS * DEVICES_PER_H100
    node.restart_plugin_with({DEVICE_PLUGIN_RESOURCES: GPU_RESOURCE}, published=published)
    try:
        node.start_device_plugin()
        node_events(
            kube, node.name, CONFLICT_REASON, containing=f"allocatable {GPU_RESOURCE}: {GPUS}"
        )
        wait_for(
            lambda: node.devices_published(0), timeout=60, what="the DRA devices withheld"
        )  # fmt: skip
        name = pod(kube, moved, node, template_name=template(kube, moved))
        refused = f"{name} refused for want of a device"
        wait_for(lambda: _refused(kube, moved, name), timeout=60, what=refused)

        node.stop_device_plugin()  # the Node reports 0 allocatable now
        node_events(kube, node.name, CLEARED_REASON, containing=f"its {published} device(s)")
        wait_running(kube, moved, name)
    finally:
        if node.device_plugin.running():
            node.stop_device_plugin()
        node.plugin.env.pop(DEVICE_PLUGIN_RESOURCES, None)  # the module's teardown restarts it


def _refused(kube: Kube, namespace: str, name: str) -> Any:
    """The Pod's Events once one says it got no device: not scheduled, or its prepare
    refused because the device is withheld."""
    seen = events(kube, namespace, name)
    found = [
        e
        for e in seen
        if e.startswith("FailedScheduling") or ("FailedPrepare" in e and "is withheld" in e)
    ]
    return found or NotYet(seen)

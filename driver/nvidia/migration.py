"""``drasil migrate check``: what of a cluster built on NVIDIA's device plugin moves to
drasil, per workload, and which node pools to move first.

Read-only and pure: the caller lists Pods, Deployments, StatefulSets, Jobs, Nodes,
DeviceClasses and ConfigMaps (the device plugin's config) and hands them here; nothing
is written. Each workload that uses GPUs gets one verdict:

- ``runs unchanged``: what it asks for (``nvidia.com/gpu``, ``nvidia.com/mig-<p>``) has
  a DeviceClass standing for it, and the node labels it selects on are labels drasil
  writes;
- ``needs a change``: the change is named (a chart value, or the Pod's own spec);
- ``cannot move yet``: what drasil does not serve, and why.

The plan (what drasil will offer) is the chart values the operator means to install
(``-f values.yaml``; the chart's defaults otherwise) together with the DeviceClasses
already in the cluster.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from drasil.api.documents import ConfigError, load_documents
from drasil.driver.nvidia.nodelabels import GFD_NAMES, GFD_PREFIX
from drasil.driver.objects import mapping, status_of, text
from drasil.driver.objects import meta as meta_of

UNCHANGED = "runs unchanged"
CHANGE = "needs a change"
BLOCKED = "cannot move yet"
ORDER = {UNCHANGED: 0, CHANGE: 1, BLOCKED: 2}
NVIDIA = "nvidia.com/"
GPU = "nvidia.com/gpu"
SHARED = "nvidia.com/gpu.shared"
MIG = "nvidia.com/mig-"
# A ConfigMap value larger than this is not the device plugin's config.
MAX_CONFIG_BYTES = 64 * 1024
KINDS = ("Deployment", "StatefulSet", "Job")

JsonDict = dict[str, Any]


@dataclass(frozen=True)
class Plan:
    """What drasil will offer: extended resources with a DeviceClass, GFD's label
    names or not, and what the device plugin's config shares (resource -> replicas)."""

    extended: Mapping[str, str]
    gfd_labels: bool
    shared: Mapping[str, int] = field(default_factory=dict)


def plan_from(
    values: Mapping[str, Any], classes: Sequence[JsonDict], configmaps: Sequence[JsonDict]
) -> Plan:
    """The plan from the chart values (missing keys: the chart's defaults), the cluster's
    DeviceClasses and the device plugin's sharing config found in ConfigMaps."""
    dc = values.get("deviceClasses") or {}
    extended = {
        str(c["spec"]["extendedResourceName"]): str(c["metadata"]["name"])
        for c in classes
        if (c.get("spec") or {}).get("extendedResourceName")
    }
    if dc.get("create", True):
        gpu_resource = dc.get("extendedResourceName", "drasil.dev/gpu")
        if gpu_resource:
            extended[str(gpu_resource)] = "gpu.drasil.dev"
        prefix = dc.get("migExtendedResourcePrefix") or ""
        profiles = (dc.get("migProfiles") or []) if prefix else []
        for profile in profiles:
            name = str(profile).replace("+", ".")
            extended[f"{prefix}{name}"] = f"mig-{name}.drasil.dev"
    names = (values.get("nodeLabels") or {}).get("names", "drasil")
    return Plan(extended=extended, gfd_labels=names == "gfd", shared=sharing_config(configmaps))


def sharing_config(configmaps: Sequence[JsonDict]) -> dict[str, int]:
    """Resource -> replicas of the device plugin's time-slicing and MPS sharing, from
    every ConfigMap value that reads as its config (``sharing.timeSlicing`` or
    ``sharing.mps``, ``resources: [{name, replicas}]``)."""
    found: dict[str, int] = {}
    for cm in configmaps:
        for value in (cm.get("data") or {}).values():
            for config in _configs(value):
                found.update(_replicas(config))
    return found


def _configs(text: object) -> list[Any]:
    if not isinstance(text, str) or len(text) > MAX_CONFIG_BYTES or "sharing" not in text:
        return []
    try:
        return load_documents(text)
    except ConfigError:
        return []


def _replicas(config: Any) -> dict[str, int]:
    sharing = config.get("sharing") if isinstance(config, dict) else None
    found: dict[str, int] = {}
    for strategy in ("timeSlicing", "mps"):
        block = sharing.get(strategy) if isinstance(sharing, dict) else None
        resources = block.get("resources") if isinstance(block, dict) else None
        for resource in resources if isinstance(resources, list) else []:
            if isinstance(resource, dict) and isinstance(resource.get("replicas"), int):
                found[str(resource.get("name", GPU))] = resource["replicas"]
    return found


@dataclass(frozen=True)
class Verdict:
    kind: str
    namespace: str
    name: str
    verdict: str
    reasons: tuple[str, ...]

    @property
    def ref(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"


def workloads(
    pods: Sequence[JsonDict], controllers: Mapping[str, Sequence[JsonDict]]
) -> Iterator[tuple[str, JsonDict, JsonDict]]:
    """(kind, metadata, Pod spec) of the Pods no controller owns and of each
    Deployment, StatefulSet and Job (`controllers`: kind -> objects)."""
    for pod in pods:
        meta = pod.get("metadata") or {}
        if not any(o.get("controller") for o in meta.get("ownerReferences") or []):
            yield "Pod", meta, pod.get("spec") or {}
    for kind in KINDS:
        for obj in controllers.get(kind, ()):
            template = (obj.get("spec") or {}).get("template") or {}
            yield kind, obj.get("metadata") or {}, template.get("spec") or {}


def check(
    kind: str, meta: Mapping[str, Any], spec: Mapping[str, Any], plan: Plan
) -> Verdict | None:
    """The workload's verdict; None when it uses no NVIDIA GPU at all."""
    change: list[str] = []
    blocked: list[str] = []
    notes: list[str] = []
    uses_gpu = False
    for container in _containers(spec):
        for resource in _gpu_resources(container):
            uses_gpu = True
            _resource(resource, plan, change=change, blocked=blocked, notes=notes)
        if _sets_visible_devices(container):
            uses_gpu = True
            blocked.append(
                f"container {container.get('name')} picks GPUs by NVIDIA_VISIBLE_DEVICES, "
                "outside Kubernetes' accounting; drasil's containers get theirs through "
                "claims (the variable is void there)"
            )
    for key in sorted(_selected_label_keys(spec)):
        uses_gpu = True
        _label(key, plan, change=change)
    if not uses_gpu:
        return None
    verdict = BLOCKED if blocked else CHANGE if change else UNCHANGED
    reasons = tuple(dict.fromkeys(blocked + change + notes))
    return Verdict(
        kind, str(meta.get("namespace", "")), str(meta.get("name", "")), verdict, reasons
    )


def _containers(spec: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for key in ("initContainers", "containers"):
        for container in spec.get(key) or []:
            if isinstance(container, dict):
                yield container


def _gpu_resources(container: Mapping[str, Any]) -> list[str]:
    resources = container.get("resources") or {}
    names: set[str] = set()
    for key in ("limits", "requests"):
        names.update(k for k in (resources.get(key) or {}) if str(k).startswith(NVIDIA))
    return sorted(names)


def _resource(
    resource: str, plan: Plan, *, change: list[str], blocked: list[str], notes: list[str]
) -> None:
    if resource in plan.extended:
        replicas = plan.shared.get(resource, 1)
        if replicas > 1:
            notes.append(
                f"{resource} was 1/{replicas} of a GPU under the device plugin's sharing; "
                f"through {plan.extended[resource]} it is a whole GPU (ask a share of "
                "shared.drasil.dev instead to keep packing)"
            )
        return
    if resource == GPU:
        change.append(
            "asks for nvidia.com/gpu: set the chart value deviceClasses.extendedResourceName "
            "to nvidia.com/gpu"
        )
    elif resource.startswith(MIG):
        profile = resource.removeprefix(MIG)
        change.append(
            f"asks for {resource}: add {profile} to deviceClasses.migProfiles with "
            "deviceClasses.migExtendedResourcePrefix nvidia.com/mig-"
        )
    elif resource == SHARED:
        change.append(
            "asks for nvidia.com/gpu.shared (a time-sliced or MPS-shared GPU): ask a share of "
            "shared.drasil.dev (memory, computePercent) with a ResourceClaimTemplate"
        )
    else:
        blocked.append(f"asks for {resource}, which drasil does not serve")


def _sets_visible_devices(container: Mapping[str, Any]) -> bool:
    return any(
        isinstance(e, dict) and e.get("name") == "NVIDIA_VISIBLE_DEVICES"
        for e in container.get("env") or []
    )


def _selected_label_keys(spec: Mapping[str, Any]) -> set[str]:
    """nvidia.com/ label keys the Pod selects nodes on: its nodeSelector and the
    required node affinity's match expressions."""
    keys = {k for k in (spec.get("nodeSelector") or {}) if str(k).startswith(NVIDIA)}
    affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    for term in affinity.get("nodeSelectorTerms") or []:
        for expression in (term or {}).get("matchExpressions") or []:
            key = str((expression or {}).get("key", ""))
            if key.startswith(NVIDIA):
                keys.add(key)
    return keys


def _label(key: str, plan: Plan, *, change: list[str]) -> None:
    name = key.removeprefix(GFD_PREFIX)
    drasil_writes = name in GFD_NAMES or (name.startswith("mig-") and name.endswith(".count"))
    if drasil_writes and plan.gfd_labels:
        return
    if drasil_writes:
        change.append(f"selects nodes on {key}: set the chart value nodeLabels.names to gfd")
    else:
        change.append(
            f"selects nodes on {key}, a label drasil does not write: keep GPU Feature "
            "Discovery for it, or select on the devices' attributes in a claim"
        )


def check_all(
    pods: Sequence[JsonDict], controllers: Mapping[str, Sequence[JsonDict]], plan: Plan
) -> list[Verdict]:
    """The verdicts of every workload that uses GPUs, blocked first, then by name."""
    found = [
        v
        for kind, meta, spec in workloads(pods, controllers)
        if (v := check(kind, meta, spec, plan)) is not None
    ]
    return sorted(found, key=lambda v: (-ORDER[v.verdict], v.kind, v.namespace, v.name))


@dataclass(frozen=True)
class Pool:
    name: str
    nodes: int
    pods: Mapping[str, int]  # verdict -> running GPU Pods on it

    @property
    def moves_cleanly(self) -> bool:
        return not (self.pods.get(CHANGE) or self.pods.get(BLOCKED))


def pools(
    nodes: Sequence[JsonDict], pods: Sequence[JsonDict], plan: Plan, *, pool_label: str
) -> list[Pool]:
    """The GPU nodes (those with allocatable nvidia.com/ resources) by `pool_label`
    (a node without it is a pool of its own), with the verdicts of the GPU Pods that
    run there; the pools that move cleanly first, then by fewest Pods that do not."""
    members: dict[str, list[str]] = defaultdict(list)
    for node in nodes:
        allocatable = mapping(status_of(node).get("allocatable"))
        if not any(str(k).startswith(NVIDIA) and str(v) != "0" for k, v in allocatable.items()):
            continue
        node_meta = meta_of(node)
        members[text(node_meta.labels.get(pool_label)) or node_meta.name].append(node_meta.name)
    where = {n: pool for pool, names in members.items() for n in names}
    counts: dict[str, Counter[str]] = {pool: Counter() for pool in members}
    for pod in pods:
        pool = where.get((pod.get("spec") or {}).get("nodeName") or "")
        verdict = check("Pod", pod.get("metadata") or {}, pod.get("spec") or {}, plan)
        if pool is not None and verdict is not None:
            counts[pool][verdict.verdict] += 1
    found = [Pool(name, len(members[name]), dict(counts[name])) for name in members]
    return sorted(found, key=lambda p: (not p.moves_cleanly, _stuck(p), p.name))


def _stuck(pool: Pool) -> int:
    return pool.pods.get(CHANGE, 0) + pool.pods.get(BLOCKED, 0)


def report(verdicts: Iterable[Verdict], found_pools: Iterable[Pool]) -> str:
    """The text `drasil migrate check` prints."""
    lines = ["WORKLOAD\tVERDICT\tWHY"]
    for v in verdicts:
        lines.append(f"{v.ref}\t{v.verdict}\t{'; '.join(v.reasons) or '-'}")
    lines += ["", "NODE POOL\tNODES\tGPU PODS UNCHANGED/CHANGE/BLOCKED\tMOVE"]
    for p in found_pools:
        counts = "/".join(str(p.pods.get(k, 0)) for k in (UNCHANGED, CHANGE, BLOCKED))
        move = "first" if p.moves_cleanly else "after its workloads change"
        lines.append(f"{p.name}\t{p.nodes}\t{counts}\t{move}")
    return "\n".join(lines) + "\n"

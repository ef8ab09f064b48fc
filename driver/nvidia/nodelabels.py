"""Node labels from the node's discovered GPUs, for node selectors and affinities.

Workloads written for NVIDIA's device plugin select nodes on GPU Feature Discovery's
labels (``nvidia.com/gpu.product``); DaemonSets select on a "present" label. drasil
labels a node from the same discovery that fills its ResourceSlices, under its own
prefix ``drasil.dev/``, and, asked to (``gfd``), under GFD's names too, with GFD's
value formats, so that such selectors keep working on a node without GFD.

Only NVIDIA GPUs are described (GFD's labels are NVIDIA's); values are made valid
label values (GFD's way: spaces become ``-``). The first GPU by index speaks for the
node where GPUs differ, as GFD's labels do.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence

from drasil.driver.devices import Device, DeviceType, Vendor, Version

PREFIX = "drasil.dev/"
GFD_PREFIX = "nvidia.com/"
# The names GFD publishes that drasil's labels mirror (under GFD_PREFIX with gfd), and
# GFD's per-profile MIG counts (``mig-<profile>.count``).
GFD_NAMES = frozenset(
    {
        "gpu.present",
        "gpu.count",
        "gpu.product",
        "gpu.memory",
        "gpu.family",
        "gpu.compute.major",
        "gpu.compute.minor",
        "cuda.driver.major",
        "cuda.driver.minor",
        "cuda.driver.rev",
        "cuda.runtime.major",
        "cuda.runtime.minor",
        "mig.capable",
        "mps.capable",
        "gpu.sharing-strategy",
    }
)
# drasil's names GFD has none of.
OWN_NAMES = frozenset({"mig.mode"})
# The label keys this module makes (either prefix; exactly these names, and per-profile
# MIG counts): only these are ever changed or removed on a Node, so that the operator's
# own labels (drasil.dev/mig-mode, the GPU Operator's nvidia.com/gpu.deploy.*) stay.
# The chart's admission policy lets the plugin change no other key (the same pattern).
OWN_KEY = re.compile(
    r"^(drasil\.dev|nvidia\.com)/("
    + "|".join(n.replace(".", r"\.") for n in sorted(GFD_NAMES | OWN_NAMES))
    + r"|mig-[A-Za-z0-9.]+\.count)$"
)
MAX_VALUE = 63
_INVALID = re.compile(r"[^A-Za-z0-9_.-]+")
_EDGE = re.compile(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$")
MiB = 1024 * 1024
# MPS limits are enforced from Volta (compute capability 7.0) on.
MPS_MIN_COMPUTE_MAJOR = 7


def label_value(text: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``NVIDIA-H100-80GB-HBM3``: a valid label value of at
    most 63 characters (empty where nothing valid is left)."""
    value = _EDGE.sub("", _INVALID.sub("-", text.strip()))
    return _EDGE.sub("", value[:MAX_VALUE])


def node_labels(
    devices: Sequence[Device], *, mig_mode: str, gpu_sharing: str, gfd: bool = False
) -> dict[str, str]:
    """The labels of a node with these published devices (every name under PREFIX;
    with `gfd` the ones GFD has under GFD_PREFIX too). No NVIDIA GPU: no labels."""
    nvidia = [d for d in devices if d.vendor == Vendor.NVIDIA]
    if not nvidia:
        return {}
    names = _gpu_names(nvidia, mig_mode=mig_mode, gpu_sharing=gpu_sharing)
    labels = {PREFIX + name: value for name, value in names.items()}
    if gfd:
        labels.update({GFD_PREFIX + name: value for name, value in names.items() if _gfd_has(name)})
    return {k: v for k, v in labels.items() if v}


def _gfd_has(name: str) -> bool:
    return name in GFD_NAMES or (name.startswith("mig-") and name.endswith(".count"))


def _gpu_names(devices: Sequence[Device], *, mig_mode: str, gpu_sharing: str) -> dict[str, str]:
    first = min(devices, key=lambda d: (_index(d), d.name))
    attributes = first.attributes
    gpus = {d.parent_uuid or d.uuid for d in devices}
    names = {
        "gpu.present": "true",
        "gpu.count": str(len(gpus)),
        "gpu.product": label_value(str(attributes.get("productName", ""))),
        "gpu.family": label_value(str(attributes.get("architecture", "")).lower()),
        "mig.mode": mig_mode,
        "gpu.sharing-strategy": "mps" if gpu_sharing == "consumable" else "none",
    }
    names.update(_versions(attributes))
    memory = _whole_gpu_memory(devices, first)
    if memory:
        names["gpu.memory"] = str(memory // MiB)
    if any(d.type == DeviceType.MIG or d.mig_placement is not None for d in devices):
        names["mig.capable"] = "true"
    if mig_mode != "dynamic":  # dynamic: instances are cut on demand, none to count
        names.update(_mig_counts(devices))
    return names


def _versions(attributes: Mapping[str, object]) -> dict[str, str]:
    names: dict[str, str] = {}
    compute = _parts(attributes.get("cudaComputeCapability"))
    if len(compute) >= 2:
        names["gpu.compute.major"], names["gpu.compute.minor"] = compute[0], compute[1]
        names["mps.capable"] = str(int(compute[0]) >= MPS_MIN_COMPUTE_MAJOR).lower()
    driver = _parts(attributes.get("driverVersion"))
    for key, part in zip(("major", "minor", "rev"), driver, strict=False):
        names[f"cuda.driver.{key}"] = part
    runtime = _parts(attributes.get("cudaDriverVersion"))
    for key, part in zip(("major", "minor"), runtime, strict=False):
        names[f"cuda.runtime.{key}"] = part
    return names


def _parts(value: object) -> list[str]:
    """``580.159.04`` or Version("12.4.0") -> its numeric parts, as written."""
    text = value.value if isinstance(value, Version) else str(value or "")
    return [p for p in text.split(".") if p.isdigit()]


def _index(device: Device) -> int:
    value = device.attributes.get("index", 0)
    return value if isinstance(value, int) else 0


def _whole_gpu_memory(devices: Sequence[Device], first: Device) -> int:
    """The memory of the first GPU published whole (none: every GPU is in MIG mode)."""
    whole = [d for d in devices if d.type == DeviceType.GPU and d.uuid == first.uuid]
    whole = whole or [d for d in devices if d.type == DeviceType.GPU]
    return int(whole[0].capacity.get("memory", 0)) if whole else 0


def _mig_counts(devices: Sequence[Device]) -> dict[str, str]:
    counts = Counter(
        str(d.attributes.get("profile", "")) for d in devices if d.type == DeviceType.MIG
    )
    return {
        f"mig-{label_value(profile.replace('+', '.'))}.count": str(n)
        for profile, n in sorted(counts.items())
        if profile
    }

"""The simulated GPUs: profile specs and the ``FakeGpu`` records made of them.

Profile specs are ``name:count`` entries of ``drasil.driver.simulated.gpucatalog``'s
profiles, comma separated: ``h100-80gb:8``, ``a100-40gb-mig:2``, ``h100-80gb:4,l4:2``
(a bare name means one GPU). GPUs are numbered across entries in order.

Everything is a pure function of the spec and the node name: UUIDs (``GPU-…``,
``MIG-…``) are name-based UUIDs of node, index and instance ids; PCI bus ids follow a
DGX-like layout (two GPUs per root complex, eight per PCI domain); the first half of
the GPUs sits on NUMA node 0, the rest on node 1. Simulated GPUs have no device nodes.

``DRIVER_VERSION`` and ``CUDA_DRIVER_VERSION`` are what the simulated NVML (and the
mock NVML of ``e2e/harness/mocknvml``) reports for the host's driver.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from drasil.driver.simulated.gpucatalog import PROFILES, GpuModel, MigLayoutEntry

MAX_SIMULATED_GPUS = 64
DRIVER_VERSION = "580.95.05"
CUDA_DRIVER_VERSION = 13000  # CUDA 13.0, as nvmlSystemGetCudaDriverVersion encodes it

# A fixed namespace makes the UUIDs stable across releases, not only across runs.
_UUID_NAMESPACE = uuid.UUID("5f1d3a52-8a0e-4c8f-9a57-64726173696c")
# DGX-like bus numbers: pairs of GPUs behind one root complex.
_BUSES = (0x19, 0x1B, 0x3B, 0x3D, 0x99, 0x9B, 0xBB, 0xBD)
_ROOTS = (0x18, 0x18, 0x3A, 0x3A, 0x98, 0x98, 0xBA, 0xBA)


class ProfileSpecError(ValueError):
    """A ``--profile`` spec that names no known profile or a bad count."""


@dataclass(frozen=True)
class FakeMig:
    """One MIG device of a simulated GPU's initial layout."""

    instance: MigLayoutEntry
    uuid: str


@dataclass(frozen=True)
class FakeGpu:
    """One simulated GPU and everything NVML would report about it.

    ``migs`` is the layout it starts with; ``FakeNvml`` keeps the MIG state that
    changes.
    """

    index: int
    model: GpuModel
    uuid: str
    minor: int
    pci_bus_id: str  # NVML's spelling: 00000000:3B:00.0
    pcie_root: str
    numa_node: int
    migs: tuple[FakeMig, ...] = ()
    node_name: str = ""


def _spec_entry(text: str) -> tuple[str, int]:
    name, sep, count_text = text.partition(":")
    name = name.strip()
    if name not in PROFILES:
        available = ", ".join(sorted(PROFILES))
        raise ProfileSpecError(f'unknown profile "{name}"; available: {available}')
    if not sep:
        return name, 1
    try:
        count = int(count_text.strip())
    except ValueError:
        raise ProfileSpecError(
            f'bad count "{count_text}" for profile "{name}": expected a whole number'
        ) from None
    if not 1 <= count <= MAX_SIMULATED_GPUS:
        raise ProfileSpecError(
            f'bad count {count} for profile "{name}": must be 1 to {MAX_SIMULATED_GPUS}'
        )
    return name, count


def parse_profile_spec(spec: str) -> list[tuple[str, int]]:
    """``h100-80gb:4,l4:2`` → ``[("h100-80gb", 4), ("l4", 2)]``, or ProfileSpecError."""
    entries = [part for part in spec.split(",") if part.strip()]
    if not entries:
        available = ", ".join(sorted(PROFILES))
        raise ProfileSpecError(f"empty profile spec; use name:count with one of: {available}")
    parsed = [_spec_entry(part) for part in entries]
    total = sum(count for _, count in parsed)
    if total > MAX_SIMULATED_GPUS:
        raise ProfileSpecError(
            f"profile spec {spec!r} asks for {total} GPUs; at most {MAX_SIMULATED_GPUS}"
        )
    return parsed


def _uuid(prefix: str, *parts: object) -> str:
    return f"{prefix}-{uuid.uuid5(_UUID_NAMESPACE, '/'.join(str(p) for p in parts))}"


def mig_uuid(node_name: str, index: int, gpu_instance_id: int, compute_instance_id: int) -> str:
    """The UUID of a simulated MIG device: the same whenever these ids are recreated."""
    return _uuid("MIG", node_name, index, gpu_instance_id, compute_instance_id)


def _fake_gpu(*, node_name: str, index: int, total: int, model: GpuModel) -> FakeGpu:
    domain, slot = divmod(index, len(_BUSES))
    migs = tuple(
        FakeMig(m, mig_uuid(node_name, index, m.gpu_instance_id, m.compute_instance_id))
        for m in model.mig_layout
    )
    return FakeGpu(
        index=index,
        model=model,
        uuid=_uuid("GPU", node_name, index),
        minor=index,
        pci_bus_id=f"{domain:08X}:{_BUSES[slot]:02X}:00.0",
        pcie_root=f"pci{domain:04x}:{_ROOTS[slot]:02x}",
        numa_node=0 if index < (total + 1) // 2 else 1,
        migs=migs,
        node_name=node_name,
    )


def simulated_gpus(profile_spec: str, *, node_name: str) -> list[FakeGpu]:
    """The GPUs of a profile spec on one node (see the module docstring)."""
    models = [
        PROFILES[name] for name, count in parse_profile_spec(profile_spec) for _ in range(count)
    ]
    return [
        _fake_gpu(node_name=node_name, index=i, total=len(models), model=model)
        for i, model in enumerate(models)
    ]

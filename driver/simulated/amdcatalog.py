"""The AMD Instinct models the simulated backend can fake, with their real figures.

Each model is what one PCI device (one amdgpu GPU) reports; an MI250X card is two such
devices (two GCDs), so its figures are per GCD and ``gpus_per_card`` is 2.

Sources (checked when this was written):

- device ids: the amdgpu PCI id table (``drivers/gpu/drm/amd/amdgpu/amdgpu_drv.c``):
  0x740c MI250/MI250X, 0x740f MI210, 0x74a1 MI300X, 0x74a5 MI325X (0x74a0 is MI300A).
- gfx targets: LLVM AMDGPU processors table (gfx90a: MI210/MI250/MI250X, gfx942:
  MI300A/MI300X/MI325X); KFD writes them as ``gfx_target_version`` 90010 and 90402.
- CUs, memory, XCDs: AMD Instinct data sheets and the CDNA3 white paper: MI300X 304 CUs
  in 8 XCDs of 38, 192 GB HBM3; MI325X 304 CUs, 256 GB HBM3E; MI250X 220 CUs and
  128 GB HBM2e per card (110 CUs and 64 GB per GCD); MI210 104 CUs, 64 GB HBM2e.
  Every CDNA CU has 4 SIMDs (KFD ``simd_per_cu`` 4).
- partition modes: amdgpu's ``aqua_vanjaram.c`` (8 XCCs: SPX, DPX, QPX, CPX with 1, 2,
  4, 8 partitions) and AMD's MI300X partitioning guide (NPS1 and NPS4). MI200-series
  GPUs have no compute partitions (the amdgpu driver creates the partition files only
  for GC 9.4.3+, so MI210/MI250X have no ``current_compute_partition`` at all).
- a partition's memory: amdgpu gives each XCP its memory partition's size divided by
  the XCPs sharing it (``amdgpu_amdkfd_xcp_memory_size``): CPX+NPS4 on MI300X is
  192 GiB / 4 / 2 = 24 GiB, CPX+NPS1 192 GiB / 8, the same 24 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

GIB: Final = 1 << 30


@dataclass(frozen=True)
class ComputeMode:
    """A compute partition mode: its name, how many partitions it makes, and the
    memory partition modes it may be combined with."""

    name: str
    partitions: int
    memory_modes: tuple[str, ...]


@dataclass(frozen=True)
class AmdModel:
    """One simulated GPU model; figures are per PCI device (per GCD on MI250X)."""

    name: str
    product_name: str
    device_id: int
    gfx_target_version: int
    memory_bytes: int
    compute_units: int
    xcds: int
    simd_per_cu: int = 4
    gpus_per_card: int = 1
    # Empty: the GPU has no compute partitions (no partition files in sysfs).
    compute_modes: tuple[ComputeMode, ...] = ()
    memory_modes: tuple[str, ...] = ()
    initial_compute: str | None = None
    initial_memory: str | None = None

    @property
    def partitionable(self) -> bool:
        return bool(self.compute_modes)

    def mode(self, name: str) -> ComputeMode:
        """The compute mode called ``name``; ValueError names the allowed ones."""
        for mode in self.compute_modes:
            if mode.name == name:
                return mode
        allowed = ", ".join(m.name for m in self.compute_modes) or "none"
        raise ValueError(f"{self.name} has no compute mode {name!r} (allowed: {allowed})")


# aqua_vanjaram.c's table: SPX NPS1; DPX NPS1/NPS2; QPX NPS1/NPS4; CPX NPS1/NPS4. MI300X
# and MI325X offer NPS1 and NPS4 only, so DPX is NPS1 here.
_MI300_MODES: Final = (
    ComputeMode("SPX", 1, ("NPS1",)),
    ComputeMode("DPX", 2, ("NPS1",)),
    ComputeMode("QPX", 4, ("NPS1", "NPS4")),
    ComputeMode("CPX", 8, ("NPS1", "NPS4")),
)

MI300X: Final = AmdModel(
    name="mi300x",
    product_name="AMD Instinct MI300X",
    device_id=0x74A1,
    gfx_target_version=90402,
    memory_bytes=192 * GIB,
    compute_units=304,
    xcds=8,
    compute_modes=_MI300_MODES,
    memory_modes=("NPS1", "NPS4"),
    initial_compute="SPX",
    initial_memory="NPS1",
)

MODELS: Final[dict[str, AmdModel]] = {
    m.name: m
    for m in (
        MI300X,
        replace(MI300X, name="mi300x-cpx", initial_compute="CPX", initial_memory="NPS4"),
        replace(
            MI300X,
            name="mi325x",
            product_name="AMD Instinct MI325X",
            device_id=0x74A5,
            memory_bytes=256 * GIB,
        ),
        AmdModel(
            name="mi250x",
            product_name="AMD Instinct MI250X",
            device_id=0x740C,
            gfx_target_version=90010,
            memory_bytes=64 * GIB,
            compute_units=110,
            xcds=1,
            gpus_per_card=2,
        ),
        AmdModel(
            name="mi210",
            product_name="AMD Instinct MI210",
            device_id=0x740F,
            gfx_target_version=90010,
            memory_bytes=64 * GIB,
            compute_units=104,
            xcds=1,
        ),
    )
}

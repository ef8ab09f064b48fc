"""GPU models the simulated backend can pretend to be, with the numbers NVML reports.

Figures are what real hardware reports, so selectors written against a simulated node
behave the same on a real one (an L4 reports 23034 MiB), with one exception: the
simulated H100 80GB reports a round 80 GiB (the project's documented demo figure),
where a real H100 80GB HBM3 reports 81559 MiB; selectors comparing memory against
``80Gi`` therefore match here but not on real H100s. MIG figures are those of
``nvidia-smi mig -lgip`` (memory in MiB as ``nvmlDeviceGetAttributes`` reports it, e.g.
4.75 GiB = 4864 MiB for an A100-40GB 1g.5gb).

``*-mig`` profiles are the same GPU with MIG mode on and a fixed mixed layout of GPU
instances (one compute instance each, id 0); the GPU instance ids are those NVML
assigns for these placements.
"""

from __future__ import annotations

from dataclasses import dataclass

from drasil.driver.discovery.nvml import ARCH_ADA, ARCH_AMPERE, ARCH_HOPPER, BRAND_NVIDIA

MiB = 2**20


@dataclass(frozen=True)
class MigProfile:
    """One GPU instance profile as ``nvidia-smi mig -lgip`` lists it."""

    name: str
    gpu_slices: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    memory_mib: int


@dataclass(frozen=True)
class MigInstance:
    """A configured MIG device: its profile and the GPU instance id NVML gave it."""

    profile: MigProfile
    gpu_instance_id: int
    compute_instance_id: int = 0


@dataclass(frozen=True)
class GpuModel:
    """A simulated GPU: what NVML says about the board, and its MIG layout if any."""

    product_name: str
    architecture: int
    compute_capability: tuple[int, int]
    memory_mib: int
    brand: int = BRAND_NVIDIA
    mig_capable: bool = False
    max_mig_devices: int = 0
    mig_layout: tuple[MigInstance, ...] = ()

    @property
    def mig_enabled(self) -> bool:
        return bool(self.mig_layout)


# A100-SXM4-40GB GPU instance profiles.
A100_40GB_1G_5GB = MigProfile("1g.5gb", 1, 14, 1, 0, 0, 0, 0, 4864)
A100_40GB_2G_10GB = MigProfile("2g.10gb", 2, 28, 2, 1, 0, 0, 0, 9984)
A100_40GB_3G_20GB = MigProfile("3g.20gb", 3, 42, 3, 2, 0, 0, 0, 20096)

# A100-SXM4-80GB.
A100_80GB_1G_10GB = MigProfile("1g.10gb", 1, 14, 1, 0, 0, 0, 0, 9728)
A100_80GB_2G_20GB = MigProfile("2g.20gb", 2, 28, 2, 1, 0, 0, 0, 19968)
A100_80GB_3G_40GB = MigProfile("3g.40gb", 3, 42, 3, 2, 0, 0, 0, 40192)

# H100 80GB HBM3.
H100_80GB_1G_10GB = MigProfile("1g.10gb", 1, 16, 1, 1, 0, 1, 0, 9984)
H100_80GB_2G_20GB = MigProfile("2g.20gb", 2, 32, 2, 2, 0, 2, 0, 20096)
H100_80GB_3G_40GB = MigProfile("3g.40gb", 3, 60, 3, 3, 0, 3, 0, 40448)


def _mixed_layout(
    big: MigProfile, medium: MigProfile, small: MigProfile
) -> tuple[MigInstance, ...]:
    # 3g at placement 4, 2g at 0, two 1g at 2 and 3: all seven compute slices used.
    return (
        MigInstance(big, gpu_instance_id=2),
        MigInstance(medium, gpu_instance_id=3),
        MigInstance(small, gpu_instance_id=9),
        MigInstance(small, gpu_instance_id=10),
    )


A100_40GB = GpuModel(
    product_name="NVIDIA A100-SXM4-40GB",
    architecture=ARCH_AMPERE,
    compute_capability=(8, 0),
    memory_mib=40960,
    mig_capable=True,
    max_mig_devices=7,
)
A100_80GB = GpuModel(
    product_name="NVIDIA A100-SXM4-80GB",
    architecture=ARCH_AMPERE,
    compute_capability=(8, 0),
    memory_mib=81920,
    mig_capable=True,
    max_mig_devices=7,
)
H100_80GB = GpuModel(
    product_name="NVIDIA H100 80GB HBM3",
    architecture=ARCH_HOPPER,
    compute_capability=(9, 0),
    memory_mib=81920,  # real boards: 81559 (see the module docstring)
    mig_capable=True,
    max_mig_devices=7,
)
L4 = GpuModel(
    product_name="NVIDIA L4",
    architecture=ARCH_ADA,
    compute_capability=(8, 9),
    memory_mib=23034,
)


def _with_mig(model: GpuModel, layout: tuple[MigInstance, ...]) -> GpuModel:
    return GpuModel(
        product_name=model.product_name,
        architecture=model.architecture,
        compute_capability=model.compute_capability,
        memory_mib=model.memory_mib,
        brand=model.brand,
        mig_capable=model.mig_capable,
        max_mig_devices=model.max_mig_devices,
        mig_layout=layout,
    )


PROFILES: dict[str, GpuModel] = {
    "a100-40gb": A100_40GB,
    "a100-40gb-mig": _with_mig(
        A100_40GB, _mixed_layout(A100_40GB_3G_20GB, A100_40GB_2G_10GB, A100_40GB_1G_5GB)
    ),
    "a100-80gb": A100_80GB,
    "a100-80gb-mig": _with_mig(
        A100_80GB, _mixed_layout(A100_80GB_3G_40GB, A100_80GB_2G_20GB, A100_80GB_1G_10GB)
    ),
    "h100-80gb": H100_80GB,
    "h100-80gb-mig": _with_mig(
        H100_80GB, _mixed_layout(H100_80GB_3G_40GB, H100_80GB_2G_20GB, H100_80GB_1G_10GB)
    ),
    "l4": L4,
}
"""Profile name (as used in ``--profile h100-80gb:8``) → simulated GPU model."""

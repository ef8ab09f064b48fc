"""GPU models the simulated backend can pretend to be, with the numbers NVML reports.

Figures are what real hardware reports, so selectors written against a simulated node
behave the same on a real one (an L4 reports 23034 MiB), with one exception: the
simulated H100 80GB reports a round 80 GiB (the project's documented demo figure),
where a real H100 80GB HBM3 reports 81559 MiB; selectors comparing memory against
``80Gi`` therefore match here but not on real H100s. MIG figures are those of
``nvidia-smi mig -lgip`` (memory in MiB as ``nvmlDeviceGetGpuInstanceProfileInfoV``
reports it, e.g. 4.75 GiB = 4864 MiB for an A100-40GB 1g.5gb).

Every MIG-capable model carries its whole GPU instance profile table: NVML's profile
id (``-lgip``'s ID), how many instances of it fit, its engines, its memory, and where
it may be placed (``nvidia-smi mig -lgipp``: start and size in memory slices). The
simulated NVML decides what can be created from these tables alone.

Sources. Profiles, instance counts and engines per profile: NVIDIA's MIG user guide,
"Supported MIG Profiles" (docs.nvidia.com/datacenter/tesla/mig-user-guide/
supported-mig-profiles.html, the v580 edition). SM counts and memory in MiB:
``nvidia-smi mig -lgip`` transcripts of A100-SXM4-40GB/80GB and H100 80GB HBM3 (the
guide's examples and public logs), and of the H200 for 1g.18gb, 2g.35gb and 7g.141gb.
Placements: the guide's ``nvidia-smi mig -lgipp`` example (A100), which H100 logs
show unchanged; the guide gives H200 and B200 the same memory and SM fractions, so
they share it. Where no transcript was found the figures are estimates, marked
"estimate" below: H200 1g.35gb/3g.71gb/4g.71gb memory and SMs follow the H100's
pattern; B200 SMs and MiB are not published (148 SMs, 18 per compute slice, memory in
eighths of 183359 MiB), and the guide's B200 table, which lists one NVDEC and one JPEG
for every profile including 7g, cannot be right for seven 1g instances at once, so
B200 decoders and JPEG engines follow Hopper's one per compute slice.

``*-mig`` profiles are the same GPU with MIG mode on and a fixed mixed layout of GPU
instances (one compute instance each, id 0) at fixed placements; their GPU instance
ids are those NVML assigns to these placements (``gpu_instance_id_at``).
"""

from __future__ import annotations

from dataclasses import dataclass

from drasil.driver.nvidia.nvml import (
    ARCH_ADA,
    ARCH_AMPERE,
    ARCH_BLACKWELL,
    ARCH_HOPPER,
    BRAND_NVIDIA,
    Placement,
)

MiB = 2**20

MEMORY_SLICES = 8
"""Memory slices of every MIG-capable GPU here (the 7g profile's placement is 0:8)."""


def _starts(size: int, *starts: int) -> tuple[Placement, ...]:
    return tuple(Placement(start, size) for start in starts)


# nvidia-smi mig -lgipp, the same on every GPU of this catalogue (see the docstring).
ONE_SLICE = _starts(1, 0, 1, 2, 3, 4, 5, 6)  # 1g and 1g+me: {0,1,2,3,4,5,6}:1
ONE_SLICE_DOUBLE_MEMORY = _starts(2, 0, 2, 4, 6)  # 1g with two memory slices: {0,2,4,6}:2
TWO_SLICES = _starts(2, 0, 2, 4)  # 2g: {0,2,4}:2
THREE_SLICES = _starts(4, 0, 4)  # 3g: {0,4}:4 (three compute slices, half the memory)
FOUR_SLICES = _starts(4, 0)  # 4g: {0}:4
SEVEN_SLICES = _starts(8, 0)  # 7g: {0}:8

# NVML's GPU instance profile ids (nvmlGpuInstanceProfileInfo_t.id, -lgip's ID).
PROFILE_ID_1G = 19
PROFILE_ID_1G_ME = 20
PROFILE_ID_1G_DOUBLE_MEMORY = 15
PROFILE_ID_2G = 14
PROFILE_ID_3G = 9
PROFILE_ID_4G = 5
PROFILE_ID_7G = 0


@dataclass(frozen=True)
class MigProfile:
    """One GPU instance profile as ``nvidia-smi mig -lgip`` and ``-lgipp`` list it.

    ``gpu_slices`` counts compute slices (the ``1g`` of ``1g.10gb``); placements are
    in memory slices, so a 1g.10gb on an A100-40GB has one compute slice and
    placements of size 2.
    """

    name: str
    gpu_slices: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    memory_mib: int
    profile_id: int = PROFILE_ID_1G
    instance_count: int = 1
    placements: tuple[Placement, ...] = ()


def gpu_instance_id_at(placement: Placement, *, memory_slices: int = MEMORY_SLICES) -> int:
    """The GPU instance id NVML gives an instance at ``placement``.

    NVML numbers the nodes of a binary tree over the memory slices: 0 is the whole
    GPU, 1-2 the halves, 3-6 the quarters, 7-14 the eighths; an instance gets the id
    of the node its placement covers. The MIG user guide's ``-cgi``/``-lgi`` examples
    show it (A100-40GB: 1g at 0:1 is GI 7, at 6:1 GI 13; 2g at 2:2 GI 4; 3g at 4:4
    GI 2), and no two live instances can share a node because they would overlap.
    """
    return memory_slices // placement.size - 1 + placement.start // placement.size


@dataclass(frozen=True)
class MigLayoutEntry:
    """One MIG device of a simulated model's initial layout (``GpuModel.mig_layout``):
    its profile, where it sits, and its compute instance."""

    profile: MigProfile
    start: int
    compute_instance_id: int = 0

    @property
    def placement(self) -> Placement:
        size = self.profile.placements[0].size if self.profile.placements else 1
        return Placement(self.start, size)

    @property
    def gpu_instance_id(self) -> int:
        return gpu_instance_id_at(self.placement)


@dataclass(frozen=True)
class GpuModel:
    """A simulated GPU: what NVML says about the board, its MIG table and layout if any."""

    product_name: str
    architecture: int
    compute_capability: tuple[int, int]
    memory_mib: int
    brand: int = BRAND_NVIDIA
    mig_capable: bool = False
    max_mig_devices: int = 0
    mig_layout: tuple[MigLayoutEntry, ...] = ()
    mig_profiles: tuple[MigProfile, ...] = ()

    @property
    def mig_enabled(self) -> bool:
        return bool(self.mig_layout)

    @property
    def full_profile(self) -> MigProfile | None:
        """The profile spanning the whole GPU (7g): its engine counts are the GPU's."""
        return max(self.mig_profiles, key=lambda p: p.gpu_slices, default=None)

    def mig_profile(self, profile_id: int) -> MigProfile | None:
        return next((p for p in self.mig_profiles if p.profile_id == profile_id), None)


# A100-SXM4-40GB. Columns: name, compute slices, SMs, CE, DEC, ENC, JPEG, OFA, MiB.
A100_40GB_1G_5GB = MigProfile("1g.5gb", 1, 14, 1, 0, 0, 0, 0, 4864, PROFILE_ID_1G, 7, ONE_SLICE)
A100_40GB_1G_5GB_ME = MigProfile(
    "1g.5gb+me", 1, 14, 1, 1, 0, 1, 1, 4864, PROFILE_ID_1G_ME, 1, ONE_SLICE
)
A100_40GB_1G_10GB = MigProfile(
    "1g.10gb", 1, 14, 1, 1, 0, 0, 0, 9984, PROFILE_ID_1G_DOUBLE_MEMORY, 4, ONE_SLICE_DOUBLE_MEMORY
)
A100_40GB_2G_10GB = MigProfile("2g.10gb", 2, 28, 2, 1, 0, 0, 0, 9984, PROFILE_ID_2G, 3, TWO_SLICES)
A100_40GB_3G_20GB = MigProfile(
    "3g.20gb", 3, 42, 3, 2, 0, 0, 0, 20096, PROFILE_ID_3G, 2, THREE_SLICES
)
A100_40GB_4G_20GB = MigProfile(
    "4g.20gb", 4, 56, 4, 2, 0, 0, 0, 20096, PROFILE_ID_4G, 1, FOUR_SLICES
)
A100_40GB_7G_40GB = MigProfile(
    "7g.40gb", 7, 98, 7, 5, 0, 1, 1, 40192, PROFILE_ID_7G, 1, SEVEN_SLICES
)

# A100-SXM4-80GB.
A100_80GB_1G_10GB = MigProfile("1g.10gb", 1, 14, 1, 0, 0, 0, 0, 9728, PROFILE_ID_1G, 7, ONE_SLICE)
A100_80GB_1G_10GB_ME = MigProfile(
    "1g.10gb+me", 1, 14, 1, 1, 0, 1, 1, 9728, PROFILE_ID_1G_ME, 1, ONE_SLICE
)
A100_80GB_1G_20GB = MigProfile(
    "1g.20gb", 1, 14, 1, 1, 0, 0, 0, 19968, PROFILE_ID_1G_DOUBLE_MEMORY, 4, ONE_SLICE_DOUBLE_MEMORY
)
A100_80GB_2G_20GB = MigProfile("2g.20gb", 2, 28, 2, 1, 0, 0, 0, 19968, PROFILE_ID_2G, 3, TWO_SLICES)
A100_80GB_3G_40GB = MigProfile(
    "3g.40gb", 3, 42, 3, 2, 0, 0, 0, 40192, PROFILE_ID_3G, 2, THREE_SLICES
)
A100_80GB_4G_40GB = MigProfile(
    "4g.40gb", 4, 56, 4, 2, 0, 0, 0, 40192, PROFILE_ID_4G, 1, FOUR_SLICES
)
A100_80GB_7G_80GB = MigProfile(
    "7g.80gb", 7, 98, 7, 5, 0, 1, 1, 80896, PROFILE_ID_7G, 1, SEVEN_SLICES
)

# H100 80GB HBM3.
H100_80GB_1G_10GB = MigProfile("1g.10gb", 1, 16, 1, 1, 0, 1, 0, 9984, PROFILE_ID_1G, 7, ONE_SLICE)
H100_80GB_1G_10GB_ME = MigProfile(
    "1g.10gb+me", 1, 16, 1, 1, 0, 1, 1, 9984, PROFILE_ID_1G_ME, 1, ONE_SLICE
)
H100_80GB_1G_20GB = MigProfile(
    "1g.20gb", 1, 26, 1, 1, 0, 1, 0, 20096, PROFILE_ID_1G_DOUBLE_MEMORY, 4, ONE_SLICE_DOUBLE_MEMORY
)
H100_80GB_2G_20GB = MigProfile("2g.20gb", 2, 32, 2, 2, 0, 2, 0, 20096, PROFILE_ID_2G, 3, TWO_SLICES)
H100_80GB_3G_40GB = MigProfile(
    "3g.40gb", 3, 60, 3, 3, 0, 3, 0, 40448, PROFILE_ID_3G, 2, THREE_SLICES
)
H100_80GB_4G_40GB = MigProfile(
    "4g.40gb", 4, 64, 4, 4, 0, 4, 0, 40448, PROFILE_ID_4G, 1, FOUR_SLICES
)
H100_80GB_7G_80GB = MigProfile(
    "7g.80gb", 7, 132, 8, 7, 0, 7, 1, 81152, PROFILE_ID_7G, 1, SEVEN_SLICES
)

# H200 141GB (SXM5 and NVL). 1g.35gb, 3g.71gb, 4g.71gb: estimate (see the docstring).
H200_1G_18GB = MigProfile("1g.18gb", 1, 16, 1, 1, 0, 1, 0, 16384, PROFILE_ID_1G, 7, ONE_SLICE)
H200_1G_18GB_ME = MigProfile(
    "1g.18gb+me", 1, 16, 1, 1, 0, 1, 1, 16384, PROFILE_ID_1G_ME, 1, ONE_SLICE
)
H200_1G_35GB = MigProfile(
    "1g.35gb", 1, 26, 1, 1, 0, 1, 0, 33280, PROFILE_ID_1G_DOUBLE_MEMORY, 4, ONE_SLICE_DOUBLE_MEMORY
)
H200_2G_35GB = MigProfile("2g.35gb", 2, 32, 2, 2, 0, 2, 0, 33280, PROFILE_ID_2G, 3, TWO_SLICES)
H200_3G_71GB = MigProfile("3g.71gb", 3, 60, 3, 3, 0, 3, 0, 68096, PROFILE_ID_3G, 2, THREE_SLICES)
H200_4G_71GB = MigProfile("4g.71gb", 4, 64, 4, 4, 0, 4, 0, 68096, PROFILE_ID_4G, 1, FOUR_SLICES)
H200_7G_141GB = MigProfile(
    "7g.141gb", 7, 132, 8, 7, 0, 7, 1, 143360, PROFILE_ID_7G, 1, SEVEN_SLICES
)

# B200 180GB. Copy engines and counts from the guide; SMs, MiB, DEC/JPEG: estimate.
B200_1G_23GB = MigProfile("1g.23gb", 1, 18, 2, 1, 0, 1, 0, 22784, PROFILE_ID_1G, 7, ONE_SLICE)
B200_1G_23GB_ME = MigProfile(
    "1g.23gb+me", 1, 18, 2, 1, 0, 1, 1, 22784, PROFILE_ID_1G_ME, 1, ONE_SLICE
)
B200_1G_45GB = MigProfile(
    "1g.45gb", 1, 18, 2, 1, 0, 1, 0, 45312, PROFILE_ID_1G_DOUBLE_MEMORY, 4, ONE_SLICE_DOUBLE_MEMORY
)
B200_2G_45GB = MigProfile("2g.45gb", 2, 36, 3, 2, 0, 2, 0, 45312, PROFILE_ID_2G, 3, TWO_SLICES)
B200_3G_90GB = MigProfile("3g.90gb", 3, 54, 6, 3, 0, 3, 0, 90880, PROFILE_ID_3G, 2, THREE_SLICES)
B200_4G_90GB = MigProfile("4g.90gb", 4, 72, 8, 4, 0, 4, 0, 90880, PROFILE_ID_4G, 1, FOUR_SLICES)
B200_7G_180GB = MigProfile(
    "7g.180gb", 7, 126, 16, 7, 0, 7, 1, 182272, PROFILE_ID_7G, 1, SEVEN_SLICES
)


def _mixed_layout(
    big: MigProfile, medium: MigProfile, small: MigProfile
) -> tuple[MigLayoutEntry, ...]:
    # 3g at placement 4, 2g at 0, two 1g at 2 and 3: all seven compute slices used
    # (GPU instance ids 2, 3, 9 and 10).
    return (
        MigLayoutEntry(big, start=4),
        MigLayoutEntry(medium, start=0),
        MigLayoutEntry(small, start=2),
        MigLayoutEntry(small, start=3),
    )


A100_40GB = GpuModel(
    product_name="NVIDIA A100-SXM4-40GB",
    architecture=ARCH_AMPERE,
    compute_capability=(8, 0),
    memory_mib=40960,
    mig_capable=True,
    max_mig_devices=7,
    mig_profiles=(
        A100_40GB_1G_5GB,
        A100_40GB_1G_5GB_ME,
        A100_40GB_1G_10GB,
        A100_40GB_2G_10GB,
        A100_40GB_3G_20GB,
        A100_40GB_4G_20GB,
        A100_40GB_7G_40GB,
    ),
)
A100_80GB = GpuModel(
    product_name="NVIDIA A100-SXM4-80GB",
    architecture=ARCH_AMPERE,
    compute_capability=(8, 0),
    memory_mib=81920,
    mig_capable=True,
    max_mig_devices=7,
    mig_profiles=(
        A100_80GB_1G_10GB,
        A100_80GB_1G_10GB_ME,
        A100_80GB_1G_20GB,
        A100_80GB_2G_20GB,
        A100_80GB_3G_40GB,
        A100_80GB_4G_40GB,
        A100_80GB_7G_80GB,
    ),
)
H100_80GB = GpuModel(
    product_name="NVIDIA H100 80GB HBM3",
    architecture=ARCH_HOPPER,
    compute_capability=(9, 0),
    memory_mib=81920,  # real boards: 81559 (see the module docstring)
    mig_capable=True,
    max_mig_devices=7,
    mig_profiles=(
        H100_80GB_1G_10GB,
        H100_80GB_1G_10GB_ME,
        H100_80GB_1G_20GB,
        H100_80GB_2G_20GB,
        H100_80GB_3G_40GB,
        H100_80GB_4G_40GB,
        H100_80GB_7G_80GB,
    ),
)
H200_141GB = GpuModel(
    product_name="NVIDIA H200",
    architecture=ARCH_HOPPER,
    compute_capability=(9, 0),
    memory_mib=143771,  # what nvidia-smi reports for an H200 141GB
    mig_capable=True,
    max_mig_devices=7,
    mig_profiles=(
        H200_1G_18GB,
        H200_1G_18GB_ME,
        H200_1G_35GB,
        H200_2G_35GB,
        H200_3G_71GB,
        H200_4G_71GB,
        H200_7G_141GB,
    ),
)
B200 = GpuModel(
    product_name="NVIDIA B200",
    architecture=ARCH_BLACKWELL,
    compute_capability=(10, 0),
    memory_mib=183359,  # estimate: ~179 GiB, which go-nvlib's naming rounds to 180gb
    mig_capable=True,
    max_mig_devices=7,
    mig_profiles=(
        B200_1G_23GB,
        B200_1G_23GB_ME,
        B200_1G_45GB,
        B200_2G_45GB,
        B200_3G_90GB,
        B200_4G_90GB,
        B200_7G_180GB,
    ),
)
L4 = GpuModel(
    product_name="NVIDIA L4",
    architecture=ARCH_ADA,
    compute_capability=(8, 9),
    memory_mib=23034,
)


def _with_mig(model: GpuModel, layout: tuple[MigLayoutEntry, ...]) -> GpuModel:
    return GpuModel(
        product_name=model.product_name,
        architecture=model.architecture,
        compute_capability=model.compute_capability,
        memory_mib=model.memory_mib,
        brand=model.brand,
        mig_capable=model.mig_capable,
        max_mig_devices=model.max_mig_devices,
        mig_layout=layout,
        mig_profiles=model.mig_profiles,
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
    "b200": B200,
    "b200-mig": _with_mig(B200, _mixed_layout(B200_3G_90GB, B200_2G_45GB, B200_1G_23GB)),
    "h100-80gb": H100_80GB,
    "h100-80gb-mig": _with_mig(
        H100_80GB, _mixed_layout(H100_80GB_3G_40GB, H100_80GB_2G_20GB, H100_80GB_1G_10GB)
    ),
    "h200-141gb": H200_141GB,
    "h200-141gb-mig": _with_mig(
        H200_141GB, _mixed_layout(H200_3G_71GB, H200_2G_35GB, H200_1G_18GB)
    ),
    "l4": L4,
}
"""Profile name (as used in ``--profile h100-80gb:8``) → simulated GPU model."""

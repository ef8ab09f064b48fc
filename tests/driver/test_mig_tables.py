"""The catalogue's MIG tables against NVIDIA's published ones, written out here by hand.

Sources: the MIG user guide's "Supported MIG Profiles" tables (profiles, instances,
copy engines, NVDEC/JPEG/OFA) and its ``nvidia-smi mig -lgipp`` / ``-cgi`` examples
(placements, GPU instance ids). Where the catalogue departs from the guide on purpose
(B200 media engines, see gpucatalog's docstring) the test says so.
"""

from __future__ import annotations

import pytest

from drasil.driver.nvidia.nodedevices import mig_profile_name
from drasil.driver.nvidia.nvml import DeviceAttributes, Placement
from drasil.driver.simulated.gpucatalog import (
    MEMORY_SLICES,
    PROFILES,
    GpuModel,
    MiB,
    MigProfile,
    gpu_instance_id_at,
)

# nvidia-smi mig -lgipp, per profile id: "{0,1,2,3,4,5,6}:1" and so on.
LGIPP = {
    19: ((0, 1, 2, 3, 4, 5, 6), 1),
    20: ((0, 1, 2, 3, 4, 5, 6), 1),
    15: ((0, 2, 4, 6), 2),
    14: ((0, 2, 4), 2),
    9: ((0, 4), 4),
    5: ((0,), 4),
    0: ((0,), 8),
}

# The guide's tables: name, -lgip ID, instances, copy engines, NVDEC, JPEG, OFA.
GUIDE = {
    "a100-40gb": [
        ("1g.5gb", 19, 7, 1, 0, 0, 0),
        ("1g.5gb+me", 20, 1, 1, 1, 1, 1),
        ("1g.10gb", 15, 4, 1, 1, 0, 0),
        ("2g.10gb", 14, 3, 2, 1, 0, 0),
        ("3g.20gb", 9, 2, 3, 2, 0, 0),
        ("4g.20gb", 5, 1, 4, 2, 0, 0),
        ("7g.40gb", 0, 1, 7, 5, 1, 1),
    ],
    "a100-80gb": [
        ("1g.10gb", 19, 7, 1, 0, 0, 0),
        ("1g.10gb+me", 20, 1, 1, 1, 1, 1),
        ("1g.20gb", 15, 4, 1, 1, 0, 0),
        ("2g.20gb", 14, 3, 2, 1, 0, 0),
        ("3g.40gb", 9, 2, 3, 2, 0, 0),
        ("4g.40gb", 5, 1, 4, 2, 0, 0),
        ("7g.80gb", 0, 1, 7, 5, 1, 1),
    ],
    "h100-80gb": [
        ("1g.10gb", 19, 7, 1, 1, 1, 0),
        ("1g.10gb+me", 20, 1, 1, 1, 1, 1),
        ("1g.20gb", 15, 4, 1, 1, 1, 0),
        ("2g.20gb", 14, 3, 2, 2, 2, 0),
        ("3g.40gb", 9, 2, 3, 3, 3, 0),
        ("4g.40gb", 5, 1, 4, 4, 4, 0),
        ("7g.80gb", 0, 1, 8, 7, 7, 1),
    ],
    "h200-141gb": [
        ("1g.18gb", 19, 7, 1, 1, 1, 0),
        ("1g.18gb+me", 20, 1, 1, 1, 1, 1),
        ("1g.35gb", 15, 4, 1, 1, 1, 0),
        ("2g.35gb", 14, 3, 2, 2, 2, 0),
        ("3g.71gb", 9, 2, 3, 3, 3, 0),
        ("4g.71gb", 5, 1, 4, 4, 4, 0),
        ("7g.141gb", 0, 1, 8, 7, 7, 1),
    ],
    # The guide lists 1 NVDEC and 1 JPEG for every B200 profile; the catalogue gives
    # one per compute slice instead (seven 1g instances could not share one of each).
    "b200": [
        ("1g.23gb", 19, 7, 2, 1, 1, 0),
        ("1g.23gb+me", 20, 1, 2, 1, 1, 1),
        ("1g.45gb", 15, 4, 2, 1, 1, 0),
        ("2g.45gb", 14, 3, 3, 2, 2, 0),
        ("3g.90gb", 9, 2, 6, 3, 3, 0),
        ("4g.90gb", 5, 1, 8, 4, 4, 0),
        ("7g.180gb", 0, 1, 16, 7, 7, 1),
    ],
}

MODELS = sorted(GUIDE)


def _row(p: MigProfile) -> tuple[str | int, ...]:
    return (
        p.name,
        p.profile_id,
        p.instance_count,
        p.copy_engines,
        p.decoders,
        p.jpeg_engines,
        p.ofa_engines,
    )


@pytest.mark.parametrize("name", MODELS)
def test_profiles_match_the_guide(name: str) -> None:
    model = PROFILES[name]
    got = [_row(p) for p in model.mig_profiles]
    assert got == GUIDE[name]
    assert all(p.encoders == 0 for p in model.mig_profiles)


@pytest.mark.parametrize("name", MODELS)
def test_placements_match_lgipp(name: str) -> None:
    for profile in PROFILES[name].mig_profiles:
        starts, size = LGIPP[profile.profile_id]
        assert profile.placements == tuple(Placement(s, size) for s in starts), profile.name
        # The profile name's "<n>g" is its compute slices.
        assert profile.gpu_slices == int(profile.name.split("g", 1)[0])


@pytest.mark.parametrize("name", MODELS)
def test_the_7g_profile_is_the_whole_gpu(name: str) -> None:
    model = PROFILES[name]
    full = model.full_profile
    assert full is not None
    assert full.profile_id == 0
    assert full.placements == (Placement(0, MEMORY_SLICES),)
    assert full.memory_mib <= model.memory_mib
    for profile in model.mig_profiles:
        assert profile.multiprocessors <= full.multiprocessors
        # A profile has at most its share of the memory slices of the whole GPU.
        assert profile.memory_mib * MEMORY_SLICES <= full.memory_mib * profile.placements[0].size


@pytest.mark.parametrize("name", MODELS)
def test_profile_names_follow_from_their_numbers(name: str) -> None:
    # Discovery names a MIG device from its numbers alone (as go-nvlib does): the
    # catalogue's names must come out of its own numbers (+me is not a number).
    model = PROFILES[name]
    for p in model.mig_profiles:
        facts = DeviceAttributes(
            multiprocessor_count=p.multiprocessors,
            copy_engine_count=p.copy_engines,
            decoder_count=p.decoders,
            encoder_count=p.encoders,
            jpeg_count=p.jpeg_engines,
            ofa_count=p.ofa_engines,
            gpu_instance_slice_count=p.gpu_slices,
            compute_instance_slice_count=p.gpu_slices,
            memory_size_mib=p.memory_mib,
        )
        derived = mig_profile_name(facts, parent_memory=model.memory_mib * MiB)
        assert derived == p.name.removesuffix("+me")


def test_new_models() -> None:
    assert PROFILES["h200-141gb"].product_name == "NVIDIA H200"
    assert PROFILES["h200-141gb"].memory_mib == 143771
    assert PROFILES["b200"].product_name == "NVIDIA B200"
    assert 179 * 1024 <= PROFILES["b200"].memory_mib <= 180 * 1024


@pytest.mark.parametrize(
    ("start", "size", "gi"),
    [
        # The guide's -cgi/-lgi examples on an A100-40GB.
        (0, 1, 7),
        (1, 1, 8),
        (2, 1, 9),
        (3, 1, 10),
        (6, 1, 13),
        (0, 2, 3),
        (2, 2, 4),
        (4, 2, 5),
        (4, 4, 2),
        (0, 8, 0),
    ],
)
def test_gpu_instance_ids_are_nvmls(start: int, size: int, gi: int) -> None:
    assert gpu_instance_id_at(Placement(start, size)) == gi


def test_every_placement_has_its_own_gpu_instance_id() -> None:
    model: GpuModel = PROFILES["h100-80gb"]
    placements = {pl for p in model.mig_profiles for pl in p.placements}
    ids = {gpu_instance_id_at(pl) for pl in placements}
    assert len(ids) == len(placements)
    assert ids <= set(range(15))


@pytest.mark.parametrize("name", sorted(n for n in PROFILES if n.endswith("-mig")))
def test_static_layouts_sit_at_valid_placements(name: str) -> None:
    model = PROFILES[name]
    used: set[int] = set()
    for instance in model.mig_layout:
        assert instance.placement in instance.profile.placements
        assert used.isdisjoint(instance.placement.slices)
        used |= set(instance.placement.slices)
    assert [m.gpu_instance_id for m in model.mig_layout] == [2, 3, 9, 10]

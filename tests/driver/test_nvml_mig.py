"""The pynvml adapter's MIG calls, over a pynvml module backed by the fake NVML.

The fake pynvml speaks pynvml's API (profile indices, ctypes arrays and counts, opaque
GPU/compute instance handles, ``NVMLError`` with ``.value``) and answers from a
``FakeNvml``; so the adapter must give the fake's answers back through our Protocol.
"""

from __future__ import annotations

import ctypes
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pynvml import c_nvmlGpuInstancePlacement_t as PlacementStruct

from drasil.driver.nvidia.nvml import (
    NVML_ERROR_INVALID_ARGUMENT,
    GpuInstance,
    NvmlInsufficientResources,
    NvmlInUse,
    NvmlNotFound,
    NvmlQueryError,
    Placement,
)
from drasil.driver.nvidia.nvmladapter import PynvmlLibrary
from drasil.driver.nvidia.nvmlhost import read_mig_minors
from drasil.driver.simulated.nvml import FakeNvml, simulated_library

# pynvml's NVML_GPU_INSTANCE_PROFILE_* index → the profile id NVML answers with.
GI_PROFILE_IDS = {0: 19, 7: 20, 9: 15, 1: 14, 2: 9, 3: 5, 4: 0}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


def _pynvml_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except NvmlQueryError as err:
            raise NVMLError(err.code or 999) from err

    return call


class FakeMigPynvml(types.ModuleType):
    """pynvml's MIG functions over one GPU (index 0) of a ``FakeNvml``."""

    NVML_GPU_INSTANCE_PROFILE_COUNT = 0x12
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 0x9
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0

    def __init__(self, lib: FakeNvml) -> None:
        super().__init__("pynvml")
        ctypes_types = {
            "c_nvmlGpuInstancePlacement_t": PlacementStruct,
            "c_nvmlGpuInstance_t": ctypes.c_void_p,  # instance handles are ints here
            "c_nvmlComputeInstance_t": ctypes.c_void_p,
        }
        for name, value in ctypes_types.items():
            setattr(self, name, value)
        self.NVMLError = NVMLError
        self.lib = lib
        self.gpu = lib.device_handle_by_index(0)
        names = [n for n in dir(self) if n.startswith("nvml")]
        for name in names:
            setattr(self, name, _pynvml_errors(getattr(self, name)))

    def _profile(self, index: int) -> Any:
        pid = GI_PROFILE_IDS.get(index)
        profile = next(
            (p for p in self.lib.gpu_instance_profiles(self.gpu) if p.profile_id == pid), None
        )
        if profile is None:
            raise NVMLError(3)
        return profile

    def nvmlDeviceSetMigMode(self, handle: object, mode: int) -> int:
        self.lib.device_set_mig_mode(handle, bool(mode))
        return 0

    def nvmlDeviceGetMigMode(self, handle: object) -> list[int]:
        mode = self.lib.device_mig_mode(handle)
        return [int(mode.current), int(mode.pending)]

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, handle: object, index: int, version: int = 2
    ) -> Any:
        p = self._profile(index)
        return types.SimpleNamespace(
            id=p.profile_id,
            sliceCount=p.slice_count,
            instanceCount=p.instance_count,
            multiprocessorCount=p.multiprocessors,
            copyEngineCount=p.copy_engines,
            decoderCount=p.decoders,
            encoderCount=p.encoders,
            jpegCount=p.jpeg_engines,
            ofaCount=p.ofa_engines,
            memorySizeMB=p.memory_mib,
            name=f"MIG {p.name}".encode(),
        )

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, handle: object, pid: int, array: Any, count: Any
    ) -> int:
        placements = self.lib.gpu_instance_placements(handle, pid)
        for i, p in enumerate(placements):
            array[i].start, array[i].size = p.start, p.size
        count._obj.value = len(placements)
        return 0

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, handle: object, pid: int, placement: Any
    ) -> int:
        raw = placement._obj
        gi = self.lib.create_gpu_instance(handle, pid, Placement(raw.start, raw.size))
        return 100 + gi.gpu_instance_id

    def nvmlDeviceGetGpuInstances(self, handle: object, pid: int, array: Any, count: Any) -> int:
        found = [gi for gi in self.lib.gpu_instances(handle) if gi.profile_id == pid]
        for i, gi in enumerate(found):
            array[i] = 100 + gi.gpu_instance_id
        count._obj.value = len(found)
        return 0

    def nvmlDeviceGetGpuInstanceById(self, handle: object, gi_id: int) -> int:
        if all(gi.gpu_instance_id != gi_id for gi in self.lib.gpu_instances(handle)):
            raise NVMLError(6)
        return 100 + gi_id

    def nvmlGpuInstanceGetInfo(self, gi: int) -> Any:
        (info,) = [i for i in self.lib.gpu_instances(self.gpu) if i.gpu_instance_id == gi - 100]
        placement = types.SimpleNamespace(start=info.placement.start, size=info.placement.size)
        return types.SimpleNamespace(
            id=info.gpu_instance_id, profileId=info.profile_id, placement=placement
        )

    def nvmlGpuInstanceDestroy(self, gi: int) -> int:
        self.lib.destroy_gpu_instance(self.gpu, gi - 100)
        return 0

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gi: int, index: int, engines: int
    ) -> Any:
        gi_info = self.nvmlGpuInstanceGetInfo(gi)
        slices = next(
            p.slice_count
            for p in self.lib.gpu_instance_profiles(self.gpu)
            if p.profile_id == gi_info.profileId
        )
        widths = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}
        if widths.get(index, 99) > slices:
            raise NVMLError(3)
        return types.SimpleNamespace(id=index, sliceCount=widths[index])

    def nvmlGpuInstanceCreateComputeInstance(self, gi: int, ci_profile: int) -> int:
        ci = self.lib.create_compute_instance(self.gpu, gi - 100)
        assert ci.profile_id == ci_profile  # the adapter picked the widest profile
        return 1000 + (gi - 100) * 10 + ci.compute_instance_id

    def nvmlGpuInstanceGetComputeInstances(self, gi: int, pid: int, array: Any, count: Any) -> int:
        found = [c for c in self.lib.compute_instances(self.gpu, gi - 100) if c.profile_id == pid]
        for i, ci in enumerate(found):
            array[i] = 1000 + (gi - 100) * 10 + ci.compute_instance_id
        count._obj.value = len(found)
        return 0

    def nvmlComputeInstanceGetInfo(self, ci: int) -> Any:
        gi, ci_id = divmod(ci - 1000, 10)
        (info,) = [
            c for c in self.lib.compute_instances(self.gpu, gi) if c.compute_instance_id == ci_id
        ]
        return types.SimpleNamespace(id=info.compute_instance_id, profileId=info.profile_id)

    def nvmlGpuInstanceGetComputeInstanceById(self, gi: int, ci_id: int) -> int:
        if all(
            c.compute_instance_id != ci_id for c in self.lib.compute_instances(self.gpu, gi - 100)
        ):
            raise NVMLError(6)
        return 1000 + (gi - 100) * 10 + ci_id

    def nvmlComputeInstanceDestroy(self, ci: int) -> int:
        gi, ci_id = divmod(ci - 1000, 10)
        self.lib.destroy_compute_instance(self.gpu, gi, ci_id)
        return 0


@pytest.fixture
def fake() -> FakeNvml:
    lib = simulated_library("h100-80gb:1", node_name="n")
    lib.init()
    return lib


@pytest.fixture
def adapter(fake: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> PynvmlLibrary:
    monkeypatch.setitem(sys.modules, "pynvml", FakeMigPynvml(fake))
    return PynvmlLibrary()


def test_profiles_and_placements_are_the_fakes(adapter: PynvmlLibrary, fake: FakeNvml) -> None:
    gpu = fake.device_handle_by_index(0)
    profiles = adapter.gpu_instance_profiles(gpu)
    assert sorted(profiles, key=lambda p: p.profile_id) == sorted(
        fake.gpu_instance_profiles(gpu), key=lambda p: p.profile_id
    )
    for profile in profiles:
        assert adapter.gpu_instance_placements(gpu, profile.profile_id) == (
            fake.gpu_instance_placements(gpu, profile.profile_id)
        )
    with pytest.raises(NvmlQueryError) as err:
        adapter.gpu_instance_placements(gpu, 42)
    assert err.value.code == NVML_ERROR_INVALID_ARGUMENT


def test_instance_lifecycle_through_the_adapter(adapter: PynvmlLibrary, fake: FakeNvml) -> None:
    gpu = fake.device_handle_by_index(0)
    assert adapter.device_set_mig_mode(gpu, True).current
    gi = adapter.create_gpu_instance(gpu, 9, Placement(4, 4))
    assert gi == GpuInstance(2, 9, Placement(4, 4))
    adapter.create_gpu_instance(gpu, 19, Placement(0, 1))
    assert adapter.gpu_instances(gpu) == fake.gpu_instances(gpu)
    with pytest.raises(NvmlInsufficientResources):
        adapter.create_gpu_instance(gpu, 15, Placement(0, 2))
    ci = adapter.create_compute_instance(gpu, 2)
    assert ci.compute_instance_id == 0
    assert adapter.compute_instances(gpu, 2) == fake.compute_instances(gpu, 2)
    with pytest.raises(NvmlInUse):
        adapter.destroy_gpu_instance(gpu, 2)
    adapter.destroy_compute_instance(gpu, 2, 0)
    with pytest.raises(NvmlNotFound):
        adapter.destroy_compute_instance(gpu, 2, 0)
    adapter.destroy_gpu_instance(gpu, 2)
    with pytest.raises(NvmlNotFound):
        adapter.destroy_gpu_instance(gpu, 2)
    assert [g.gpu_instance_id for g in adapter.gpu_instances(gpu)] == [7]


def test_one_gpu_compute_instance_spans_a_7g(adapter: PynvmlLibrary, fake: FakeNvml) -> None:
    gpu = fake.device_handle_by_index(0)
    adapter.device_set_mig_mode(gpu, True)
    adapter.create_gpu_instance(gpu, 0, Placement(0, 8))
    assert adapter.create_compute_instance(gpu, 0).profile_id == 4  # the 7-slice profile


MIG_MINORS = """\
config 1
monitor 2
gpu0/gi0/access 3
gpu0/gi0/ci0/access 4
gpu0/gi2/access 21
gpu0/gi2/ci0/access 22
gpu1/gi2/access 156
gpu1/gi2/ci0/access 157
"""


def test_mig_device_nodes_from_mig_minors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    minors = tmp_path / "mig-minors"
    minors.write_text(MIG_MINORS)
    monkeypatch.setitem(sys.modules, "pynvml", types.ModuleType("pynvml"))
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "devices").write_text("Character devices:\n195 nvidia\n237 nvidia-caps\n")
    # No capabilities/ folder: the minors come from the mig-minors list.
    lib = PynvmlLibrary(proc_root=proc, mig_minors=minors)
    assert [(c.path, c.major, c.minor) for c in lib.mig_device_nodes(0, 2, 0)] == [
        ("/dev/nvidia-caps/nvidia-cap21", 237, 21),
        ("/dev/nvidia-caps/nvidia-cap22", 237, 22),
    ]
    assert lib.mig_device_nodes(1, 2, 0)[1].minor == 157
    with pytest.raises(NvmlNotFound, match="gpu0/gi5/access"):
        lib.mig_device_nodes(0, 5, 0)
    (proc / "devices").write_text("Character devices:\n195 nvidia\n")
    with pytest.raises(NvmlNotFound, match="no nvidia-caps"):
        lib.mig_device_nodes(0, 2, 0)
    assert read_mig_minors(tmp_path / "missing") == {}
    assert read_mig_minors(minors)["config"] == 1

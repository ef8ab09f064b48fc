"""drasil's mock NVML (e2e.harness.mocknvml): the real pynvml and PynvmlLibrary over it.

The mock is a C library of our own, compiled here and preloaded into this process; these
tests hold it to NVML's ABI (pynvml's ctypes layouts), to nvml.h's behaviour and to the
simulated backend: `discover()` over PynvmlLibrary + mock equals `discover()` over
FakeNvml for the same profile and node, and both share one GPU state file.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pynvml
import pytest
from mocknvml_fixture import MockNodeFactory, mock_node, mock_nvml_lib

from drasil.driver.devices import CharDevice, Device
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.nvidia.nvml import (
    EVENT_TYPE_XID_CRITICAL_ERROR,
    NO_INSTANCE,
    NvmlInsufficientResources,
    NvmlInUse,
    NvmlNotFound,
    NvmlNotSupported,
    NvmlQueryError,
    Placement,
)
from drasil.driver.nvidia.nvmladapter import PynvmlLibrary
from drasil.driver.simulated.gpus import mig_uuid
from drasil.driver.simulated.nvml import FakeNvml
from e2e.harness import mocknvml
from e2e.harness.mocknvml import MockNode

__all__ = ["mock_node", "mock_nvml_lib"]  # fixtures, imported for pytest

NODE = "node-a"


def _libs(node: MockNode) -> tuple[FakeNvml, PynvmlLibrary]:
    fake = FakeNvml(node.gpus, state_file=node.state_file, boot_id=node.boot_id)
    real = PynvmlLibrary(
        pcie_root=fake.pcie_root,
        dev_root=str(node.dev_root),
        proc_root=node.proc_root,
    )
    return fake, real


def _devices(devices: tuple[Device, ...]) -> list[Device]:
    """Comparable devices: device nodes are the adapter's (the fake has none), and NVML
    lists MIG profiles by profile index where the catalogue has its own order."""
    plain = [dataclasses.replace(d, device_nodes=(), char_devices=()) for d in devices]
    return sorted(plain, key=lambda d: d.name)


def _code(err: pytest.ExceptionInfo[Any]) -> int:
    value = getattr(err.value, "value", None)
    if value is None:
        value = getattr(err.value, "code", None)
    assert isinstance(value, int), err.value
    return value


# -- ABI ------------------------------------------------------------------------------------


class _GpuInstanceProfileInfoV3(ctypes.Structure):
    """nvml.h's nvmlGpuInstanceProfileInfo_v3_t (pynvml 13 has no ctypes class for it)."""

    _fields_ = [
        *((n, ctypes.c_uint) for n in ("version", "id", "sliceCount", "instanceCount")),
        *(
            (n, ctypes.c_uint)
            for n in (
                "multiprocessorCount",
                "copyEngineCount",
                "decoderCount",
                "encoderCount",
                "jpegCount",
                "ofaCount",
            )
        ),
        ("memorySizeMB", ctypes.c_ulonglong),
        ("name", ctypes.c_char * 96),
        ("capabilities", ctypes.c_uint),
    ]


class _ComputeInstanceProfileInfoV3(ctypes.Structure):
    _fields_ = [
        *(
            (n, ctypes.c_uint)
            for n in (
                "version",
                "id",
                "sliceCount",
                "instanceCount",
                "multiprocessorCount",
                "sharedCopyEngineCount",
                "sharedDecoderCount",
                "sharedEncoderCount",
                "sharedJpegCount",
                "sharedOfaCount",
            )
        ),
        ("name", ctypes.c_char * 96),
        ("capabilities", ctypes.c_uint),
    ]


STRUCTS: dict[str, type[ctypes.Structure]] = {
    "nvmlPciInfo_t": pynvml.nvmlPciInfo_t,
    "nvmlMemory_t": pynvml.c_nvmlMemory_t,
    "nvmlMemory_v2_t": pynvml.c_nvmlMemory_v2_t,
    "nvmlGpuInstancePlacement_t": pynvml.c_nvmlGpuInstancePlacement_t,
    "nvmlGpuInstanceProfileInfo_t": pynvml.c_nvmlGpuInstanceProfileInfo_t,
    "nvmlGpuInstanceProfileInfo_v2_t": pynvml.c_nvmlGpuInstanceProfileInfo_v2_t,
    "nvmlGpuInstanceProfileInfo_v3_t": _GpuInstanceProfileInfoV3,
    "nvmlGpuInstanceInfo_t": pynvml.c_nvmlGpuInstanceInfo_t,
    "nvmlComputeInstancePlacement_t": pynvml.c_nvmlComputeInstancePlacement_t,
    "nvmlComputeInstanceProfileInfo_t": pynvml.c_nvmlComputeInstanceProfileInfo_t,
    "nvmlComputeInstanceProfileInfo_v2_t": pynvml.c_nvmlComputeInstanceProfileInfo_v2_t,
    "nvmlComputeInstanceProfileInfo_v3_t": _ComputeInstanceProfileInfoV3,
    "nvmlComputeInstanceInfo_t": pynvml.c_nvmlComputeInstanceInfo_t,
    "nvmlDeviceAttributes_t": pynvml.c_nvmlDeviceAttributes,
    "nvmlEventData_t": pynvml.c_nvmlEventData_t,
}


def test_struct_layouts_match_pynvml(tmp_path: Path) -> None:
    lines = [
        "#include <stddef.h>",
        "#include <stdio.h>",
        '#include "nvml_types.h"',
        "int main(void) {",
    ]
    for c_name, cls in STRUCTS.items():
        lines.append(f'printf("{c_name} :sizeof %zu\\n", sizeof({c_name}));')
        for field, *_ in cls._fields_:
            lines.append(f'printf("{c_name} {field} %zu\\n", offsetof({c_name}, {field}));')
    lines.append(
        'printf("versions %u %u %u %u %u\\n", nvmlGpuInstanceProfileInfo_v2, '
        "nvmlGpuInstanceProfileInfo_v3, nvmlComputeInstanceProfileInfo_v2, "
        "nvmlComputeInstanceProfileInfo_v3, nvmlMemory_v2);"
    )
    lines.append("return 0; }")
    source = tmp_path / "layout.c"
    source.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    cc = os.environ.get("CC") or "cc"
    subprocess.run(
        [cc, "-Wall", "-Werror", f"-I{mocknvml.SOURCES}", "-o", str(exe), str(source)],
        check=True,
        capture_output=True,
        text=True,
    )
    out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    seen: dict[tuple[str, str], int] = {}
    versions: list[int] = []
    for line in out.splitlines():
        words = line.split()
        if words[0] == "versions":
            versions = [int(v) for v in words[1:]]
        else:
            seen[(words[0], words[1])] = int(words[2])
    for c_name, cls in STRUCTS.items():
        assert seen[(c_name, ":sizeof")] == ctypes.sizeof(cls), c_name
        for field, *_ in cls._fields_:
            assert seen[(c_name, field)] == getattr(cls, field).offset, (c_name, field)
    assert versions == [
        pynvml.nvmlGpuInstanceProfileInfo_v2,
        0x03000098,
        pynvml.nvmlComputeInstanceProfileInfo_v2,
        0x0300008C,
        pynvml.nvmlMemory_v2,
    ]
    # nvml.h: the v3 profile info is 152 bytes on x86-64, as v2 is.
    assert ctypes.sizeof(_GpuInstanceProfileInfoV3) == 152


def test_the_library_has_the_soname_and_every_symbol() -> None:
    path = mocknvml.compiled_mock()
    dynamic = subprocess.run(["readelf", "-dW", path], capture_output=True, text=True, check=True)
    assert "Library soname: [libnvidia-ml.so.1]" in dynamic.stdout
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1] for line in symbols.splitlines() if line.strip()}
    wanted = {
        "nvmlInit", "nvmlInit_v2", "nvmlInitWithFlags", "nvmlShutdown", "nvmlErrorString",
        "nvmlSystemGetDriverVersion", "nvmlSystemGetCudaDriverVersion",
        "nvmlSystemGetCudaDriverVersion_v2", "nvmlDeviceGetCount_v2",
        "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetName", "nvmlDeviceGetUUID",
        "nvmlDeviceGetMinorNumber", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetBrand",
        "nvmlDeviceGetArchitecture", "nvmlDeviceGetNumaNodeId", "nvmlDeviceGetAddressingMode",
        "nvmlDeviceGetMigMode",
        "nvmlDeviceSetMigMode", "nvmlDeviceGetMaxMigDeviceCount",
        "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetGpuInstanceId",
        "nvmlDeviceGetComputeInstanceId", "nvmlDeviceGetAttributes_v2",
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", "nvmlDeviceGetGpuInstanceProfileInfoV",
        "nvmlDeviceGetGpuInstanceProfileInfo", "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
        "nvmlDeviceCreateGpuInstanceWithPlacement", "nvmlDeviceGetGpuInstances",
        "nvmlDeviceGetGpuInstanceById", "nvmlGpuInstanceGetInfo", "nvmlGpuInstanceDestroy",
        "nvmlGpuInstanceGetComputeInstanceProfileInfoV",
        "nvmlGpuInstanceGetComputeInstanceProfileInfo", "nvmlGpuInstanceCreateComputeInstance",
        "nvmlGpuInstanceGetComputeInstances", "nvmlGpuInstanceGetComputeInstanceById",
        "nvmlComputeInstanceGetInfo_v2", "nvmlComputeInstanceDestroy", "nvmlEventSetCreate",
        "nvmlDeviceRegisterEvents", "nvmlDeviceGetSupportedEventTypes", "nvmlEventSetWait_v2",
        "nvmlEventSetFree", "nvmlDeviceGetComputeMode", "nvmlDeviceSetComputeMode",
        "mockNvmlInitCount", "mockNvmlReset",
    }  # fmt: skip
    assert wanted <= exported, sorted(wanted - exported)


# -- discovery: the mock answers as FakeNvml does -----------------------------------------


@pytest.mark.parametrize(
    "profile", ["h100-80gb:2", "a100-40gb-mig:1", "l4:1", "h100-80gb-mig:1,l4:1,b200:1"]
)
def test_discover_equals_the_simulated_backend(profile: str, mock_node: MockNodeFactory) -> None:
    node = mock_node(profile, node_name=NODE)
    fake, real = _libs(node)
    want, got = discover(fake, node_name=NODE), discover(real, node_name=NODE)
    assert _devices(got.devices) == _devices(want.devices)
    assert (got.skipped, got.driver_version, got.cuda_driver_version) == (
        want.skipped,
        want.driver_version,
        want.cuda_driver_version,
    )
    assert [d.device_nodes for d in got.devices if d.type.value == "gpu"] == [
        (f"{node.dev_root}/nvidia{d.minor}",) for d in got.devices if d.type.value == "gpu"
    ]


def test_dynamic_discovery_equals_the_simulated_backend_with_mig_on(
    mock_node: MockNodeFactory,
) -> None:
    # With MIG off, nvml.h has nvmlDeviceGetGpuInstanceProfileInfoV answer NOT_SUPPORTED,
    # which the adapter's profile listing (the V call) does not survive; with MIG on the
    # two backends agree.
    node = mock_node("a100-40gb-mig:1,h100-80gb-mig:1", node_name=NODE)
    fake, real = _libs(node)
    want = discover(fake, node_name=NODE, mig_mode="dynamic")
    got = discover(real, node_name=NODE, mig_mode="dynamic")
    assert _devices(got.devices) == _devices(want.devices)
    assert got.counter_sets == want.counter_sets


def test_mig_device_nodes_come_from_the_fake_proc(mock_node: MockNodeFactory) -> None:
    node = mock_node("a100-40gb-mig:1,h100-80gb-mig:1", node_name=NODE)
    _, real = _libs(node)
    caps = f"{node.dev_root}/nvidia-caps"
    gi_minor = 3 + 135 + 2 * 9
    assert real.mig_device_nodes(1, 2, 0) == tuple(
        CharDevice(
            f"/dev/nvidia-caps/nvidia-cap{n}", f"{caps}/nvidia-cap{n}", mocknvml.CAPS_MAJOR, n
        )
        for n in (gi_minor, gi_minor + 1)
    )
    access = node.proc_root / "driver/nvidia/capabilities/gpu1/mig/gi2/ci0/access"
    assert (
        access.read_text()
        == f"DeviceFileMinor: {3 + 135 + 19}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
    )
    devices = (node.proc_root / "devices").read_text()
    assert "195 nvidia\n" in devices
    assert "nvidia-caps" in devices.split("Block devices:")[0]


# -- init ---------------------------------------------------------------------------------


def test_init_is_reference_counted(mock_node: MockNodeFactory, mock_nvml_lib: ctypes.CDLL) -> None:
    mock_node("l4:1")
    pynvml.nvmlInit()
    pynvml.nvmlInit()
    assert mocknvml.init_count(mock_nvml_lib) == 2
    pynvml.nvmlShutdown()
    assert pynvml.nvmlDeviceGetCount() == 1
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError) as err:
        pynvml.nvmlDeviceGetCount()
    assert _code(err) == pynvml.NVML_ERROR_UNINITIALIZED
    # nvml.h: no error when shut down more often than initialised.
    assert mock_nvml_lib.nvmlShutdown() == 0
    assert mocknvml.init_count(mock_nvml_lib) == 0
    assert pynvml.nvmlErrorString(pynvml.NVML_ERROR_IN_USE) in (
        b"In use by another client",
        "In use by another client",
    )


def test_a_gpu_without_its_device_node_is_invisible(mock_node: MockNodeFactory) -> None:
    node = mock_node("h100-80gb:4", dev_nodes=False)
    mocknvml.make_dev_nodes(node.dev_root, [node.gpus[2]])
    pynvml.nvmlInit()
    try:
        assert pynvml.nvmlDeviceGetCount() == 1
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetUUID(handle) == node.gpus[2].uuid
        assert pynvml.nvmlDeviceGetMinorNumber(handle) == 2
        with pytest.raises(pynvml.NVMLError) as err:
            pynvml.nvmlDeviceGetHandleByIndex(1)
        assert _code(err) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    finally:
        pynvml.nvmlShutdown()


def test_a_mig_device_without_its_caps_nodes_is_invisible(mock_node: MockNodeFactory) -> None:
    """With an nvidia-caps folder in the dev root (as in a container) a MIG device is
    listed only while both its GPU and compute instance capability nodes are there;
    indices count the visible ones, and its UUID is not found otherwise."""
    node = mock_node("a100-40gb-mig:1")
    gpu = node.gpus[0]
    migs = sorted(gpu.migs, key=lambda m: m.instance.gpu_instance_id)
    caps = node.dev_root / "nvidia-caps"
    caps.mkdir()
    for mig in (migs[1], migs[3]):
        for ci in (None, mig.instance.compute_instance_id):
            minor = mocknvml.mig_cap_minor(gpu.minor, mig.instance.gpu_instance_id, ci)
            (caps / f"nvidia-cap{minor}").touch()
    only_gi = mocknvml.mig_cap_minor(gpu.minor, migs[0].instance.gpu_instance_id, None)
    (caps / f"nvidia-cap{only_gi}").touch()
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetMaxMigDeviceCount(handle) == gpu.model.max_mig_devices
        seen = [
            pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i))
            for i in range(2)
        ]
        assert seen == [migs[1].uuid, migs[3].uuid]
        with pytest.raises(pynvml.NVMLError) as err:
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 2)
        assert _code(err) == pynvml.NVML_ERROR_NOT_FOUND
        mig = pynvml.nvmlDeviceGetHandleByUUID(migs[3].uuid.encode())
        assert pynvml.nvmlDeviceGetName(mig) == "NVIDIA A100-SXM4-40GB MIG 1g.5gb"
        for hidden in (migs[0], migs[2]):  # migs[0] has its GPU instance's cap only
            with pytest.raises(pynvml.NVMLError) as err:
                pynvml.nvmlDeviceGetHandleByUUID(hidden.uuid.encode())
            assert _code(err) == pynvml.NVML_ERROR_NOT_FOUND
    finally:
        pynvml.nvmlShutdown()


def test_arguments_are_checked(mock_node: MockNodeFactory, mock_nvml_lib: ctypes.CDLL) -> None:
    mock_node("h100-80gb-mig:1")
    lib = mock_nvml_lib
    pynvml.nvmlInit()
    try:
        gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        small = ctypes.create_string_buffer(8)
        assert lib.nvmlDeviceGetUUID(gpu, small, ctypes.c_uint(8)) == 7  # INSUFFICIENT_SIZE
        assert lib.nvmlDeviceGetMinorNumber(gpu, None) == 2
        assert lib.nvmlDeviceGetMinorNumber(ctypes.c_void_p(16), ctypes.byref(ctypes.c_uint())) == 2
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
        info.version = 0x01000098
        assert lib.nvmlDeviceGetGpuInstanceProfileInfoV(gpu, 0, ctypes.byref(info)) == 2
        v3 = _GpuInstanceProfileInfoV3(version=0x03000098)
        assert lib.nvmlDeviceGetGpuInstanceProfileInfoV(gpu, 0, ctypes.byref(v3)) == 0
        assert (v3.id, v3.name) == (19, b"MIG 1g.10gb")
        # A MIG device handle is not a GPU instance handle, nor a full GPU for MIG calls.
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
        gi_info = pynvml.c_nvmlGpuInstanceInfo_t()
        assert lib.nvmlGpuInstanceGetInfo(mig, ctypes.byref(gi_info)) == 2
        with pytest.raises(pynvml.NVMLError) as err:
            pynvml.nvmlDeviceGetMigMode(mig)
        assert _code(err) == pynvml.NVML_ERROR_INVALID_ARGUMENT
        assert pynvml.nvmlDeviceGetName(mig) == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
        assert pynvml.nvmlDeviceGetMinorNumber(mig) == 0
        assert pynvml.nvmlDeviceGetMemoryInfo(mig).total == 40448 * 2**20
        assert pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu) == 7
        with pytest.raises(pynvml.NVMLError) as err:
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 4)
        assert _code(err) == pynvml.NVML_ERROR_NOT_FOUND
        pci = pynvml.nvmlDeviceGetPciInfo(gpu)
        assert (pci.busId, pci.busIdLegacy, pci.bus) == ("00000000:19:00.0", "0000:19:00.0", 0x19)
        # Unsupported profile indices are NOT_SUPPORTED, past the enum INVALID_ARGUMENT.
        with pytest.raises(pynvml.NVMLError) as err:
            pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, 5)
        assert _code(err) == pynvml.NVML_ERROR_NOT_SUPPORTED
        with pytest.raises(pynvml.NVMLError) as err:
            pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)
        assert _code(err) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    finally:
        pynvml.nvmlShutdown()


def test_compute_mode_arguments_are_checked(
    mock_node: MockNodeFactory, mock_nvml_lib: ctypes.CDLL
) -> None:
    mock_node("a100-40gb-mig:1")
    lib = mock_nvml_lib
    pynvml.nvmlInit()
    try:
        gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        mode = ctypes.c_uint(99)
        assert lib.nvmlDeviceGetComputeMode(gpu, None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
        not_a_handle = ctypes.c_void_p(16)
        assert lib.nvmlDeviceGetComputeMode(not_a_handle, ctypes.byref(mode)) == 2
        assert lib.nvmlDeviceSetComputeMode(not_a_handle, ctypes.c_uint(0)) == 2
        for bad in (ctypes.c_uint(pynvml.NVML_COMPUTEMODE_COUNT), ctypes.c_int(-1)):
            assert lib.nvmlDeviceSetComputeMode(gpu, bad) == pynvml.NVML_ERROR_INVALID_ARGUMENT
        assert pynvml.nvmlDeviceGetComputeMode(gpu) == pynvml.NVML_COMPUTEMODE_DEFAULT
        pynvml.nvmlDeviceSetComputeMode(gpu, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
        assert lib.nvmlDeviceGetComputeMode(gpu, ctypes.byref(mode)) == pynvml.NVML_SUCCESS
        assert mode.value == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
        # A MIG device has none of its own.
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
        with pytest.raises(pynvml.NVMLError) as err:
            pynvml.nvmlDeviceGetComputeMode(mig)
        assert _code(err) == pynvml.NVML_ERROR_NOT_SUPPORTED
        with pytest.raises(pynvml.NVMLError) as err:
            pynvml.nvmlDeviceSetComputeMode(mig, pynvml.NVML_COMPUTEMODE_DEFAULT)
        assert _code(err) == pynvml.NVML_ERROR_NOT_SUPPORTED
    finally:
        pynvml.nvmlShutdown()
    assert lib.nvmlDeviceGetComputeMode(gpu, ctypes.byref(mode)) == 1  # UNINITIALIZED


# -- MIG ----------------------------------------------------------------------------------


def test_dynamic_mig_lifecycle(mock_node: MockNodeFactory) -> None:
    node = mock_node("h100-80gb:1", node_name=NODE)
    _, lib = _libs(node)
    lib.init()
    try:
        gpu = lib.device_handle_by_index(0)
        # MIG off: the unversioned profile call and placements answer, the V call not.
        info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, 2, version=1)
        assert (info.id, info.sliceCount, info.memorySizeMB) == (9, 3, 40448)
        with pytest.raises(pynvml.NVMLError) as err:
            pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, 2)
        assert _code(err) == pynvml.NVML_ERROR_NOT_SUPPORTED
        count = ctypes.c_uint(0)
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(gpu, 9, None, ctypes.byref(count))
        assert count.value == 2
        assert lib.gpu_instance_placements(gpu, 9) == (Placement(0, 4), Placement(4, 4))
        assert lib.device_max_mig_device_count(gpu) == 0
        with pytest.raises(NvmlNotSupported):
            lib.create_gpu_instance(gpu, 9, Placement(0, 4))
        array = (pynvml.c_nvmlGpuInstance_t * 8)()
        with pytest.raises(pynvml.NVMLError) as err:
            pynvml.nvmlDeviceGetGpuInstances(gpu, 9, array, ctypes.byref(ctypes.c_uint(8)))
        assert _code(err) == pynvml.NVML_ERROR_NOT_SUPPORTED

        mode = lib.device_set_mig_mode(gpu, True)  # Hopper: at once
        assert (mode.current, mode.pending) == (True, True)
        names = {p.profile_id: p.name for p in lib.gpu_instance_profiles(gpu)}
        assert names == {19: "1g.10gb", 20: "1g.10gb+me", 15: "1g.20gb", 14: "2g.20gb",
                         9: "3g.40gb", 5: "4g.40gb", 0: "7g.80gb"}  # fmt: skip
        with pytest.raises(NvmlQueryError) as bad:
            lib.create_gpu_instance(gpu, 9, Placement(2, 4))
        assert bad.value.code == pynvml.NVML_ERROR_INVALID_ARGUMENT
        with pytest.raises(NvmlQueryError) as bad:
            lib.create_gpu_instance(gpu, 77, Placement(0, 4))
        assert bad.value.code == pynvml.NVML_ERROR_INVALID_ARGUMENT
        gi = lib.create_gpu_instance(gpu, 9, Placement(4, 4))
        assert gi.gpu_instance_id == 2
        with pytest.raises(NvmlInsufficientResources):
            lib.create_gpu_instance(gpu, 14, Placement(4, 2))  # overlaps
        with pytest.raises(NvmlInsufficientResources):
            lib.create_gpu_instance(gpu, 0, Placement(0, 8))
        ci = lib.create_compute_instance(gpu, 2)
        assert (ci.compute_instance_id, ci.profile_id) == (0, 2)
        with pytest.raises(NvmlInsufficientResources):
            lib.create_compute_instance(gpu, 2)
        assert lib.compute_instances(gpu, 2) == (ci,)
        with pytest.raises(NvmlInUse):
            lib.destroy_gpu_instance(gpu, 2)

        assert lib.device_max_mig_device_count(gpu) == 7
        mig = lib.device_mig_device_handle_by_index(gpu, 0)
        with pytest.raises(NvmlNotFound):
            lib.device_mig_device_handle_by_index(gpu, 1)
        assert lib.device_uuid(mig) == mig_uuid(NODE, 0, 2, 0)
        assert (lib.device_gpu_instance_id(mig), lib.device_compute_instance_id(mig)) == (2, 0)
        assert lib.device_attributes(mig).memory_size_mib == 40448
        assert lib.device_uuid(lib.device_parent_handle(mig)) == node.gpus[0].uuid
        assert lib.device_name(mig) == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
        # nvmlComputeInstanceGetInfo_v2 names the parent GPU and its GPU instance.
        gi_handle = pynvml.nvmlDeviceGetGpuInstanceById(gpu, 2)
        ci_info = pynvml.nvmlComputeInstanceGetInfo(
            pynvml.nvmlGpuInstanceGetComputeInstanceById(gi_handle, 0)
        )
        assert (ci_info.id, ci_info.profileId, ci_info.placement.size) == (0, 2, 3)
        assert pynvml.nvmlDeviceGetUUID(ci_info.device) == node.gpus[0].uuid
        with pytest.raises(pynvml.NVMLError) as err:
            pynvml.nvmlDeviceGetGpuInstanceById(gpu, 3)
        assert _code(err) == pynvml.NVML_ERROR_NOT_FOUND

        # Turning MIG off with instances: SUCCESS, the outcome in activationStatus.
        assert pynvml.nvmlDeviceSetMigMode(gpu, 0) == pynvml.NVML_ERROR_IN_USE
        assert lib.device_mig_mode(gpu).current

        lib.destroy_compute_instance(gpu, 2, 0)
        with pytest.raises(NvmlNotFound):
            lib.device_uuid(mig)  # the MIG device is gone
        lib.destroy_gpu_instance(gpu, 2)
        assert lib.gpu_instances(gpu) == ()
        assert pynvml.nvmlDeviceSetMigMode(gpu, 0) == pynvml.NVML_SUCCESS
        assert not lib.device_mig_mode(gpu).current
    finally:
        lib.shutdown()


def test_ampere_switches_mig_mode_at_the_next_reset(mock_node: MockNodeFactory) -> None:
    node = mock_node("a100-40gb:1", node_name=NODE)
    fake, lib = _libs(node)
    lib.init()
    try:
        gpu = lib.device_handle_by_index(0)
        assert pynvml.nvmlDeviceSetMigMode(gpu, 1) == pynvml.NVML_ERROR_RESET_REQUIRED
        assert pynvml.nvmlDeviceGetMigMode(gpu) == [0, 1]
        with pytest.raises(NvmlNotSupported):
            lib.create_gpu_instance(gpu, 9, Placement(0, 4))
    finally:
        lib.shutdown()
    assert not fake.device_mig_mode(fake.device_handle_by_index(0)).current
    mocknvml.reboot(node)
    lib.init()
    try:
        assert pynvml.nvmlDeviceGetMigMode(lib.device_handle_by_index(0)) == [1, 1]
    finally:
        lib.shutdown()
    assert fake.device_mig_mode(fake.device_handle_by_index(0)).current


def test_a_busy_gpu_refuses_mode_changes(mock_node: MockNodeFactory) -> None:
    mock_node("h100-80gb:2", busy=[1])
    pynvml.nvmlInit()
    try:
        busy = pynvml.nvmlDeviceGetHandleByIndex(1)
        assert pynvml.nvmlDeviceSetMigMode(busy, 1) == pynvml.NVML_ERROR_IN_USE
        assert pynvml.nvmlDeviceGetMigMode(busy) == [0, 0]
        idle = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceSetMigMode(idle, 1) == pynvml.NVML_SUCCESS
    finally:
        pynvml.nvmlShutdown()


def test_state_is_shared_with_the_simulated_backend(mock_node: MockNodeFactory) -> None:
    node = mock_node("h100-80gb:1,a100-40gb-mig:1", node_name=NODE)
    fake, lib = _libs(node)
    # The fake changes the GPU; the mock sees it.
    fake_gpu = fake.device_handle_by_index(0)
    fake.device_set_mig_mode(fake_gpu, True)
    fake.create_gpu_instance(fake_gpu, 19, Placement(3, 1))
    fake.create_compute_instance(fake_gpu, 10)
    fake.device_set_time_slice(fake_gpu, 2)
    lib.init()
    try:
        gpu = lib.device_handle_by_index(0)
        assert lib.gpu_instances(gpu)[0].gpu_instance_id == 10
        assert lib.device_uuid(lib.device_mig_device_handle_by_index(gpu, 0)) == mig_uuid(
            NODE, 0, 10, 0
        )
        # The mock changes it back; the fake sees that, and the time slice survives.
        lib.destroy_compute_instance(gpu, 10, 0)
        lib.destroy_gpu_instance(gpu, 10)
        a100 = lib.device_handle_by_index(1)
        lib.destroy_compute_instance(a100, 9, 0)
        lib.destroy_gpu_instance(a100, 9)
    finally:
        lib.shutdown()
    assert fake.gpu_instances(fake_gpu) == ()
    assert fake.device_time_slice(fake_gpu) == 2
    assert [gi.gpu_instance_id for gi in fake.gpu_instances(fake.device_handle_by_index(1))] == [
        2,
        3,
        10,
    ]
    doc = json.loads(node.state_file.read_text())
    assert doc["gpus"][node.gpus[0].uuid]["timeSlice"] == 2
    assert list(node.state_file.parent.glob("*.tmp-*")) == []
    assert _devices(discover(lib, node_name=NODE).devices) == _devices(
        discover(fake, node_name=NODE).devices
    )


def test_a_reboot_drops_instances_and_keeps_mig_mode(mock_node: MockNodeFactory) -> None:
    node = mock_node("h100-80gb-mig:1", node_name=NODE)
    fake, lib = _libs(node)
    lib.init()
    try:
        gpu = lib.device_handle_by_index(0)
        lib.destroy_compute_instance(gpu, 2, 0)  # writes the state file
        assert len(lib.gpu_instances(gpu)) == 4
    finally:
        lib.shutdown()
    mocknvml.reboot(node)  # a reboot restarts every NVML user: the next init sees it
    lib.init()
    try:
        gpu = lib.device_handle_by_index(0)
        assert lib.gpu_instances(gpu) == ()
        assert lib.device_mig_mode(gpu).current
    finally:
        lib.shutdown()
    assert fake.gpu_instances(fake.device_handle_by_index(0)) == ()
    assert json.loads(node.state_file.read_text())["bootId"] == node.boot_id()


def test_a_damaged_state_file_starts_from_the_profile(mock_node: MockNodeFactory) -> None:
    node = mock_node("a100-40gb-mig:1", node_name=NODE)
    node.state_file.write_text('{"version": 1, "bootId": 3}')
    _, lib = _libs(node)
    lib.init()
    try:
        assert len(lib.gpu_instances(lib.device_handle_by_index(0))) == 4
    finally:
        lib.shutdown()


# -- events ---------------------------------------------------------------------------------


def test_injected_xids_arrive_through_event_set_wait(mock_node: MockNodeFactory) -> None:
    node = mock_node("h100-80gb:2", node_name=NODE, events_unsupported=[1])
    _, lib = _libs(node)
    mocknvml.inject_xid(node.events_file, node.gpus[0].uuid, 31)  # before the set: not seen
    lib.init()
    try:
        gpus = [lib.device_handle_by_index(i) for i in range(2)]
        assert pynvml.nvmlDeviceGetSupportedEventTypes(gpus[0]) & EVENT_TYPE_XID_CRITICAL_ERROR
        assert pynvml.nvmlDeviceGetSupportedEventTypes(gpus[1]) == 0
        event_set = lib.event_set_create()
        lib.device_register_events(gpus[0], EVENT_TYPE_XID_CRITICAL_ERROR, event_set)
        with pytest.raises(NvmlNotSupported):
            lib.device_register_events(gpus[1], EVENT_TYPE_XID_CRITICAL_ERROR, event_set)
        assert lib.event_set_wait(event_set, 30) is None
        mocknvml.inject_xid(node.events_file, node.gpus[1].uuid, 48)  # not registered
        later = threading.Timer(
            0.05, mocknvml.inject_xid, (node.events_file, node.gpus[0].uuid, 79, 2, 0)
        )
        later.start()
        event = lib.event_set_wait(event_set, 5000)
        later.join()
        assert event is not None
        assert (event.event_data, event.gpu_instance_id, event.compute_instance_id) == (79, 2, 0)
        assert lib.device_uuid(event.device) == node.gpus[0].uuid
        mocknvml.inject_xid(node.events_file, node.gpus[0].uuid, 13)
        event = lib.event_set_wait(event_set, 1000)
        assert event is not None
        assert (event.event_data, event.gpu_instance_id) == (13, NO_INSTANCE)

        mocknvml.lose_gpu(node.events_file, node.gpus[0].uuid)
        with pytest.raises(NvmlQueryError) as lost:
            lib.event_set_wait(event_set, 1000)
        assert lost.value.code == pynvml.NVML_ERROR_GPU_IS_LOST
        with pytest.raises(NvmlQueryError) as lost:
            lib.device_uuid(gpus[0])
        assert lost.value.code == pynvml.NVML_ERROR_GPU_IS_LOST
        assert lib.device_uuid(gpus[1]) == node.gpus[1].uuid
        lib.event_set_free(event_set)
    finally:
        lib.shutdown()


# -- a copy without the environment: the embedded config -------------------------------------


def test_the_embedded_config_serves_a_copy_without_the_environment(tmp_path: Path) -> None:
    node = mocknvml.make_mock_node(tmp_path / "node", "l4:1,h100-80gb:1", node_name=NODE)
    path = mocknvml.compiled_mock(embedded_config=mocknvml.config_text(node), dest=tmp_path)
    probe = (
        "import ctypes, pynvml\n"
        f"ctypes.CDLL({str(path)!r}, mode=ctypes.RTLD_GLOBAL)\n"
        "pynvml.nvmlInit()\n"
        "gpu = pynvml.nvmlDeviceGetHandleByIndex(1)\n"
        "print(pynvml.nvmlDeviceGetCount(), pynvml.nvmlDeviceGetName(gpu))\n"
        "pynvml.nvmlShutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != mocknvml.CONFIG_ENV}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "2 NVIDIA H100 80GB HBM3"


def test_preload_refuses_a_second_library(mock_nvml_lib: ctypes.CDLL, tmp_path: Path) -> None:
    other = tmp_path / "libnvidia-ml.so.1"
    other.write_bytes(mocknvml.compiled_mock().read_bytes())
    with pytest.raises(mocknvml.MockNvmlError, match="another libnvidia-ml"):
        mocknvml.preload(other)

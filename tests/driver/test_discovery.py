"""Discovery through the NVML Protocol: the simulated fake and the real pynvml adapter."""

from __future__ import annotations

import logging
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from drasil.driver.devices import CharDevice, DeviceType, Version
from drasil.driver.nvidia.nodedevices import (
    NUMA_NODE_ATTRIBUTE,
    PCI_BUS_ID_ATTRIBUTE,
    PCIE_ROOT_ATTRIBUTE,
    cuda_version_semver,
    discover,
    driver_version_semver,
    mig_device_name,
    mig_profile_name,
    normalize_pci_bus_id,
)
from drasil.driver.nvidia.nvml import (
    DeviceAttributes,
    NvmlNotFound,
    NvmlQueryError,
    NvmlUnavailable,
)
from drasil.driver.nvidia.nvmladapter import PynvmlLibrary
from drasil.driver.nvidia.nvmlhost import sysfs_pcie_root
from drasil.driver.simulated.gpus import simulated_gpus
from drasil.driver.simulated.nvml import FakeNvml, simulated_library

GiB = 2**30
MiB = 2**20
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
K8S_PCI_BUS_ID = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")

GPU_ATTRIBUTES = {
    "type": str,
    "uuid": str,
    "productName": str,
    "brand": str,
    "architecture": str,
    "cudaComputeCapability": Version,
    "driverVersion": Version,
    "cudaDriverVersion": Version,
    "addressingMode": str,
    "index": int,
    "minor": int,
    PCI_BUS_ID_ATTRIBUTE: str,
    PCIE_ROOT_ATTRIBUTE: str,
    NUMA_NODE_ATTRIBUTE: int,
}


def test_h100_node() -> None:
    result = discover(simulated_library("h100-80gb:8", node_name="node-a"), node_name="node-a")
    assert not result.skipped
    assert [d.name for d in result.devices] == [f"gpu-{i}" for i in range(8)]
    for i, device in enumerate(result.devices):
        assert {k: type(v) for k, v in device.attributes.items()} == GPU_ATTRIBUTES
        assert device.type is DeviceType.GPU
        assert device.attributes["type"] == "gpu"
        assert device.attributes["productName"] == "NVIDIA H100 80GB HBM3"
        assert device.attributes["brand"] == "Nvidia"
        assert device.attributes["architecture"] == "Hopper"
        assert device.attributes["cudaComputeCapability"] == Version("9.0.0")
        assert device.attributes["driverVersion"] == Version("580.95.5")
        assert device.attributes["cudaDriverVersion"] == Version("13.0.0")
        assert device.attributes["addressingMode"] == "None"  # a discrete GPU, no HMM/ATS
        assert device.attributes["index"] == device.attributes["minor"] == i
        assert K8S_PCI_BUS_ID.fullmatch(str(device.attributes[PCI_BUS_ID_ATTRIBUTE]))
        assert str(device.attributes[PCIE_ROOT_ATTRIBUTE]).startswith("pci0000:")
        assert dict(device.capacity) == {"memory": 80 * 1024 * MiB}
        assert device.device_nodes == ()
        assert device.numa_node == (0 if i < 4 else 1)
        assert device.attributes[NUMA_NODE_ATTRIBUTE] == device.numa_node
        assert device.pcie_root == device.attributes[PCIE_ROOT_ATTRIBUTE]
        assert len(device.attributes) + len(device.capacity) <= 32
    assert result.driver_version == Version("580.95.5")


def test_nominal_sizes_where_nvml_reports_them() -> None:
    result = discover(simulated_library("a100-80gb:1,l4:1", node_name="n"), node_name="n")
    a100, l4 = result.devices
    assert a100.capacity["memory"] == 80 * GiB
    assert l4.capacity["memory"] == 23034 * MiB
    assert l4.attributes["architecture"] == "Ada Lovelace"
    assert l4.attributes["cudaComputeCapability"] == Version("8.9.0")


def test_uuids_are_deterministic() -> None:
    def uuids(node: str) -> list[str]:
        result = discover(simulated_library("a100-40gb-mig:1,l4:1", node_name=node), node_name=node)
        return [d.uuid for d in result.devices]

    assert uuids("node-a") == uuids("node-a")
    assert set(uuids("node-a")).isdisjoint(uuids("node-b"))


def test_mig_devices_replace_their_parent() -> None:
    gpus = simulated_gpus("a100-40gb-mig:2", node_name="n")
    result = discover(FakeNvml(gpus), node_name="n")
    assert not result.skipped
    assert all(d.type is DeviceType.MIG for d in result.devices)
    assert [d.name for d in result.devices[:4]] == [
        "gpu-0-mig-3g20gb-2-0",
        "gpu-0-mig-2g10gb-3-0",
        "gpu-0-mig-1g5gb-9-0",
        "gpu-0-mig-1g5gb-10-0",
    ]
    assert len(result.devices) == 8
    small = result.devices[2]
    assert small.attributes["type"] == "mig"
    assert small.attributes["profile"] == "1g.5gb"
    assert small.attributes["parentUUID"] == small.parent_uuid == gpus[0].uuid
    assert small.attributes["uuid"] == small.uuid == gpus[0].migs[2].uuid
    assert small.attributes["productName"] == "NVIDIA A100-SXM4-40GB"
    assert small.attributes["cudaComputeCapability"] == Version("8.0.0")
    assert dict(small.capacity) == {
        "memory": 4864 * MiB,
        "multiprocessors": 14,
        "copyEngines": 1,
        "decoders": 0,
        "encoders": 0,
        "jpegEngines": 0,
        "ofaEngines": 0,
    }
    big = result.devices[0]
    assert big.capacity["multiprocessors"] == 42
    assert big.capacity["memory"] == 20096 * MiB
    for device in result.devices:
        assert DNS_LABEL.fullmatch(device.name)
        assert len(device.attributes) + len(device.capacity) <= 32
        # A MIG device sits on its parent's NUMA node and says so with the standard name.
        assert device.attributes[NUMA_NODE_ATTRIBUTE] == device.numa_node is not None
    assert {d.parent_uuid for d in result.devices[4:]} == {gpus[1].uuid}


def test_h100_mig_profiles() -> None:
    result = discover(simulated_library("h100-80gb-mig:1", node_name="n"), node_name="n")
    assert [d.attributes["profile"] for d in result.devices] == [
        "3g.40gb",
        "2g.20gb",
        "1g.10gb",
        "1g.10gb",
    ]
    assert result.devices[2].name == "gpu-0-mig-1g10gb-9-0"
    assert result.devices[2].capacity["jpegEngines"] == 1


def test_failing_gpu_is_skipped_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    lib = simulated_library("h100-80gb:8", node_name="n")
    lib.fail_device(3, call="device_pci_bus_id")
    with caplog.at_level(logging.WARNING):
        result = discover(lib, node_name="n")
    assert [d.name for d in result.devices] == [f"gpu-{i}" for i in range(8) if i != 3]
    (skipped,) = result.skipped
    assert skipped.index == 3
    assert skipped.mig_index is None
    assert skipped.uuid == lib.gpus[3].uuid
    assert "GPU is lost" in skipped.reason
    assert "GPU is lost" in caplog.text
    assert lib.initialized == 0  # shut down again


def test_failing_uuid_is_skipped_without_uuid() -> None:
    lib = simulated_library("l4:2", node_name="n")
    lib.fail_device(0, call="device_uuid")
    result = discover(lib, node_name="n")
    assert [d.name for d in result.devices] == ["gpu-1"]
    assert result.skipped[0].uuid is None


def test_failing_mig_device_is_skipped_alone() -> None:
    lib = simulated_library("a100-40gb-mig:1", node_name="n")
    lib.fail_device(0, mig=1, call="device_attributes")
    result = discover(lib, node_name="n")
    assert len(result.devices) == 3
    (skipped,) = result.skipped
    assert (skipped.index, skipped.mig_index) == (0, 1)


def test_nvml_absent_is_a_clear_error() -> None:
    lib = simulated_library("l4:1", node_name="n")
    lib.fail_init()
    with pytest.raises(NvmlUnavailable, match="NVML is unavailable"):
        discover(lib, node_name="n")


def test_system_query_failure_is_unavailable() -> None:
    lib = FakeNvml(simulated_gpus("l4:1", node_name="n"), driver_version="unknown")
    with pytest.raises(NvmlUnavailable, match="cannot describe the system"):
        discover(lib, node_name="n")
    assert lib.initialized == 0


@pytest.mark.parametrize(
    ("nvml", "semver"),
    [
        ("550.54.15", "550.54.15"),
        ("535.104", "535.104.0"),
        ("580.95.05", "580.95.5"),
        ("470", "470.0.0"),
    ],
)
def test_driver_version_semver(nvml: str, semver: str) -> None:
    assert driver_version_semver(nvml) == semver


def test_version_and_bus_id_helpers() -> None:
    assert cuda_version_semver(12040) == "12.4.0"
    assert cuda_version_semver(13000) == "13.0.0"
    assert normalize_pci_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_pci_bus_id("0000:3b:00.0") == "0000:3b:00.0"
    with pytest.raises(ValueError, match="PCI bus id"):
        normalize_pci_bus_id("3b:00")
    with pytest.raises(ValueError, match="driver version"):
        driver_version_semver("beta")


def test_compute_instance_profiles_and_names() -> None:
    facts = DeviceAttributes(28, 2, 1, 0, 0, 0, 3, 1, 20096)
    assert mig_profile_name(facts, parent_memory=40960 * MiB) == "1c.3g.20gb"
    name = mig_device_name(parent_minor=3, profile="1g.5gb+me", gpu_instance=7, compute_instance=0)
    assert name == "gpu-3-mig-1g5gbme-7-0"


def test_sysfs_pcie_root(tmp_path: Path) -> None:
    device = tmp_path / "devices" / "pci0000:3a" / "0000:3a:00.0" / "0000:3b:00.0"
    device.mkdir(parents=True)
    links = tmp_path / "bus" / "pci" / "devices"
    links.mkdir(parents=True)
    (links / "0000:3b:00.0").symlink_to(device)
    assert sysfs_pcie_root("0000:3b:00.0", sysfs=tmp_path) == "pci0000:3a"
    assert sysfs_pcie_root("0000:5e:00.0", sysfs=tmp_path) is None


# -- the real adapter, over a pynvml stand-in ---------------------------------------


class _NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {
            3: "Not Supported",
            6: "Not Found",
            9: "Driver Not Loaded",
            10: "Timeout",
            12: "NVML Shared Library Not Found",
            15: "GPU is lost",
            18: "RM has detected an NVML/RM version mismatch.",
        }.get(self.value, f"NVML error {self.value}")


def _error_class(name: str, code: int) -> type[_NVMLError]:
    def init(self: _NVMLError) -> None:
        _NVMLError.__init__(self, code)

    return type(name, (_NVMLError,), {"__init__": init})


def _raiser(error: type[_NVMLError]) -> Callable[..., Any]:
    def fn(*_: object) -> Any:
        raise error()

    return fn


class FakePynvml(types.ModuleType):
    """Just enough of pynvml for two GPUs: an H100 and one in MIG mode with a GPU lost."""

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.NVMLError = _NVMLError
        errors = {
            "LibraryNotFound": 12,
            "DriverNotLoaded": 9,
            "LibRmVersionMismatch": 18,
            "NotSupported": 3,
            "NotFound": 6,
            "InvalidArgument": 2,
            "GpuIsLost": 15,
            "Timeout": 10,
        }
        self.errors = {
            name: _error_class(f"NVMLError_{name}", code) for name, code in errors.items()
        }
        for name, cls in self.errors.items():
            setattr(self, f"NVMLError_{name}", cls)
        self.calls: list[str] = []
        functions: dict[str, Callable[..., Any]] = {
            "nvmlInit": lambda: self.calls.append("init"),
            "nvmlShutdown": lambda: self.calls.append("shutdown"),
            "nvmlSystemGetDriverVersion": lambda: "550.54.15",
            "nvmlSystemGetCudaDriverVersion": lambda: 12040,
            "nvmlDeviceGetCount": lambda: 3,
            "nvmlDeviceGetHandleByIndex": lambda i: f"gpu{i}",
            "nvmlDeviceGetName": lambda h: b"NVIDIA H100 80GB HBM3",
            "nvmlDeviceGetUUID": self._uuid,
            "nvmlDeviceGetMinorNumber": lambda h: int(h[-1]),
            "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(total=81559 * MiB),
            "nvmlDeviceGetPciInfo": lambda h: types.SimpleNamespace(
                busId=f"00000000:{0x3B + int(h[-1]):02X}:00.0".encode()
            ),
            "nvmlDeviceGetCudaComputeCapability": lambda h: (9, 0),
            "nvmlDeviceGetBrand": lambda h: 14,
            "nvmlDeviceGetArchitecture": lambda h: 9,
            "nvmlDeviceGetNumaNodeId": _raiser(self.errors["NotSupported"]),
            "nvmlDeviceGetMigMode": self._mig_mode,
            "nvmlDeviceGetMaxMigDeviceCount": lambda h: 7,
            "nvmlDeviceGetMigDeviceHandleByIndex": self._mig_handle,
            "nvmlDeviceGetGpuInstanceId": lambda h: 7,
            "nvmlDeviceGetComputeInstanceId": lambda h: 0,
            "nvmlDeviceGetAttributes": lambda h: types.SimpleNamespace(
                multiprocessorCount=16,
                sharedCopyEngineCount=1,
                sharedDecoderCount=1,
                sharedEncoderCount=0,
                sharedJpegCount=1,
                sharedOfaCount=0,
                gpuInstanceSliceCount=1,
                computeInstanceSliceCount=1,
                memorySizeMB=9984,
            ),
            "nvmlEventSetWait": _raiser(self.errors["Timeout"]),
        }
        for name, fn in functions.items():
            setattr(self, name, fn)

    def _uuid(self, handle: str) -> str:
        if handle == "gpu2":
            raise self.errors["GpuIsLost"]()
        return "MIG-00000001" if "mig" in handle else f"GPU-0000000{handle[-1]}"

    def _mig_mode(self, handle: str) -> list[int]:
        if handle == "gpu0":
            raise self.errors["NotSupported"]()
        return [1, 1]

    def _mig_handle(self, handle: str, index: int) -> str:
        if index == 0:
            return f"{handle}-mig0"
        raise self.errors["NotFound" if index < 4 else "InvalidArgument"]()


@pytest.fixture
def fake_pynvml(monkeypatch: pytest.MonkeyPatch) -> FakePynvml:
    module = FakePynvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def fake_proc(root: Path, *, gpu_minor: int, gi: int, ci: int) -> Path:
    """The driver's /proc entries of one MIG device: capability minors 66 and 67."""
    access = root / f"driver/nvidia/capabilities/gpu{gpu_minor}/mig/gi{gi}"
    (access / f"ci{ci}").mkdir(parents=True)
    line = "DeviceFileMinor: {}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
    (access / "access").write_text(line.format(66))
    (access / f"ci{ci}" / "access").write_text(line.format(67))
    (root / "devices").write_text(
        "Character devices:\n195 nvidia\n508 nvidia-caps\n\nBlock devices:\n  8 sd\n"
    )
    return root


def test_real_adapter_discovers(fake_pynvml: FakePynvml, tmp_path: Path) -> None:
    lib = PynvmlLibrary(
        pcie_root=lambda bus_id: "pci0000:3a" if bus_id == "0000:3b:00.0" else None,
        proc_root=fake_proc(tmp_path, gpu_minor=1, gi=7, ci=0),
    )
    result = discover(lib, node_name="n")
    assert fake_pynvml.calls == ["init", "shutdown"]
    full, mig = result.devices
    assert full.name == "gpu-0"
    assert full.device_nodes == ("/dev/nvidia0",)
    assert full.numa_node is None
    # No NUMA affinity known: no standard attribute, never a -1 that would match others.
    assert NUMA_NODE_ATTRIBUTE not in full.attributes
    assert full.attributes["productName"] == "NVIDIA H100 80GB HBM3"
    assert full.attributes["driverVersion"] == Version("550.54.15")
    assert full.attributes["cudaDriverVersion"] == Version("12.4.0")
    assert full.attributes[PCI_BUS_ID_ATTRIBUTE] == "0000:3b:00.0"
    assert full.attributes[PCIE_ROOT_ATTRIBUTE] == "pci0000:3a"
    assert mig.name == "gpu-1-mig-1g10gb-7-0"
    assert mig.attributes["profile"] == "1g.10gb"
    assert mig.parent_uuid == "GPU-00000001"
    assert mig.device_nodes == ("/dev/nvidia1",)
    # A static MIG device gets its capability nodes, by number as the driver says.
    assert mig.char_devices == tuple(
        CharDevice(f"/dev/nvidia-caps/nvidia-cap{n}", f"/dev/nvidia-caps/nvidia-cap{n}", 508, n)
        for n in (66, 67)
    )
    assert PCIE_ROOT_ATTRIBUTE not in mig.attributes
    (lost,) = result.skipped
    assert lost.index == 2
    assert "nvmlDeviceGetUUID: GPU is lost" in lost.reason
    # This pynvml has no nvmlDeviceGetAddressingMode (older than NVML 12.8): no attribute.
    assert "addressingMode" not in full.attributes
    assert "addressingMode" not in mig.attributes


@pytest.mark.parametrize(("value", "name"), [(0, "None"), (1, "HMM"), (2, "ATS")])
def test_real_adapter_addressing_mode(
    fake_pynvml: FakePynvml, tmp_path: Path, value: int, name: str
) -> None:
    """NVML's addressing mode under go-nvlib's names, as NVIDIA's driver publishes it;
    a MIG device carries its parent's."""
    fake_pynvml.nvmlDeviceGetAddressingMode = lambda h: value
    lib = PynvmlLibrary(proc_root=fake_proc(tmp_path, gpu_minor=1, gi=7, ci=0))
    full, mig = discover(lib, node_name="n").devices
    assert full.attributes["addressingMode"] == mig.attributes["addressingMode"] == name


def test_real_adapter_without_addressing_mode(
    fake_pynvml: FakePynvml, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NOT_SUPPORTED (a platform without one) and FUNCTION_NOT_FOUND (a driver older
    than 570) publish no attribute; so does a value newer than drasil knows, with a
    warning, where NVIDIA's driver fails the GPU."""
    proc = fake_proc(tmp_path, gpu_minor=1, gi=7, ci=0)
    fake_pynvml.errors["FunctionNotFound"] = _error_class("NVMLError_FunctionNotFound", 13)
    answers: list[Callable[..., Any]] = [
        _raiser(fake_pynvml.errors["NotSupported"]),
        _raiser(fake_pynvml.errors["FunctionNotFound"]),
        lambda h: 7,
    ]
    for answer in answers:
        fake_pynvml.nvmlDeviceGetAddressingMode = answer
        with caplog.at_level(logging.WARNING):
            result = discover(PynvmlLibrary(proc_root=proc), node_name="n")
        assert [d.name for d in result.devices] == ["gpu-0", "gpu-1-mig-1g10gb-7-0"]
        assert all("addressingMode" not in d.attributes for d in result.devices)
    assert "addressing mode 7 is unknown" in caplog.text
    fake_pynvml.nvmlDeviceGetAddressingMode = _raiser(fake_pynvml.errors["GpuIsLost"])
    result = discover(PynvmlLibrary(proc_root=proc), node_name="n")
    assert result.devices == ()  # any other error is the GPU's own, as for other queries


@pytest.mark.parametrize(
    ("error", "advice"),
    [
        ("LibraryNotFound", "libnvidia-ml.so.1 was not found"),
        ("DriverNotLoaded", "kernel driver is not loaded"),
        ("LibRmVersionMismatch", "reboot the node"),
    ],
)
def test_real_adapter_init_errors(fake_pynvml: FakePynvml, error: str, advice: str) -> None:
    fake_pynvml.nvmlInit = _raiser(fake_pynvml.errors[error])
    with pytest.raises(NvmlUnavailable, match=advice):
        discover(PynvmlLibrary(), node_name="n")


def test_real_adapter_query_errors(fake_pynvml: FakePynvml) -> None:
    lib = PynvmlLibrary()
    with pytest.raises(NvmlQueryError) as err:
        lib.device_uuid("gpu2")
    assert err.value.code == 15
    with pytest.raises(NvmlNotFound):
        lib.device_mig_device_handle_by_index("gpu1", 5)  # INVALID_ARGUMENT: an empty slot
    assert lib.event_set_wait(object(), 10) is None  # TIMEOUT


def test_missing_pynvml_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(NvmlUnavailable, match="nvidia-ml-py"):
        PynvmlLibrary()

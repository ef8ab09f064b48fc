"""The GPU compute mode (``nvmlDeviceGetComputeMode``/``nvmlDeviceSetComputeMode``):
its values, the pynvml adapter over a stand-in pynvml, and the fake NVML's compute mode
in its state file. The adapter over the C mock is in test_nvml_adapter.py."""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path

import pytest

from drasil.driver.nvidia.nvml import (
    COMPUTE_MODE_DEFAULT,
    COMPUTE_MODE_EXCLUSIVE_PROCESS,
    COMPUTE_MODE_EXCLUSIVE_THREAD,
    COMPUTE_MODE_NAMES,
    COMPUTE_MODE_PROHIBITED,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_SUPPORTED,
    NvmlError,
    NvmlInvalidArgument,
    NvmlNotSupported,
    NvmlQueryError,
    check_compute_mode,
)
from drasil.driver.nvidia.nvmladapter import PynvmlLibrary
from drasil.driver.simulated.gpus import simulated_gpus
from drasil.driver.simulated.gpustate import StateFileError, parse_state
from drasil.driver.simulated.nvml import FakeNvml
from drasil.driver.simulated.nvmlcore import COMPUTE_MODE_CALLS

# ---- the values -------------------------------------------------------------------------


def test_the_values_are_nvmls() -> None:
    # nvml.h's nvmlComputeMode_t; pynvml's NVML_COMPUTEMODE_* carry the same numbers.
    import pynvml

    assert (
        COMPUTE_MODE_DEFAULT,
        COMPUTE_MODE_EXCLUSIVE_THREAD,
        COMPUTE_MODE_PROHIBITED,
        COMPUTE_MODE_EXCLUSIVE_PROCESS,
    ) == (
        pynvml.NVML_COMPUTEMODE_DEFAULT,
        pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD,
        pynvml.NVML_COMPUTEMODE_PROHIBITED,
        pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
    )
    assert COMPUTE_MODE_NAMES == {
        0: "Default",
        1: "Exclusive_Thread",
        2: "Prohibited",
        3: "Exclusive_Process",
    }


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_every_mode_passes_the_check(mode: int) -> None:
    check_compute_mode(mode)


@pytest.mark.parametrize("mode", [-1, 4, 99, True, 3.0, "3", None])
def test_other_values_are_a_value_error_naming_the_allowed_ones(mode: object) -> None:
    with pytest.raises(ValueError, match=r"0 \(Default\).*3 \(Exclusive_Process\)") as err:
        check_compute_mode(mode)  # type: ignore[arg-type]
    # An NVML query error too, with the code NVML would answer, like the time slice's.
    assert isinstance(err.value, NvmlInvalidArgument)
    assert isinstance(err.value, NvmlQueryError)
    assert err.value.code == NVML_ERROR_INVALID_ARGUMENT


# ---- the pynvml adapter over a stand-in pynvml -------------------------------------------


class ModePynvml(types.ModuleType):
    """Just enough pynvml for the compute mode methods: handles are names; "mig" answers
    NOT_SUPPORTED and "locked" NO_PERMISSION to a change, as NVML does."""

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.modes: dict[str, int] = {}
        self.calls: list[tuple[str, str, int | None]] = []

    def nvmlDeviceGetComputeMode(self, handle: str) -> int:
        self.calls.append(("get", handle, None))
        if handle == "mig":
            raise self.NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return self.modes.get(handle, 0)

    def nvmlDeviceSetComputeMode(self, handle: str, mode: int) -> None:
        self.calls.append(("set", handle, mode))
        if handle == "mig":
            raise self.NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if handle == "locked":
            raise self.NVMLError(NVML_ERROR_NO_PERMISSION)
        self.modes[handle] = mode


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> ModePynvml:
    module = ModePynvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def test_the_adapter_sets_and_reads_the_mode(stand_in: ModePynvml) -> None:
    lib = PynvmlLibrary()
    assert lib.device_compute_mode("gpu") == COMPUTE_MODE_DEFAULT
    lib.device_set_compute_mode("gpu", COMPUTE_MODE_EXCLUSIVE_PROCESS)
    assert lib.device_compute_mode("gpu") == COMPUTE_MODE_EXCLUSIVE_PROCESS
    assert ("set", "gpu", 3) in stand_in.calls


def test_the_adapter_checks_the_mode_before_calling(stand_in: ModePynvml) -> None:
    with pytest.raises(ValueError, match="compute mode 4"):
        PynvmlLibrary().device_set_compute_mode("gpu", 4)
    assert stand_in.calls == []


def test_a_mig_device_is_not_supported(stand_in: ModePynvml) -> None:
    lib = PynvmlLibrary()
    with pytest.raises(NvmlNotSupported) as err:
        lib.device_compute_mode("mig")
    assert err.value.code == NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(NvmlNotSupported):
        lib.device_set_compute_mode("mig", COMPUTE_MODE_EXCLUSIVE_PROCESS)


def test_no_permission_says_what_is_missing(stand_in: ModePynvml) -> None:
    with pytest.raises(NvmlQueryError, match=r"nvmlDeviceSetComputeMode.*needs root") as err:
        PynvmlLibrary().device_set_compute_mode("locked", COMPUTE_MODE_EXCLUSIVE_PROCESS)
    assert err.value.code == NVML_ERROR_NO_PERMISSION
    assert isinstance(err.value, NvmlError)


# ---- the fake NVML ----------------------------------------------------------------------


def fake(
    state_file: Path | None = None, *, boot: str = "boot-1", spec: str = "h100-80gb:2"
) -> FakeNvml:
    return FakeNvml(
        simulated_gpus(spec, node_name="n"), state_file=state_file, boot_id=lambda: boot
    )


def test_the_fake_starts_at_the_default_and_keeps_what_is_set() -> None:
    lib = fake()
    first, second = lib.device_handle_by_index(0), lib.device_handle_by_index(1)
    assert lib.device_compute_mode(first) == COMPUTE_MODE_DEFAULT
    lib.device_set_compute_mode(first, COMPUTE_MODE_EXCLUSIVE_PROCESS)
    assert (lib.device_compute_mode(first), lib.device_compute_mode(second)) == (3, 0)
    lib.device_set_compute_mode(first, COMPUTE_MODE_DEFAULT)
    assert lib.device_compute_mode(first) == COMPUTE_MODE_DEFAULT


def test_the_fake_refuses_what_nvml_refuses() -> None:
    lib = fake(spec="a100-40gb-mig:1")
    gpu = lib.device_handle_by_index(0)
    with pytest.raises(ValueError, match="compute mode 4") as err:
        lib.device_set_compute_mode(gpu, 4)
    assert isinstance(err.value, NvmlQueryError)
    assert err.value.code == NVML_ERROR_INVALID_ARGUMENT
    mig = lib.device_mig_device_handle_by_index(gpu, 0)
    for call in (
        lambda: lib.device_compute_mode(mig),
        lambda: lib.device_set_compute_mode(mig, COMPUTE_MODE_EXCLUSIVE_PROCESS),
    ):
        with pytest.raises(NvmlNotSupported) as unsupported:
            call()
        assert unsupported.value.code == NVML_ERROR_NOT_SUPPORTED
    assert lib.device_compute_mode(gpu) == COMPUTE_MODE_DEFAULT


def test_the_compute_mode_is_in_the_state_file(tmp_path: Path) -> None:
    path = tmp_path / "simulated-gpus.json"
    lib = fake(path, spec="h100-80gb:1,l4:1")
    h100, l4 = lib.device_handle_by_index(0), lib.device_handle_by_index(1)
    lib.device_set_compute_mode(h100, COMPUTE_MODE_EXCLUSIVE_PROCESS)
    lib.device_set_compute_mode(l4, COMPUTE_MODE_PROHIBITED)
    lib.device_set_time_slice(h100, 2)
    entries = json.loads(path.read_text())["gpus"]
    assert entries[lib.device_uuid(h100)] == {
        "migEnabled": False,
        "gpuInstances": [],
        "timeSlice": 2,
        "computeMode": 3,
    }
    assert entries[lib.device_uuid(l4)] == {
        "migEnabled": False,
        "gpuInstances": [],
        "computeMode": 2,
    }

    again = fake(path, spec="h100-80gb:1,l4:1")  # the plugin restarted
    assert again.device_compute_mode(h100) == COMPUTE_MODE_EXCLUSIVE_PROCESS
    assert again.device_compute_mode(l4) == COMPUTE_MODE_PROHIBITED
    again.device_set_compute_mode(h100, COMPUTE_MODE_DEFAULT)
    again.device_set_compute_mode(l4, COMPUTE_MODE_DEFAULT)
    assert lib.device_compute_mode(h100) == COMPUTE_MODE_DEFAULT  # the first one sees it
    assert lib.device_time_slice(h100) == 2
    entries = json.loads(path.read_text())["gpus"]
    assert "computeMode" not in entries[lib.device_uuid(h100)]  # the default is left out
    assert lib.device_uuid(l4) not in entries  # an L4 at the defaults needs no entry


def test_a_reboot_resets_the_compute_mode(tmp_path: Path) -> None:
    path = tmp_path / "simulated-gpus.json"
    before = fake(path, boot="boot-1", spec="l4:1")
    before.device_set_compute_mode(before.device_handle_by_index(0), 3)
    after = fake(path, boot="boot-2", spec="l4:1")
    assert after.device_compute_mode(after.device_handle_by_index(0)) == COMPUTE_MODE_DEFAULT


def test_a_gpu_reset_resets_the_compute_mode() -> None:
    lib = fake(spec="a100-40gb:1")
    gpu = lib.device_handle_by_index(0)
    lib.device_set_compute_mode(gpu, COMPUTE_MODE_EXCLUSIVE_PROCESS)
    lib.reset_gpu(0)
    assert lib.device_compute_mode(gpu) == COMPUTE_MODE_DEFAULT


@pytest.mark.parametrize("bad", [7, -1, "3", True, 3.0, None])
def test_a_bad_compute_mode_makes_the_file_damaged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: object
) -> None:
    path = tmp_path / "simulated-gpus.json"
    lib = fake(path, spec="l4:1")
    gpu = lib.device_handle_by_index(0)
    lib.device_set_compute_mode(gpu, COMPUTE_MODE_EXCLUSIVE_PROCESS)
    doc = json.loads(path.read_text())
    doc["gpus"][lib.device_uuid(gpu)]["computeMode"] = bad
    path.write_text(json.dumps(doc))
    with pytest.raises(StateFileError, match="compute mode"):
        parse_state(path.read_bytes(), lib.gpus)
    with caplog.at_level(logging.ERROR):
        assert fake(path, spec="l4:1").device_compute_mode(gpu) == COMPUTE_MODE_DEFAULT
    assert "damaged" in caplog.text


def test_fail_next_reaches_the_compute_mode_calls() -> None:
    assert {"device_compute_mode", "device_set_compute_mode"} == COMPUTE_MODE_CALLS
    lib = fake()
    gpu = lib.device_handle_by_index(0)
    lib.fail_next("device_set_compute_mode", after=True)
    with pytest.raises(NvmlQueryError):
        lib.device_set_compute_mode(gpu, COMPUTE_MODE_EXCLUSIVE_PROCESS)
    assert lib.device_compute_mode(gpu) == 3  # it took effect before failing
    lib.fail_next("device_set_compute_mode", NVML_ERROR_NO_PERMISSION)
    with pytest.raises(NvmlQueryError) as err:
        lib.device_set_compute_mode(gpu, COMPUTE_MODE_DEFAULT)
    assert err.value.code == NVML_ERROR_NO_PERMISSION
    assert lib.device_compute_mode(gpu) == 3  # it failed before taking effect
    lib.fail_next("device_compute_mode")
    with pytest.raises(NvmlQueryError):
        lib.device_compute_mode(gpu)


def test_fail_device_reaches_the_compute_mode_calls() -> None:
    lib = fake()
    lib.fail_device(1, call="device_set_compute_mode")
    with pytest.raises(NvmlQueryError, match="GPU is lost"):
        lib.device_set_compute_mode(lib.device_handle_by_index(1), COMPUTE_MODE_DEFAULT)
    lib.device_set_compute_mode(lib.device_handle_by_index(0), COMPUTE_MODE_DEFAULT)

"""The GPU compute time slice: ``nvidia-smi compute-policy`` behind the pynvml adapter,
and the fake NVML's time slice in its state file."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from drasil.driver.nvidia import nvmlhost
from drasil.driver.nvidia.nvml import (
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    NvmlNotSupported,
    NvmlQueryError,
)
from drasil.driver.nvidia.nvmladapter import PynvmlLibrary
from drasil.driver.nvidia.nvmlhost import parse_time_slice
from drasil.driver.simulated.gpus import simulated_gpus
from drasil.driver.simulated.nvml import FakeNvml

UUID = "GPU-11111111-2222-3333-4444-555555555555"

# What the fake nvidia-smi prints for --list. The real layout is undocumented; a table
# row with the GPU index first is the likely shape, and the parser must skip the index.
LISTING = """\
+--------------------------------+
| GPU compute policies:          |
| GPU   Name          Value      |
|================================|
|   0   Timeslice     {value:<10} |
+--------------------------------+
"""

# Records its arguments; --set-timeslice=N stores N, --list prints it, and a GPU
# named "GPU-bad" is refused the way nvidia-smi refuses (message, exit status 2).
FAKE_SMI = """#!/bin/sh
echo "$@" >> "{log}"
case "$3" in GPU-bad) echo "No devices were found" >&2; exit 2;; esac
case "$4" in
  --set-timeslice=*) echo "${{4#--set-timeslice=}}" > "{state}" ;;
  --list) printf '{listing}' "$(cat "{state}" 2>/dev/null || echo Default)" ;;
  *) exit 9 ;;
esac
"""


class UuidPynvml(types.ModuleType):
    """Just enough pynvml for the time slice methods: handles are UUID strings."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        super().__init__("pynvml")

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        return handle


@pytest.fixture
def smi(tmp_path: Path) -> Path:
    script = tmp_path / "nvidia-smi"
    listing = LISTING.replace("{value:<10}", "%-10s")
    script.write_text(
        FAKE_SMI.format(log=tmp_path / "calls", state=tmp_path / "slice", listing=listing)
    )
    script.chmod(0o755)
    return script


@pytest.fixture
def adapter(smi: Path, monkeypatch: pytest.MonkeyPatch) -> PynvmlLibrary:
    monkeypatch.setitem(sys.modules, "pynvml", UuidPynvml())
    return PynvmlLibrary(nvidia_smi=str(smi))


# ---- the listing ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [("Default", 0), ("Short", 1), ("MEDIUM", 2), ("Long", 3), ("2", 2)],
)
def test_the_listing_names_the_time_slice(value: str, expected: int) -> None:
    assert parse_time_slice(LISTING.format(value=value)) == expected


def test_other_spellings_of_the_row_are_read() -> None:
    assert parse_time_slice("GPU 00000000:3B:00.0\n    Time Slice : Long\n") == 3
    assert parse_time_slice("0 timeslice 1") == 1


def test_a_listing_without_a_time_slice_is_none() -> None:
    assert parse_time_slice("") is None
    assert parse_time_slice("| 0   Timeslice   N/A |") is None
    assert parse_time_slice("| 0   Other   Long |") is None


# ---- the pynvml adapter over a fake nvidia-smi -----------------------------------------


def test_set_runs_compute_policy_for_the_gpu(adapter: PynvmlLibrary, tmp_path: Path) -> None:
    adapter.device_set_time_slice(UUID, 2)
    assert (tmp_path / "calls").read_text() == f"compute-policy -i {UUID} --set-timeslice=2\n"
    assert adapter.device_time_slice(UUID) == 2
    adapter.device_set_time_slice(UUID, 0)
    assert adapter.device_time_slice(UUID) == 0


def test_an_interval_out_of_range_runs_nothing(adapter: PynvmlLibrary, tmp_path: Path) -> None:
    with pytest.raises(NvmlQueryError) as err:
        adapter.device_set_time_slice(UUID, 4)
    assert err.value.code == NVML_ERROR_INVALID_ARGUMENT
    assert not (tmp_path / "calls").exists()


def test_a_refusal_carries_what_the_tool_said(adapter: PynvmlLibrary) -> None:
    with pytest.raises(NvmlQueryError, match="exit status 2: No devices were found"):
        adapter.device_set_time_slice("GPU-bad", 1)
    with pytest.raises(NvmlQueryError, match="No devices were found"):
        adapter.device_time_slice("GPU-bad")


def test_a_missing_tool_is_a_query_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", UuidPynvml())
    lib = PynvmlLibrary(nvidia_smi=str(tmp_path / "absent"))
    with pytest.raises(NvmlQueryError, match="not found"):
        lib.device_set_time_slice(UUID, 1)


def test_a_hung_tool_times_out(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hung = tmp_path / "hung-smi"
    hung.write_text("#!/bin/sh\nexec sleep 30\n")
    hung.chmod(0o755)
    monkeypatch.setitem(sys.modules, "pynvml", UuidPynvml())
    monkeypatch.setattr(nvmlhost, "NVIDIA_SMI_TIMEOUT", 0.3)
    with pytest.raises(NvmlQueryError, match="no answer"):
        PynvmlLibrary(nvidia_smi=str(hung)).device_set_time_slice(UUID, 1)


def test_an_unreadable_listing_reads_as_the_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    odd = tmp_path / "odd-smi"
    odd.write_text("#!/bin/sh\necho 'no policies here'\n")
    odd.chmod(0o755)
    monkeypatch.setitem(sys.modules, "pynvml", UuidPynvml())
    assert PynvmlLibrary(nvidia_smi=str(odd)).device_time_slice(UUID) == 0


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
    assert lib.device_time_slice(first) == 0
    lib.device_set_time_slice(first, 3)
    assert (lib.device_time_slice(first), lib.device_time_slice(second)) == (3, 0)


def test_the_fake_refuses_what_nvidia_smi_refuses() -> None:
    lib = fake(spec="a100-40gb-mig:1")
    gpu = lib.device_handle_by_index(0)
    with pytest.raises(NvmlQueryError) as err:
        lib.device_set_time_slice(gpu, -1)
    assert err.value.code == NVML_ERROR_INVALID_ARGUMENT
    mig = lib.device_mig_device_handle_by_index(gpu, 0)
    with pytest.raises(NvmlNotSupported) as unsupported:
        lib.device_set_time_slice(mig, 1)
    assert unsupported.value.code == NVML_ERROR_NOT_SUPPORTED
    assert lib.device_time_slice(gpu) == 0


def test_the_time_slice_is_in_the_state_file(tmp_path: Path) -> None:
    path = tmp_path / "simulated-gpus.json"
    lib = fake(path, spec="h100-80gb:1,l4:1")
    h100, l4 = lib.device_handle_by_index(0), lib.device_handle_by_index(1)
    lib.device_set_time_slice(h100, 2)
    lib.device_set_time_slice(l4, 1)
    entries = json.loads(path.read_text())["gpus"]
    assert entries[lib.device_uuid(h100)]["timeSlice"] == 2
    assert entries[lib.device_uuid(l4)] == {"migEnabled": False, "gpuInstances": [], "timeSlice": 1}

    again = fake(path, spec="h100-80gb:1,l4:1")  # the plugin restarted
    assert again.device_time_slice(h100) == 2
    assert again.device_time_slice(l4) == 1
    again.device_set_time_slice(h100, 0)
    assert lib.device_time_slice(h100) == 0  # the first process sees the change
    entries = json.loads(path.read_text())["gpus"]
    assert "timeSlice" not in entries[lib.device_uuid(h100)]  # the default is left out


def test_a_reboot_resets_the_time_slice(tmp_path: Path) -> None:
    path = tmp_path / "simulated-gpus.json"
    before = fake(path, boot="boot-1", spec="l4:1")
    before.device_set_time_slice(before.device_handle_by_index(0), 3)
    after = fake(path, boot="boot-2", spec="l4:1")
    assert after.device_time_slice(after.device_handle_by_index(0)) == 0


def test_a_bad_time_slice_makes_the_file_damaged(tmp_path: Path) -> None:
    path = tmp_path / "simulated-gpus.json"
    lib = fake(path, spec="l4:1")
    gpu = lib.device_handle_by_index(0)
    lib.device_set_time_slice(gpu, 1)
    doc = json.loads(path.read_text())
    doc["gpus"][lib.device_uuid(gpu)]["timeSlice"] = 7
    path.write_text(json.dumps(doc))
    assert fake(path, spec="l4:1").device_time_slice(gpu) == 0


def test_fail_next_reaches_the_time_slice_calls() -> None:
    lib = fake()
    gpu = lib.device_handle_by_index(0)
    lib.fail_next("device_set_time_slice", after=True)
    with pytest.raises(NvmlQueryError):
        lib.device_set_time_slice(gpu, 2)
    assert lib.device_time_slice(gpu) == 2  # it took effect before failing
    lib.fail_next("device_time_slice")
    with pytest.raises(NvmlQueryError):
        lib.device_time_slice(gpu)

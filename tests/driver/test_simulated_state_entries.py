"""The simulated GPUs' state file (``simulated-gpus.json``) when it is not a regular
file: damaged, so the GPUs start from their profile, and never waited on (a FIFO)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from drasil.driver.simulated.gpus import simulated_gpus
from drasil.driver.simulated.nvml import FakeNvml


def h100(state_file: Path) -> FakeNvml:
    return FakeNvml(simulated_gpus("h100-80gb:1", node_name="n"), state_file=state_file)


def enable_mig(state_file: Path) -> None:
    lib = h100(state_file)
    lib.device_set_mig_mode(lib.device_handle_by_index(0), True)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_state_file_that_is_not_a_file_is_damaged_and_then_replaced(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "simulated-gpus.json"
    enable_mig(path)
    if kind == "fifo":
        path.unlink()
        os.mkfifo(path)
    else:  # a state elsewhere that reading through the link would take for ours
        path.rename(tmp_path / "elsewhere.json")
        path.symlink_to(tmp_path / "elsewhere.json")

    lib = h100(path)
    with caplog.at_level(logging.ERROR):
        assert not lib.device_mig_mode(lib.device_handle_by_index(0)).current

    assert "damaged" in caplog.text
    enable_mig(path)  # a change writes the file again, over the entry
    assert path.is_file()
    assert not path.is_symlink()
    assert h100(path).device_mig_mode(h100(path).device_handle_by_index(0)).current


@pytest.mark.timeout(20)
def test_a_state_file_that_is_a_directory_is_damaged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "simulated-gpus.json"
    path.mkdir()
    lib = h100(path)
    with caplog.at_level(logging.ERROR):
        assert not lib.device_mig_mode(lib.device_handle_by_index(0)).current
    (record,) = caplog.records
    assert "damaged" in record.getMessage()
    assert getattr(record, "error", "") == "not a regular file (a directory)"

"""MPS state files (``gpu``, ``daemon.json``, the pid file) that are not regular files:
read as missing or damaged, never waited on (a FIFO) nor followed (a symlink).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_mps import started_under

from drasil.kubeletplugin.vendors.nvidia.mps.daemons import (
    GPU_FILE,
    PID_FILE,
    RECORD_FILE,
    DaemonLimits,
    DaemonProgram,
    MpsDaemons,
    folder_key,
    is_mount_point,
    read_pid,
)

GPU_A = "GPU-5a1e9c1e-0000-4000-8000-000000000001"
SHARE = DaemonLimits(20480, 25)
SIMULATED = DaemonProgram.for_backend("simulated")


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "state"
    for pid in started_under(tmp_path):  # whatever daemon a test left
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for shm in tmp_path.glob("state/mps/*/shm"):  # and its tmpfs (test_mps's reaper)
        if is_mount_point(shm):
            subprocess.run(["umount", "-l", str(shm)], check=False)


def daemons(state: Path) -> MpsDaemons:
    # shm_size: the stand-in never mounts it; the default reads /proc/meminfo.
    return MpsDaemons(state, program=SIMULATED, stop_timeout=5, shm_size=2**20)


@pytest.mark.timeout(20)
def test_read_pid_of_a_fifo_or_directory_is_none(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    target = tmp_path / "target"
    target.write_text(f"{os.getpid()}\n")
    (tmp_path / "link").symlink_to(target)
    (tmp_path / "binary").write_bytes(b"\xff\xfe")
    for name in ("fifo", "dir", "link", "binary"):
        assert read_pid(tmp_path / name) is None
    assert read_pid(target) == os.getpid()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_gpu_file_that_is_not_a_file_leaves_the_folder_unknown(state: Path, kind: str) -> None:
    folder = state / "mps" / folder_key(GPU_A)
    folder.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(folder / GPU_FILE)
    else:
        (folder / GPU_FILE).mkdir()
    assert daemons(state).sweep(keep=[]) == []


@pytest.mark.timeout(20)
def test_a_record_that_is_a_fifo_is_ignored_and_written_again(state: Path) -> None:
    daemon = daemons(state).ensure(GPU_A, SHARE)
    record = state / "mps" / folder_key(GPU_A) / RECORD_FILE
    record.unlink()
    os.mkfifo(record)

    # The pid file still leads to the running daemon, which is adopted.
    assert daemons(state).ensure(GPU_A, SHARE) == daemon
    assert record.is_file()  # written again, over the FIFO
    assert started_under(state) == [daemon.pid]


@pytest.mark.timeout(20)
def test_a_pid_file_that_is_a_fifo_leads_to_no_daemon(state: Path) -> None:
    pipe = state / "mps" / folder_key(GPU_A) / "pipe"
    pipe.mkdir(parents=True)
    os.mkfifo(pipe / PID_FILE)
    assert not daemons(state).stop(GPU_A)

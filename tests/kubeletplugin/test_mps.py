"""MPS control daemons of shared GPUs, with real processes: the simulated backend's
stand-in, and a fake ``nvidia-cuda-mps-control`` script for the real backend's path.

Every test's daemons live under its own ``tmp_path``, and the ``reaper`` fixture kills
whatever process still runs with a pipe directory there, whatever the test left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from drasil.driver.cdi.spec import Mount, edits_dict
from drasil.driver.files import CRASH_ENV, CRASH_EXIT_CODE
from drasil.driver.simulated import mpsstandin
from drasil.kubeletplugin.vendors.nvidia.mps.daemons import (
    PID_FILE,
    RECORD_FILE,
    DaemonLimits,
    DaemonProgram,
    MpsDaemon,
    MpsDaemons,
    MpsError,
    folder_key,
    is_mount_point,
    process_start_time,
    share_edits,
    share_limits_of,
)

GPU_A = "GPU-5a1e9c1e-0000-4000-8000-000000000001"
GPU_B = "GPU-5a1e9c1e-0000-4000-8000-000000000002"
SHARE = DaemonLimits(20480, 25)
SIMULATED = DaemonProgram.for_backend("simulated")

# Mimics nvidia-cuda-mps-control: -d leaves a daemon (a sleep) running in the
# background with its pid in the pipe directory; "quit" on stdin ends it, unless the
# script was made STUBBORN. Its stdin, stdout and stderr are /dev/null, as a daemon's.
FAKE_CONTROL = """#!/bin/sh
if [ "$1" = "-d" ]; then
  if [ -n "$FAIL_START" ]; then echo "$FAIL_START" >&2; exit 1; fi
  (exec sleep 300) </dev/null >/dev/null 2>&1 &
  echo $! > "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
  echo "started for $CUDA_VISIBLE_DEVICES" >> "$CUDA_MPS_LOG_DIRECTORY/control.log"
  exit 0
fi
read command
echo "$command" >> "$CUDA_MPS_LOG_DIRECTORY/control.log"
if [ "$command" = quit ] && [ -z "$STUBBORN" ]; then
  kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid")"
  rm -f "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
fi
"""

CRASH_CHILD = """
import sys
from pathlib import Path
from drasil.kubeletplugin.vendors.nvidia.mps.daemons import DaemonLimits, DaemonProgram, MpsDaemons
daemons = MpsDaemons(Path(sys.argv[1]), program=DaemonProgram.for_backend("simulated"))
if sys.argv[2] == "ensure":
    daemons.ensure(sys.argv[3], DaemonLimits(20480, 25))
else:
    daemons.stop(sys.argv[3])
"""


def started_under(root: Path) -> list[int]:
    """Running processes whose MPS pipe directory is under ``root``.

    A process that is just exec'ing may not show its environment for a moment (the
    read fails); that is read again until the answer holds still, so a loaded machine
    does not make the list come up short.
    """
    deadline = time.monotonic() + 5.0
    found = _started_under(root)
    while time.monotonic() < deadline:
        again = _started_under(root)
        if again == found:
            return found
        found = again
        time.sleep(0.05)
    return found


def _started_under(root: Path) -> list[int]:
    found = []
    prefix = b"CUDA_MPS_PIPE_DIRECTORY=" + str(root).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        ours = any(var.startswith(prefix) for var in environ.split(b"\0"))
        if ours and process_start_time(int(entry.name)) is not None:
            found.append(int(entry.name))
    return sorted(found)


@pytest.fixture
def reaper(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    for pid in started_under(tmp_path):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for shm in tmp_path.glob("state/mps/*/shm"):
        if is_mount_point(shm):
            subprocess.run(["umount", "-l", str(shm)], check=False)


@pytest.fixture
def state(reaper: Path) -> Path:
    return reaper / "state"


@pytest.fixture
def daemons(state: Path) -> MpsDaemons:
    return MpsDaemons(state, program=SIMULATED, stop_timeout=5)


def wait_dead(pid: int, start_time: int) -> None:
    deadline = time.monotonic() + 5
    while process_start_time(pid) == start_time:
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.01)


def run_child(state: Path, method: str, gpu: str, crash_at: str) -> int:
    env = {**os.environ, CRASH_ENV: crash_at}
    done = subprocess.run(
        [sys.executable, "-c", CRASH_CHILD, str(state), method, gpu],
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    return done.returncode


# ---- the stand-in ---------------------------------------------------------------------


def test_ensure_starts_a_daemon_of_its_own(daemons: MpsDaemons, state: Path) -> None:
    daemon = daemons.ensure(GPU_A, SHARE)
    assert daemons.alive(daemon)
    assert started_under(state) == [daemon.pid]
    assert os.getsid(daemon.pid) != os.getsid(0)  # not our session: outlives the plugin
    assert daemon.pipe_dir == state.absolute() / "mps" / folder_key(GPU_A) / "pipe"
    assert stat.S_IMODE(daemon.pipe_dir.stat().st_mode) == 0o755
    assert (daemon.pipe_dir / PID_FILE).read_text().strip() == str(daemon.pid)
    assert stat.S_ISSOCK((daemon.pipe_dir / "control").stat().st_mode)
    assert GPU_A in (daemon.log_dir / "control.log").read_text()
    record = json.loads((state / "mps" / folder_key(GPU_A) / RECORD_FILE).read_text())
    assert record == {
        "gpu": GPU_A,
        "pid": daemon.pid,
        "startTime": daemon.start_time,
        "limits": {"memoryMiB": 20480, "threadPercentage": 25},
    }
    # Its /dev/shm is a tmpfs of its own, where the server's segment is; the node's is not.
    assert is_mount_point(daemon.shm_dir)
    assert stat.S_IMODE(daemon.shm_dir.stat().st_mode) == 0o1777
    (segment,) = daemon.shm_dir.iterdir()
    assert segment.name == f"mps.shm.0.{daemon.pid}"
    assert not Path("/dev/shm", segment.name).exists()


def test_ensure_is_idempotent(daemons: MpsDaemons, state: Path) -> None:
    first = daemons.ensure(GPU_A, SHARE)
    assert daemons.ensure(GPU_A, SHARE) == first
    restarted = MpsDaemons(state, program=SIMULATED)  # the plugin restarted
    assert restarted.ensure(GPU_A, SHARE) == first
    assert started_under(state) == [first.pid]


def test_one_daemon_per_gpu(daemons: MpsDaemons, state: Path) -> None:
    a, b = daemons.ensure(GPU_A, SHARE), daemons.ensure(GPU_B, SHARE)
    assert a.pid != b.pid
    assert a.pipe_dir != b.pipe_dir
    assert started_under(state) == sorted([a.pid, b.pid])


def test_ensure_restarts_a_killed_daemon(daemons: MpsDaemons, state: Path) -> None:
    first = daemons.ensure(GPU_A, SHARE)
    os.kill(first.pid, signal.SIGKILL)
    wait_dead(first.pid, first.start_time)
    assert not daemons.alive(first)
    second = daemons.ensure(GPU_A, SHARE)
    assert second.pid != first.pid
    assert daemons.alive(second)
    assert started_under(state) == [second.pid]


def test_stop_ends_the_daemon_and_empties_its_pipe_dir(daemons: MpsDaemons, state: Path) -> None:
    daemon = daemons.ensure(GPU_A, SHARE)
    assert daemons.stop(GPU_A)
    assert not daemons.alive(daemon)
    assert started_under(state) == []
    assert list(daemon.pipe_dir.iterdir()) == []
    assert not (state / "mps" / folder_key(GPU_A) / RECORD_FILE).exists()
    assert "quit" in (daemon.log_dir / "control.log").read_text()  # logs are kept
    assert not daemons.stop(GPU_A)  # twice is fine
    assert not daemons.stop(GPU_B)  # and never started too
    assert daemons.alive(daemons.ensure(GPU_A, SHARE))  # and it starts again


def test_a_daemon_that_no_longer_answers_is_killed(state: Path) -> None:
    daemons = MpsDaemons(state, program=SIMULATED, stop_timeout=0.5)
    daemon = daemons.ensure(GPU_A, SHARE)
    (daemon.pipe_dir / "control").unlink()
    assert daemons.stop(GPU_A)
    assert not daemons.alive(daemon)
    assert not is_mount_point(daemon.shm_dir)


def test_the_daemon_holds_the_largest_share_and_clients_only_narrow_it(
    daemons: MpsDaemons,
) -> None:
    daemon = daemons.ensure(GPU_A, SHARE)
    pipe, shm = daemon.pipe_dir, daemon.shm_dir
    # A client that unset its variables gets the daemon's limit, not the whole GPU.
    with mpsstandin.connect_client(pipe, shm) as bare:
        assert (bare.memory, bare.threads) == ("20480M", "25.0")
    with mpsstandin.connect_client(pipe, shm, pinned="0=10240M", threads="10") as narrow:
        assert (narrow.memory, narrow.threads) == ("10240M", "10.0")
    with mpsstandin.connect_client(pipe, shm, pinned="0=81920M", threads="100") as wide:
        assert (wide.memory, wide.threads) == ("20480M", "25.0")
    bigger = daemons.ensure(GPU_A, DaemonLimits(40960, 50))
    assert bigger.pid == daemon.pid
    assert bigger.limits == DaemonLimits(40960, 50)
    assert daemons.ensure(GPU_A, SHARE).limits == DaemonLimits(40960, 50)  # never shrinks
    assert mpsstandin.control(pipe, "get_default_device_pinned_mem_limit 0") == "40960M"
    # A restarted plugin that finds the daemon without a record sets its limits again.
    (record := pipe.parent / RECORD_FILE).unlink()
    assert MpsDaemons(pipe.parents[2], program=SIMULATED).ensure(GPU_A, SHARE).limits == SHARE
    assert json.loads(record.read_text())["limits"]["memoryMiB"] == 20480


def test_a_client_that_does_not_see_the_daemons_shm_cannot_connect(
    daemons: MpsDaemons, tmp_path: Path
) -> None:
    daemon = daemons.ensure(GPU_A, SHARE)
    with pytest.raises(mpsstandin.StandinRefused, match="shared memory"):
        mpsstandin.connect_client(daemon.pipe_dir, tmp_path)


def test_multiuser_starts_the_daemon_with_the_option(state: Path) -> None:
    program = DaemonProgram.for_backend("simulated", multiuser=True)
    daemon = MpsDaemons(state, program=program).ensure(GPU_A, SHARE)
    cmdline = Path(f"/proc/{daemon.pid}/cmdline").read_bytes().split(b"\0")
    assert b"-multiuser-server" in cmdline


def test_sweep_stops_the_daemons_of_gpus_not_kept(daemons: MpsDaemons, state: Path) -> None:
    a, b = daemons.ensure(GPU_A, SHARE), daemons.ensure(GPU_B, SHARE)
    after_crash = MpsDaemons(state, program=SIMULATED)
    assert after_crash.sweep(keep=[GPU_A]) == [GPU_B]
    assert after_crash.alive(a)
    assert not after_crash.alive(b)
    assert started_under(state) == [a.pid]
    assert after_crash.sweep(keep=[GPU_A]) == []
    assert after_crash.sweep(keep=[]) == [GPU_A]
    assert started_under(state) == []


def test_a_reused_pid_is_not_alive(daemons: MpsDaemons, state: Path) -> None:
    daemon = daemons.ensure(GPU_A, SHARE)
    assert not daemons.alive(replace(daemon, start_time=daemon.start_time + 1))
    # GPU B's record and pid file name a live process that is no daemon of it (the
    # test itself, as after pid reuse): it is neither adopted nor stopped.
    gpu_dir = state / "mps" / folder_key(GPU_B)
    (gpu_dir / "pipe").mkdir(parents=True)
    (gpu_dir / "pipe" / PID_FILE).write_text(f"{os.getpid()}\n")
    record = {"gpu": GPU_B, "pid": os.getpid(), "startTime": daemon.start_time}
    (gpu_dir / RECORD_FILE).write_text(json.dumps(record))
    assert not daemons.stop(GPU_B)
    (gpu_dir / "pipe" / PID_FILE).write_text(f"{os.getpid()}\n")
    assert daemons.ensure(GPU_B, SHARE).pid != os.getpid()
    assert len(started_under(state)) == 2


def test_a_daemon_whose_record_is_lost_is_adopted(daemons: MpsDaemons, state: Path) -> None:
    daemon = daemons.ensure(GPU_A, SHARE)
    (state / "mps" / folder_key(GPU_A) / RECORD_FILE).unlink()
    assert MpsDaemons(state, program=SIMULATED).ensure(GPU_A, SHARE) == daemon
    assert (state / "mps" / folder_key(GPU_A) / RECORD_FILE).exists()
    assert started_under(state) == [daemon.pid]


def test_a_damaged_record_is_ignored(daemons: MpsDaemons, state: Path) -> None:
    daemon = daemons.ensure(GPU_A, SHARE)
    (state / "mps" / folder_key(GPU_A) / RECORD_FILE).write_text("{not json")
    assert daemons.ensure(GPU_A, SHARE) == daemon


def test_a_crash_after_the_start_leaves_one_daemon(state: Path) -> None:
    assert run_child(state, "ensure", GPU_A, "mps-after-start") == CRASH_EXIT_CODE
    (orphan,) = started_under(state)
    assert not (state / "mps" / folder_key(GPU_A) / RECORD_FILE).exists()
    daemon = MpsDaemons(state, program=SIMULATED).ensure(GPU_A, SHARE)
    assert daemon.pid == orphan
    assert started_under(state) == [orphan]


def test_a_crash_after_the_stop_is_finished_by_the_next_stop(
    daemons: MpsDaemons, state: Path
) -> None:
    daemon = daemons.ensure(GPU_A, SHARE)
    assert run_child(state, "stop", GPU_A, "mps-after-stop") == CRASH_EXIT_CODE
    assert started_under(state) == []
    assert (state / "mps" / folder_key(GPU_A) / RECORD_FILE).exists()  # not cleaned up yet
    again = MpsDaemons(state, program=SIMULATED)
    assert not again.stop(GPU_A)
    assert not (state / "mps" / folder_key(GPU_A) / RECORD_FILE).exists()
    assert again.ensure(GPU_A, SHARE).pid != daemon.pid


def test_process_start_time_treats_a_zombie_as_gone() -> None:
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 5
    while process_start_time(child.pid) is not None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert Path(f"/proc/{child.pid}").exists()  # a zombie until reaped
    child.wait()
    assert process_start_time(0) is None


def test_bad_arguments_are_refused(state: Path) -> None:
    with pytest.raises(ValueError, match="backend"):
        DaemonProgram.for_backend("cuda")
    daemons = MpsDaemons(state, program=SIMULATED)
    for bad in ("", "../etc", "GPU-1/2", "MIG-GPU-1/1/0"):
        with pytest.raises(MpsError):
            daemons.ensure(bad, SHARE)


# ---- the real backend's path, over a fake nvidia-cuda-mps-control ----------------------


def real(control: Path, root: Path = Path("/")) -> DaemonProgram:
    return DaemonProgram.for_backend("nvml", control=str(control), driver_root=root)


@pytest.fixture
def control(reaper: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = reaper / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-cuda-mps-control"
    script.write_text(FAKE_CONTROL)
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return script


def test_the_control_program_starts_and_quits_the_daemon(control: Path, state: Path) -> None:
    daemons = MpsDaemons(state, program=DaemonProgram.for_backend("nvml"))  # on PATH
    daemon = daemons.ensure(GPU_A, SHARE)
    assert daemons.alive(daemon)
    assert started_under(state) == [daemon.pid]
    assert f"started for {GPU_A}" in (daemon.log_dir / "control.log").read_text()
    assert daemons.ensure(GPU_A, SHARE) == daemon
    assert daemons.stop(GPU_A)
    assert not daemons.alive(daemon)
    assert "quit" in (daemon.log_dir / "control.log").read_text()
    assert not daemons.stop(GPU_A)


def test_a_daemon_that_ignores_quit_is_killed(
    control: Path, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STUBBORN", "1")
    daemons = MpsDaemons(state, program=real(control), stop_timeout=0.3)
    daemon = daemons.ensure(GPU_A, SHARE)
    assert daemons.stop(GPU_A)
    assert not daemons.alive(daemon)
    assert started_under(state) == []


def test_the_real_backend_sweeps_too(control: Path, state: Path) -> None:
    daemons = MpsDaemons(state, program=real(control))
    daemons.ensure(GPU_A, SHARE)
    assert MpsDaemons(state, program=real(control)).sweep(keep=()) == [GPU_A]
    assert started_under(state) == []


def test_a_failed_start_carries_the_message(
    control: Path, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAIL_START", "An instance of this daemon is already running")
    daemons = MpsDaemons(state, program=real(control))
    with pytest.raises(MpsError, match="status 1: An instance of this daemon"):
        daemons.ensure(GPU_A, SHARE)


def test_a_missing_control_program_is_an_error(state: Path) -> None:
    daemons = MpsDaemons(state, program=real(state / "absent"))
    with pytest.raises(MpsError, match="absent"):
        daemons.ensure(GPU_A, SHARE)


def test_a_daemon_that_writes_no_pid_file_times_out(reaper: Path, state: Path) -> None:
    silent = reaper / "silent-control"
    silent.write_text("#!/bin/sh\nexit 0\n")
    silent.chmod(0o755)
    daemons = MpsDaemons(state, program=real(silent), start_timeout=0.3)
    with pytest.raises(MpsError, match=PID_FILE):
        daemons.ensure(GPU_A, SHARE)


# ---- container edits -----------------------------------------------------------------


def test_share_edits_point_the_container_at_the_daemon(tmp_path: Path) -> None:
    daemon = MpsDaemon(GPU_A, 42, 7, tmp_path / "pipe", tmp_path / "log", tmp_path / "shm")
    edits = share_edits(daemon, share_limits_of(10 * 2**30 + 5, 25))
    assert edits.env == {
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
    }
    # The pipe directory read-only, the daemon's tmpfs as /dev/shm; no log directory.
    assert edits.mounts == (
        Mount(str(tmp_path / "pipe"), "/tmp/nvidia-mps", options=("rbind", "ro")),
        Mount(
            str(tmp_path / "shm"), "/dev/shm", options=("rbind", "rw", "nosuid", "nodev", "noexec")
        ),
    )
    assert edits.device_nodes == ()
    assert edits_dict(edits.env, edits.device_nodes, edits.mounts)["mounts"][0] == {
        "hostPath": str(tmp_path / "pipe"),
        "containerPath": "/tmp/nvidia-mps",
        "options": ["rbind", "ro"],
    }


@pytest.mark.parametrize(("memory", "threads"), [(2**20 - 1, 50), (2**30, 0), (2**30, 101)])
def test_share_limits_refuse_what_mps_cannot_take(memory: int, threads: int) -> None:
    with pytest.raises(ValueError, match=r"thread percentage|memory limit"):
        share_limits_of(memory, threads)


def test_daemon_limits_cover_both_and_set_defaults_and_servers() -> None:
    assert DaemonLimits(100, 50).covering(DaemonLimits(200, 10)) == DaemonLimits(200, 50)
    assert DaemonLimits(100, 50).covering(None) == DaemonLimits(100, 50)
    assert DaemonLimits(100, 50).commands([7]) == [
        "set_default_device_pinned_mem_limit 0 100M",
        "set_default_active_thread_percentage 50",
        "set_device_pinned_mem_limit 7 0 100M",
        "set_active_thread_percentage 7 50",
    ]


# ---- a driver root other than /: the daemon runs chrooted into it ---------------------

# A static stand-in for the driver's control program: -d leaves a daemon whose pid is
# in the pipe directory and that marks the /dev/shm it sees; "quit" on stdin ends it.
# Static, because a chroot into this fake root has no libc to load.
STATIC_CONTROL = r"""
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static void path(char *out, const char *file) {
    snprintf(out, 512, "%s/%s", getenv("CUDA_MPS_PIPE_DIRECTORY"), file);
}
int main(int argc, char **argv) {
    char pid_path[512];
    path(pid_path, "nvidia-cuda-mps-control.pid");
    if (argc > 1 && strcmp(argv[1], "-d") == 0) {
        if (fork() != 0) return 0;
        setsid();
        FILE *mark = fopen("/dev/shm/seen-by-daemon", "w");
        if (mark) fclose(mark);
        FILE *f = fopen(pid_path, "w");
        if (!f) return 1;
        fprintf(f, "%d\n", getpid());
        fclose(f);
        for (;;) pause();
    }
    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "quit", 4) == 0) {
            FILE *f = fopen(pid_path, "r");
            int pid = 0;
            if (f && fscanf(f, "%d", &pid) == 1) kill(pid, SIGTERM);
            if (f) fclose(f);
        }
    }
    return 0;
}
"""


@pytest.fixture
def driver_root(reaper: Path) -> Path:
    from e2e.harness.cbuild import compile_c, compiler

    root = reaper / "driver-root"
    for folder in ("usr/bin", "tmp", "dev/shm"):
        (root / folder).mkdir(parents=True)
    source = reaper / "control.c"
    source.write_text(STATIC_CONTROL)
    binary = root / "usr/bin/nvidia-cuda-mps-control"
    compile_c([compiler(), "-static", "-O1", "-o", str(binary), str(source)], error=RuntimeError)
    return root


def test_on_a_driver_root_the_daemon_runs_chrooted_with_its_directories_inside(
    driver_root: Path, state: Path
) -> None:
    program = real(Path("/usr/bin/nvidia-cuda-mps-control"), driver_root)
    daemons = MpsDaemons(state, program=program)
    daemon = daemons.ensure(GPU_A, SHARE)
    assert daemons.alive(daemon)
    assert Path(f"/proc/{daemon.pid}/root").resolve() == driver_root
    # Its /tmp/nvidia-mps is our pipe directory, its /dev/shm our tmpfs; the driver
    # root's own /tmp and /dev/shm are untouched.
    assert (daemon.pipe_dir / PID_FILE).exists()
    assert (daemon.shm_dir / "seen-by-daemon").exists()
    assert list((driver_root / "tmp").iterdir()) == []
    assert list((driver_root / "dev/shm").iterdir()) == []
    assert daemons.stop(GPU_A)
    assert not daemons.alive(daemon)


def test_a_driver_root_without_the_program_says_where_it_looked(
    driver_root: Path, state: Path
) -> None:
    daemons = MpsDaemons(state, program=real(Path("/usr/bin/absent"), driver_root))
    with pytest.raises(MpsError, match=f"absent in driver root {driver_root}"):
        daemons.ensure(GPU_A, SHARE)

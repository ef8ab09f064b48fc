"""The simulated backend's stand-in for nvidia-cuda-mps-control, run as the plugin runs
the real program: ``-d``/``-f``, the MPS environment, commands on the control socket.

Each test's daemons live in a short temp dir (a socket path has at most 107 bytes) and
the ``standin`` fixture kills whatever daemon a test left running.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from drasil.driver.simulated.mpsstandin import (
    CLIENT_LIMIT,
    CONTROL_SOCKET,
    LOG_FILE,
    MAX_LINE,
    PID_FILE,
    DaemonNotFound,
    MpsClient,
    StandinRefused,
    connect_client,
    control,
)
from e2e.harness.cbuild import compile_c, compiler

MODULE = "drasil.driver.simulated.mpsstandin"
GPU = "GPU-5a1e9c1e-0000-4000-8000-000000000001"
NOBODY = 65534
DEADLINE = 10.0
MPS_CLIENT_SOURCE = Path(__file__).parents[2] / "e2e" / "harness" / "probe" / "mps_client.c"


def wait_until(condition: Callable[[], object], what: str) -> None:
    end = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {DEADLINE}s waiting for {what}")
        time.sleep(0.01)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: a daemon is nobody's child here, and a zombie is dead."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat_line.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def default_segment(pid: int) -> Path:
    return Path(f"/dev/shm/mps.shm.{os.getuid()}.{pid}")


class Standin:
    """Pipe, log and shared memory dirs of one test, and the daemons started there."""

    def __init__(self, root: Path) -> None:
        self.pipe = root / "pipe"
        self.log = root / "log"
        self.shm = root / "shm"
        self.pids: list[int] = []

    def env(self, *, own_shm: bool = True) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "DRASIL_MPS"))}
        env |= {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log),
            "CUDA_VISIBLE_DEVICES": GPU,
        }
        if own_shm:  # else /dev/shm, which the C client reads literally
            env["DRASIL_MPS_STANDIN_SHM_DIR"] = str(self.shm)
        return env

    def run(
        self, *args: str, stdin: str = "", own_shm: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", MODULE, *args],
            input=stdin,
            env=self.env(own_shm=own_shm),
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            check=False,
        )

    def start(self, *args: str, own_shm: bool = True) -> int:
        """Start a daemon with ``-d``; its pid."""
        done = self.run("-d", *args, own_shm=own_shm)
        assert done.returncode == 0, done.stderr
        pid = int((self.pipe / PID_FILE).read_text())
        self.pids.append(pid)
        return pid

    def control(self, command: str) -> str:
        return control(self.pipe, command)

    def client(self, pinned: str | None = None, threads: str | None = None) -> MpsClient:
        return connect_client(self.pipe, self.shm, pinned=pinned, threads=threads)

    def client_count(self) -> int:
        return int(self.control("get_client_count"))

    def quit(self, pid: int) -> None:
        assert self.control("quit") == "OK"
        wait_until(lambda: not alive(pid), f"daemon {pid} to exit")


@pytest.fixture
def standin() -> Iterator[Standin]:
    root = Path(tempfile.mkdtemp(prefix="mps", dir="/tmp"))
    root.chmod(0o755)  # the other-uid client walks into it
    daemons = Standin(root)
    try:
        yield daemons
    finally:
        for pid in daemons.pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
            default_segment(pid).unlink(missing_ok=True)  # only a killed one leaves it
        shutil.rmtree(root, ignore_errors=True)


# -- the daemon's lifecycle -------------------------------------------------------------


def test_d_leaves_what_the_real_daemon_leaves_and_quit_removes_it(standin: Standin) -> None:
    pid = standin.start()
    assert alive(pid)
    socket_mode = (standin.pipe / CONTROL_SOCKET).stat().st_mode
    assert stat.S_ISSOCK(socket_mode)
    assert stat.S_IMODE(socket_mode) == 0o666
    segment = standin.shm / f"mps.shm.{os.getuid()}.{pid}"
    assert stat.S_IMODE(segment.stat().st_mode) == 0o644
    assert len(segment.read_text().strip()) == 32  # secrets.token_hex(16)

    standin.quit(pid)
    assert list(standin.pipe.iterdir()) == []
    assert not segment.exists()
    log = (standin.log / LOG_FILE).read_text().splitlines()
    assert log[0].startswith("[")
    assert f" Control {pid}] " in log[0]
    assert "command quit -> OK" in log[-2]
    assert log[-1].endswith("stopped")


def test_a_second_daemon_on_the_same_pipe_dir_fails(standin: Standin) -> None:
    standin.start()
    done = standin.run("-d")
    assert done.returncode == 1
    assert "already runs" in done.stderr
    assert standin.control("get_client_count") == "0"  # the first one still serves


def test_a_pipe_dir_too_long_for_a_socket_fails_clearly(standin: Standin) -> None:
    standin.pipe = standin.pipe / ("x" * 120)
    done = standin.run("-d")
    assert done.returncode == 1
    assert "at most 107 bytes" in done.stderr


def test_sigterm_stops_a_d_daemon_cleanly(standin: Standin) -> None:
    pid = standin.start()
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not alive(pid), "the daemon to exit")
    assert list(standin.pipe.iterdir()) == []
    assert list(standin.shm.iterdir()) == []


def test_a_stalled_or_overlong_connection_blocks_nobody(standin: Standin) -> None:
    standin.start()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stalled:
        stalled.connect(str(standin.pipe / CONTROL_SOCKET))
        stalled.sendall(b"get_client_")  # and never the rest of the line
        assert standin.control("get_client_count") == "0"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as overlong:
            overlong.settimeout(DEADLINE)
            overlong.connect(str(standin.pipe / CONTROL_SOCKET))
            overlong.sendall(b"x" * (MAX_LINE + 10) + b"\n")
            try:
                reply = overlong.recv(100)
            except ConnectionResetError:  # closed with bytes of ours still unread
                reply = b""
            assert reply == b""  # dropped, unanswered
        assert standin.control("get_client_count") == "0"


def test_f_runs_in_the_foreground_until_sigterm(standin: Standin) -> None:
    daemon = subprocess.Popen(
        [sys.executable, "-m", MODULE, "-f"],
        env=standin.env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    standin.pids.append(daemon.pid)
    try:
        wait_until((standin.pipe / PID_FILE).exists, "the pid file")
        assert int((standin.pipe / PID_FILE).read_text()) == daemon.pid
        assert standin.control("get_default_active_thread_percentage") == "100.0"
        daemon.send_signal(signal.SIGTERM)
        _out, err = daemon.communicate(timeout=DEADLINE)
    finally:
        daemon.kill()
    assert daemon.returncode == 0, err
    assert "stopped" in err  # the log goes to stderr too: a Pod's `kubectl logs`
    assert list(standin.pipe.iterdir()) == []
    assert list(standin.shm.iterdir()) == []


def test_the_client_mode_sends_stdin_and_prints_replies(standin: Standin) -> None:
    commands = "get_default_active_thread_percentage\nset_default_active_thread_percentage 25\n"
    missing = standin.run(stdin=commands)
    assert missing.returncode == 1
    assert missing.stderr.strip() == "Cannot find MPS control daemon process"

    pid = standin.start()
    done = standin.run(stdin=commands + "\nget_default_active_thread_percentage\nquit\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["100.0", "OK", "25.0", "OK"]
    wait_until(lambda: not alive(pid), "the daemon to quit")


def test_control_raises_when_no_daemon_answers(standin: Standin) -> None:
    with pytest.raises(DaemonNotFound, match="Cannot find MPS control daemon process"):
        standin.control("get_server_list")


# -- control commands ---------------------------------------------------------------


def test_default_limits_apply_to_ordinal_0_only(standin: Standin) -> None:
    standin.start()
    assert standin.control("get_default_device_pinned_mem_limit 0") == "unlimited"
    # NVIDIA's device plugin (PR #572): the UUID form is accepted and not applied.
    assert standin.control(f"set_default_device_pinned_mem_limit {GPU} 10G") == "OK"
    assert standin.control("get_default_device_pinned_mem_limit 0") == "unlimited"
    assert standin.control("set_default_device_pinned_mem_limit 1 10G") == "OK"  # none here
    assert standin.control("get_default_device_pinned_mem_limit 0") == "unlimited"
    assert standin.control("set_default_device_pinned_mem_limit 0 20G") == "OK"
    assert standin.control("get_default_device_pinned_mem_limit 0") == "20480M"
    assert standin.control("set_default_device_pinned_mem_limit 0 512M") == "OK"
    assert standin.control("get_default_device_pinned_mem_limit 0") == "512M"

    assert standin.control("set_default_active_thread_percentage 25") == "OK"
    assert standin.control("get_default_active_thread_percentage") == "25.0"
    with standin.client() as client:
        assert (client.memory, client.threads) == ("512M", "25.0")


@pytest.mark.parametrize(
    "command",
    [
        "set_default_device_pinned_mem_limit 0 20480",  # no M or G
        "set_default_device_pinned_mem_limit 0 1T",
        "set_default_device_pinned_mem_limit zero 1G",
        "set_default_device_pinned_mem_limit 0",
        "set_default_active_thread_percentage 0",
        "set_default_active_thread_percentage 101",
        "set_default_active_thread_percentage lots",
        "set_device_pinned_mem_limit 1 0 1G",  # no server 1
        "set_active_thread_percentage 1 50",
        "start_server",
    ],
)
def test_bad_commands_get_an_error_and_change_nothing(standin: Standin, command: str) -> None:
    standin.start()
    assert standin.control(command).startswith("error: ")
    assert standin.control("get_default_device_pinned_mem_limit 0") == "unlimited"
    assert standin.control("get_default_active_thread_percentage") == "100.0"


def test_server_limits_apply_to_later_clients_while_the_server_runs(standin: Standin) -> None:
    pid = standin.start()
    standin.control("set_default_device_pinned_mem_limit 0 4G")
    assert standin.control("get_server_list") == ""
    assert standin.control(f"set_device_pinned_mem_limit {pid} 0 1G") == f"error: no server {pid}"

    first = standin.client()
    assert standin.control("get_server_list") == str(pid)
    assert standin.control(f"set_device_pinned_mem_limit {pid} 0 1G") == "OK"
    assert standin.control(f"set_active_thread_percentage {pid} 40") == "OK"
    assert (first.memory, first.threads) == ("4096M", "100.0")  # granted before
    with standin.client() as second:
        assert (second.memory, second.threads) == ("1024M", "40.0")
    first.close()

    # The server goes with its last client; the next one starts from the defaults.
    wait_until(lambda: standin.control("get_server_list") == "", "the server to go")
    with standin.client() as third:
        assert (third.memory, third.threads) == ("4096M", "100.0")


# -- clients ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pinned", "threads", "memory", "percentage"),
    [
        (None, None, "4096M", "50.0"),  # no env: the daemon's limits
        ("0=1G", "25", "1024M", "25.0"),  # lower: narrows
        ("0=8G", "75", "4096M", "50.0"),  # higher: never widens
        (f"1=1G,{GPU}=2048M", None, "2048M", "50.0"),  # by UUID; device 1 is not here
        ("1=1G", "50.5", "4096M", "50.0"),
    ],
)
def test_a_client_gets_the_daemon_limits_narrowed_by_its_env(
    standin: Standin, pinned: str | None, threads: str | None, memory: str, percentage: str
) -> None:
    standin.start()
    standin.control("set_default_device_pinned_mem_limit 0 4G")
    standin.control("set_default_active_thread_percentage 50")
    with standin.client(pinned, threads) as client:
        assert (client.memory, client.threads) == (memory, percentage)
        client.ping()
        assert standin.client_count() == 1
    wait_until(lambda: standin.client_count() == 0, "the client to leave")


def test_a_client_without_limits_anywhere_is_unlimited(standin: Standin) -> None:
    standin.start()
    with standin.client("0=2G") as narrowed, standin.client() as free:
        assert (narrowed.memory, narrowed.threads) == ("2048M", "100.0")
        assert (free.memory, free.threads) == ("unlimited", "100.0")


@pytest.mark.parametrize(
    ("pinned", "threads", "why"),
    [
        ("0=20480", None, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: bad memory limit"),
        ("0", None, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: bad entry"),
        (None, "0", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: bad active thread percentage"),
    ],
)
def test_a_malformed_client_env_is_refused(
    standin: Standin, pinned: str | None, threads: str | None, why: str
) -> None:
    standin.start()
    with pytest.raises(StandinRefused, match=why):
        standin.client(pinned, threads)
    assert standin.client_count() == 0


def test_a_client_without_the_daemons_shared_memory_is_refused(standin: Standin) -> None:
    pid = standin.start()
    elsewhere = standin.shm.parent / "other-shm"
    elsewhere.mkdir()
    with pytest.raises(StandinRefused, match="cannot open the shared memory segment"):
        connect_client(standin.pipe, elsewhere)
    # A segment of the same name that is not the daemon's: another /dev/shm.
    (elsewhere / f"mps.shm.{os.getuid()}.{pid}").write_text("0" * 32)
    with pytest.raises(StandinRefused, match="shared memory mismatch"):
        connect_client(standin.pipe, elsewhere)
    assert standin.client_count() == 0


def as_nobody(pipe: Path, shm: Path) -> str:
    """Connect a client in a forked child of uid 65534: ``connected`` or why not."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # never back into pytest from here
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with connect_client(pipe, shm) as client:
                result = f"connected memory={client.memory}"
        except StandinRefused as err:
            result = f"refused: {err}"
        except BaseException as err:
            result = f"failed: {err!r}"
        finally:
            os.write(write, result.encode())
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        result = answer.read().decode()
    os.waitpid(child, 0)
    return result


def test_without_multiuser_a_client_of_another_uid_is_refused(standin: Standin) -> None:
    assert os.geteuid() == 0, "the tests run as root, to be another uid"
    standin.start()
    root_client = standin.client()
    assert as_nobody(standin.pipe, standin.shm) == (
        f"refused: the MPS server runs for uid 0; clients of uid {NOBODY} wait until it "
        "exits (no -multiuser-server)"
    )
    root_client.close()
    wait_until(lambda: standin.client_count() == 0, "the root client to leave")
    assert as_nobody(standin.pipe, standin.shm) == "connected memory=unlimited"


def test_with_multiuser_clients_of_any_uid_connect(standin: Standin) -> None:
    standin.start("-multiuser-server")
    with standin.client():
        assert as_nobody(standin.pipe, standin.shm) == "connected memory=unlimited"


def test_at_most_48_clients(standin: Standin) -> None:
    standin.start()
    clients = [standin.client() for _ in range(CLIENT_LIMIT)]
    try:
        with pytest.raises(StandinRefused, match="client limit 48 reached"):
            standin.client()
        clients.pop().close()
        wait_until(lambda: standin.client_count() == CLIENT_LIMIT - 1, "a client to leave")
        clients.append(standin.client())
        assert standin.client_count() == CLIENT_LIMIT
    finally:
        for client in clients:
            client.close()


# -- the C client of the probe image ----------------------------------------------------


@pytest.fixture(scope="module")
def mps_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("mps-client") / "mps-client"
    flags = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror"]
    compile_c([compiler(), *flags, "-o", str(output), str(MPS_CLIENT_SOURCE)], error=AssertionError)
    return output


def run_c_client(
    mps_client: Path, standin: Standin, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(mps_client)],
        env={**standin.env(own_shm=False), **env},
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )


def test_the_c_client_connects_through_dev_shm(mps_client: Path, standin: Standin) -> None:
    missing = run_c_client(mps_client, standin)
    assert missing.returncode == 1
    assert missing.stdout == (
        f"MPS: error cannot connect to {standin.pipe / CONTROL_SOCKET}: No such file or directory\n"
    )

    pid = standin.start(own_shm=False)
    assert default_segment(pid).is_file()
    standin.control("set_default_device_pinned_mem_limit 0 4G")
    done = run_c_client(mps_client, standin)
    assert (done.returncode, done.stdout) == (0, "MPS: connected memory=4096M threads=100.0\n")
    narrowed = run_c_client(
        mps_client,
        standin,
        CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=1G",
        CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="30",
    )
    assert narrowed.stdout == "MPS: connected memory=1024M threads=30.0\n"
    bad = run_c_client(mps_client, standin, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=1")
    assert bad.returncode == 1
    assert bad.stdout.startswith("MPS: error CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: bad memory limit")

    standin.quit(pid)
    assert not default_segment(pid).exists()


def test_the_c_client_holds_its_connection(mps_client: Path, standin: Standin) -> None:
    pid = standin.start(own_shm=False)

    def hold() -> subprocess.Popen[str]:
        client = subprocess.Popen(
            [str(mps_client), "--hold"],
            env=standin.env(own_shm=False),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert client.stdout is not None
        assert client.stdout.readline() == "MPS: connected memory=unlimited threads=100.0\n"
        return client

    client = hold()
    try:
        assert standin.client_count() == 1
        client.send_signal(signal.SIGTERM)
        assert client.wait(timeout=DEADLINE) == 0
    finally:
        client.kill()
    wait_until(lambda: standin.client_count() == 0, "the C client to leave")

    client = hold()
    try:
        standin.quit(pid)
        out, _err = client.communicate(timeout=DEADLINE)
    finally:
        client.kill()
    assert (client.returncode, out) == (2, "MPS: lost connection\n")
    assert not default_segment(pid).exists()

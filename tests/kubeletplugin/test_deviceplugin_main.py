"""``drasil-kubelet-plugin --mode device-plugin`` as a process: starts, registers, stops."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kubelet_client import DEADLINE, wait_until
from test_deviceplugin_kubelet import FakeKubelet, allocate, node_flags, short_root

from drasil.kubeletplugin.node import signals_for_the_main_thread

# faulthandler: a process that hangs is sent SIGABRT and dumps every thread's stack.
MAIN = [sys.executable, "-X", "faulthandler", "-m", "drasil.kubeletplugin.main"]


def flags(root: Path, *extra: str, profile: str = "h100-80gb:2") -> list[str]:
    # No --kubeconfig and no API server: device-plugin mode must not need one.
    return node_flags(root, *extra, profile=profile)


class Daemon:
    """The plugin process; its log is read as it comes so a full pipe never blocks it."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [*MAIN, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def exit_code(self) -> int:
        """Wait for the process to end and for its last log line to be read."""
        try:
            code = self.proc.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            self.proc.wait(timeout=DEADLINE)
            self._reader.join(timeout=DEADLINE)
            raise AssertionError(f"the plugin did not exit; its log:\n{self.output}") from None
        self._reader.join(timeout=DEADLINE)
        return code


@contextmanager
def process(args: list[str]) -> Iterator[Daemon]:
    daemon = Daemon(args)
    try:
        yield daemon
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
        daemon.proc.wait(timeout=DEADLINE)


def test_the_process_registers_serves_and_stops_on_sigterm() -> None:
    with short_root() as root:
        kubelet = FakeKubelet(root / "dp").start()
        try:
            with process(flags(root, "--resource-name=example.com/gpu")) as daemon:
                request = kubelet.wait_for_registrations(1, "example.com/gpu")
                assert request.endpoint == "drasil-gpu.sock"
                with kubelet.dial("example.com/gpu") as stub:
                    response = allocate(stub, "gpu-0", "gpu-1")
                assert len(set(response.envs["NVIDIA_VISIBLE_DEVICES"].split(","))) == 2
                # "running" comes once the signal handlers are in place; before that,
                # SIGTERM would end the process the default way.
                wait_until(lambda: " running " in daemon.output, what="the running log line")
                assert "drasil-gpu.sock" in daemon.output
                daemon.proc.send_signal(signal.SIGTERM)
                assert daemon.exit_code() == 0, daemon.output
            assert not (root / "dp" / "drasil-gpu.sock").exists()
        finally:
            kubelet.stop()


def test_a_mig_strategy_the_node_cannot_serve_exits_1_naming_the_profiles() -> None:
    with short_root() as root:
        args = flags(root, "--mig-strategy=single", profile="a100-40gb-mig:1")
        with process(args) as daemon:
            code = daemon.exit_code()
    assert code == 1, daemon.output
    assert "found 1g.5gb, 2g.10gb, 3g.20gb" in daemon.output


def test_a_bad_replica_count_is_a_usage_error() -> None:
    with short_root() as root, process(flags(root, "--time-slicing-replicas=0")) as daemon:
        code = daemon.exit_code()
    assert code == 2, daemon.output
    assert "--time-slicing-replicas: 0 is less than 1" in daemon.output


def test_threads_started_by_the_plugin_leave_signals_to_the_main_thread() -> None:
    # pytest runs tests in the main thread, like the daemon's main().
    seen: list[set[signal.Signals]] = []

    def record() -> None:
        seen.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))

    with signals_for_the_main_thread():
        thread = threading.Thread(target=record)
        thread.start()
    thread.join()
    assert {signal.SIGTERM, signal.SIGINT} <= seen[0]
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])

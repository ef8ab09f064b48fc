"""Start and stop the harness's processes by pid, safely across CLI invocations.

A pid file holds `<pid> <start time>` (field 22 of /proc/<pid>/stat, clock ticks since
boot). A pid is only ever signalled when both still match, so a recycled pid that now
belongs to someone else's process is never touched. Processes a run started without a
pid file (containerd's shims) are found by their binary and the run dir in their
arguments (`stop_strays`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import subprocess
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; it ends at the last ")".
    return raw[raw.rindex(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    # fields[0] is field 3 (state), so field 22 (starttime) is fields[19].
    return int(fields[19]) if fields else None


def _reap(pid: int) -> None:
    """Collect the exit status if the process is our own child, so it is no zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


@dataclass(frozen=True)
class Proc:
    name: str
    pid: int
    start_time: int

    def alive(self) -> bool:
        _reap(self.pid)
        fields = _stat_fields(self.pid)
        if fields is None or int(fields[19]) != self.start_time:
            return False
        return fields[0] not in ("Z", "X")

    def signal(self, sig: signal.Signals) -> None:
        if not self.alive():
            return
        try:
            os.kill(self.pid, sig)
        except OSError as e:
            if e.errno != errno.ESRCH:
                raise


def write_pid_file(path: Path, proc: Proc) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(f"{proc.pid} {proc.start_time}\n")
    os.replace(tmp, path)


def read_pid_file(path: Path) -> Proc | None:
    try:
        pid, started = path.read_text().split()
        return Proc(path.stem, int(pid), int(started))
    except (OSError, ValueError):
        return None


def kill_on_parent_death() -> None:
    # Runs in the child between fork and exec: if the Python process that started the
    # cluster is killed (even with SIGKILL), the kernel kills the component too.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(
    name: str,
    argv: Sequence[str],
    *,
    log: Path,
    pid_file: Path,
    env: dict[str, str],
    die_with_parent: bool,
) -> Proc:
    """Start `argv` in its own session (a Ctrl-C in the terminal is ours to handle),
    stdout and stderr to `log`, and record its pid file."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(f"# {' '.join(argv)}\n".encode())
        out.flush()
        preexec: Callable[[], None] | None = kill_on_parent_death if die_with_parent else None
        child = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=preexec,  # noqa: PLW1509 - only prctl, no locks or allocations
        )
    started = start_time(child.pid)
    if started is None:  # exited before we could look: record it as dead
        started = -1
    proc = Proc(name, child.pid, started)
    write_pid_file(pid_file, proc)
    return proc


def stop(proc: Proc, *, grace: float) -> bool:
    """SIGTERM, wait up to `grace` seconds, then SIGKILL; True when it is gone."""
    if not proc.alive():
        return True
    proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not proc.alive():
            return True
        time.sleep(0.05)
    proc.signal(signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if not proc.alive():
            return True
        time.sleep(0.05)
    return not proc.alive()


def end_child(child: subprocess.Popen[bytes], *, grace: float = 10.0) -> None:
    """SIGTERM a child this process started; SIGKILL it if it outlives ``grace`` s."""
    if child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(timeout=grace)


def tail(path: Path, n: int = 30) -> str:
    """The last `n` lines of a log, or why it cannot be read."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return "\n".join(lines[-n:])


def wait_until(
    what: str,
    check: Callable[[], tuple[bool, str]],
    timeout: float,
    *,
    watching: Iterable[Proc],
    log: Callable[[str], Path],
    error: Callable[[str], Exception],
    interval: float,
) -> None:
    """Call `check` (ok, detail) until ok. Raises `error(message)` when one of
    `watching` exits first (with the tail of its `log(name)`) or after `timeout`."""
    deadline = time.monotonic() + timeout
    watched = list(watching)
    while True:
        for proc in watched:
            if not proc.alive():
                raise error(
                    f"{proc.name} exited while waiting for {what}; "
                    f"last lines of {log(proc.name)}:\n{tail(log(proc.name))}"
                )
        ok, last = check()
        if ok:
            return
        if time.monotonic() > deadline:
            raise error(f"timed out after {timeout:.0f}s waiting for {what}: {last}")
        time.sleep(interval)


def strays(bin_dir: Path, run_dir: Path, names: Collection[str] | None = None) -> list[int]:
    """Pids running one of our binaries with our run dir in their arguments: a process
    of this run that has no pid file (`down` must not leave it behind)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            exe = os.readlink(entry / "exe")
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if not exe.startswith(f"{bin_dir}/") or str(run_dir) not in cmdline:
            continue
        if names is None or Path(exe.removesuffix(" (deleted)")).name in names:
            found.append(int(entry.name))
    return found


def stop_strays(
    bin_dir: Path, run_dir: Path, *, grace: float, names: Collection[str] | None = None
) -> list[str]:
    """Stop what `strays` finds (only binaries called `names`, if given); returns
    those still running."""
    leftovers = []
    for pid in strays(bin_dir, run_dir, names):
        start = start_time(pid)
        if start is not None and not stop(Proc(f"pid {pid}", pid, start), grace=grace):
            leftovers.append(f"pid {pid}")
    return leftovers

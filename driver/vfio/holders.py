"""Which processes hold a GPU: those with one of its device nodes open.

Every process that uses a GPU (a CUDA context, ``nvidia-smi``, the persistence
daemon, an MPS server; ROCm's through its DRM nodes) has the GPU's node open, so the
open files under ``/proc/<pid>/fd`` name them all. The node daemon needs the host's
PID namespace (the chart's ``hostPID`` with passthrough on) to see them.

The walk is bounded (``MAX_PROCESSES``, ``SCAN_SECONDS``): on a node with more, the
answer is "could not tell", which refuses the passthrough as if busy, and kubelet
retries; it never runs past kubelet's 45 s call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

MAX_PROCESSES: Final = 65536
MAX_FDS: Final = 1 << 20  # open files looked at in all
SCAN_SECONDS: Final = 5.0


@dataclass(frozen=True)
class Holder:
    pid: int
    command: str
    node: str

    def text(self) -> str:
        return f"pid {self.pid} ({self.command}) has {self.node} open"


@dataclass(frozen=True)
class Holders:
    found: tuple[Holder, ...]
    # Why the walk stopped before it looked at every process ("" : it did not).
    incomplete: str = ""


def holders(proc_root: Path, nodes: Sequence[str], *, budget: float = SCAN_SECONDS) -> Holders:
    """The processes under ``proc_root`` with one of ``nodes`` (host paths) open."""
    wanted = frozenset(nodes)
    if not wanted:
        return Holders(())
    deadline = time.monotonic() + budget
    found: list[Holder] = []
    fds = 0
    try:
        entries = [e.name for e in os.scandir(proc_root) if e.name.isdigit()]
    except OSError as err:
        return Holders((), incomplete=f"{proc_root} cannot be read: {err.strerror}")
    if len(entries) > MAX_PROCESSES:
        return Holders((), incomplete=f"{len(entries)} processes, over {MAX_PROCESSES}")
    for pid in entries:
        if time.monotonic() > deadline:
            return Holders(tuple(found), incomplete=f"looking took over {budget:g} s")
        opened, count = _opened(proc_root / pid, wanted)
        fds += count
        if fds > MAX_FDS:
            return Holders(tuple(found), incomplete=f"over {MAX_FDS} open files")
        found += [Holder(int(pid), _command(proc_root / pid), node) for node in opened]
    return Holders(tuple(found))


def _opened(process: Path, wanted: frozenset[str]) -> tuple[list[str], int]:
    """The ``wanted`` nodes one process has open, and how many files it has open."""
    try:
        fds = os.listdir(process / "fd")
    except OSError:  # gone, or a kernel thread: it holds nothing we can see
        return [], 0
    opened: list[str] = []
    for fd in fds:
        try:
            target = os.readlink(process / "fd" / fd)
        except OSError:
            continue
        if target in wanted and target not in opened:
            opened.append(target)
    return opened, len(fds)


def _command(process: Path) -> str:
    try:
        with (process / "comm").open("rb") as f:
            return f.read(64).decode("utf-8", "replace").strip() or "?"
    except OSError:
        return "?"

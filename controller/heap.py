"""An opt-in look at the controller's Python heap: ``DRASIL_TRACEMALLOC=<path>``.

With the variable set, the controller starts ``tracemalloc`` once it has its API
client and writes a report to ``<path>`` on each ``SIGUSR1`` (replacing the file
whole, so a reader never sees half of one): the process's RSS next to what Python
objects hold (tracemalloc's total), the top allocation sites by line and by
traceback, the live objects by type as the garbage collector counts them, and the
items waiting in asyncio queues (kopf's per-object event backlogs). RSS well above
the traced total is memory Python does not account for: freed but not returned to
the system (fragmentation), or C libraries. ``python -m bench.scale --tracemalloc
DIR`` collects the reports of each fleet size (docs/scale.md).

``DRASIL_TRACEMALLOC_FRAMES`` is the traceback depth (default 1: sites by line). Each
frame costs: at 12 an event takes several times its CPU and the controller falls
behind its watches, which changes what it holds; 0 turns tracemalloc off and keeps
RSS, objects by type and queued items. Figures taken with tracing are for finding
retainers, not for tables.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import re
import signal
import sys
import tempfile
import tracemalloc
from collections import Counter
from pathlib import Path
from types import FrameType

log = logging.getLogger(__name__)

ENV = "DRASIL_TRACEMALLOC"
FRAMES_ENV = "DRASIL_TRACEMALLOC_FRAMES"
TOP_LINES = 40
TOP_TRACEBACKS = 15
TOP_TYPES = 30


def rss_kib() -> int:
    """This process's resident set (KiB), 0 where /proc is not there."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def object_counts() -> Counter[str]:
    """Live objects the garbage collector tracks, by type name (containers and
    instances; str, int and float are not tracked and do not appear)."""
    return Counter(type(o).__name__ for o in gc.get_objects())


def queued_items() -> tuple[int, int]:
    """(asyncio queues, items waiting in them): kopf queues each object's raw events
    until its worker gets to them, so a controller behind its watches shows here."""
    queues = [o for o in gc.get_objects() if isinstance(o, asyncio.Queue)]
    return len(queues), sum(q.qsize() for q in queues)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def malloc_lines() -> list[str]:
    """What C's allocator holds, apart from Python's own arenas: glibc's ``mallinfo2``
    (in use, and free but kept: the allocator's fragmentation), and pymalloc's arenas
    (1 MiB each; one live object keeps its arena). Empty where either is missing."""
    lines = []
    mallinfo2 = getattr(LIBC, "mallinfo2", None)  # glibc 2.33 and later
    if mallinfo2 is not None:
        mallinfo2.restype = _MallInfo2
        info = mallinfo2()
        mib = 1024 * 1024
        lines.append(
            f"malloc_in_use_mib {info.uordblks / mib:.1f} free_kept_mib {info.fordblks / mib:.1f}"
            f" mmapped_mib {info.hblkhd / mib:.1f}"
        )
    stats = _pymalloc_stats()
    arenas = re.search(r"# arenas allocated current\s*=\s*([\d,]+)", stats)
    used = re.search(r"# bytes in allocated blocks\s*=\s*([\d,]+)", stats)
    if arenas and used:
        count, in_use = (int(m.group(1).replace(",", "")) for m in (arenas, used))
        lines.append(f"pymalloc_arenas {count} pymalloc_in_use_mib {in_use / 1024 / 1024:.1f}")
    return lines


def _pymalloc_stats() -> str:
    """``sys._debugmallocstats()``, which writes to C's stderr: fd 2 is pointed at a
    file for the moment it takes (a log line of another thread then lands there)."""
    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        return out.read().decode(errors="replace")


def report(limit_lines: int = TOP_LINES, limit_tracebacks: int = TOP_TRACEBACKS) -> str:
    """The heap report: RSS, objects by type, queued items, and what tracemalloc
    traced if it is tracing."""
    gc.collect()  # what is left is retained, not merely not yet collected
    queues, items = queued_items()
    lines = [f"rss_mib {rss_kib() / 1024:.1f}", *malloc_lines()]
    lines.append(f"asyncio_queues {queues} items {items}")
    lines += ["", f"## top {TOP_TYPES} live objects by type (gc)"]
    lines += [f"{count:10d}  {name}" for name, count in object_counts().most_common(TOP_TYPES)]
    if tracemalloc.is_tracing():
        lines += ["", *_traced(limit_lines, limit_tracebacks)]
    return "\n".join(lines) + "\n"


def _traced(limit_lines: int, limit_tracebacks: int) -> list[str]:
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    current, peak = tracemalloc.get_traced_memory()
    mib = 1024 * 1024
    lines = [
        f"traced_mib {current / mib:.1f} (peak {peak / mib:.1f})",
        f"tracemalloc_overhead_mib {tracemalloc.get_tracemalloc_memory() / mib:.1f}",
        "",
        f"## top {limit_lines} by line",
    ]
    for stat in snapshot.statistics("lineno")[:limit_lines]:
        frame = stat.traceback[0]
        lines.append(
            f"{stat.size / 1024:10.1f} KiB {stat.count:8d}  {frame.filename}:{frame.lineno}"
        )
    if tracemalloc.get_traceback_limit() > 1:
        lines += ["", f"## top {limit_tracebacks} by traceback"]
        for stat in snapshot.statistics("traceback")[:limit_tracebacks]:
            lines.append(f"{stat.size / 1024:10.1f} KiB {stat.count:8d}")
            lines += [f"    {entry}" for entry in stat.traceback.format(most_recent_first=True)]
    return lines


def write_report(path: Path) -> None:
    """``report()`` into ``path``, replaced whole."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(report())
    partial.replace(path)


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


LIBC = _libc()


def release_free_memory() -> bool:
    """Hand the pages glibc's malloc keeps free back to the system (``malloc_trim(0)``);
    whether it could. malloc returns memory on its own only from the top of its heap:
    the whole Pod or claim each watch event carries is freed once it is reduced, but
    the pages stay the process's as long as one live block sits above them. A
    fraction of a millisecond when little is free; no-op off glibc."""
    trim = getattr(LIBC, "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# Two arenas: the event loop's (where kopf parses every watch event) and one that the
# worker threads share. glibc's default is 8 per core, and each arena keeps its own
# free pages and fragments: a thread that parsed a claim leaves them in an arena no
# other thread reuses.
ARENA_MAX = 2
# Blocks of this size and more are mmap'd and unmapped again on free. glibc raises its
# threshold on its own after the first such block is freed (up to 32 MiB), and from
# then on a large response body or list lands in the heap, where one small block
# allocated after it pins its pages: fixed, they never do.
MMAP_THRESHOLD = 256 * 1024
# Free memory at the top of the heap past this is given back at once, not only by the
# periodic malloc_trim (release_free_memory). Fixing it also stops glibc from raising
# it along with the mmap threshold.
TRIM_THRESHOLD = 1024 * 1024


def tune_malloc() -> bool:
    """Make glibc's malloc keep less free memory (the settings above); whether it
    could (False off glibc). Called once at the controller's start, before its worker
    threads exist: an arena is made for a thread on its first allocation."""
    mallopt = getattr(LIBC, "mallopt", None)
    if mallopt is None:
        return False
    settings = (
        (M_ARENA_MAX, ARENA_MAX),
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
    )
    # mallopt returns 1 on success, 0 for a value it refuses.
    return all(mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1 for param, value in settings)


def start_from_env() -> Path | None:
    """Trace and report on SIGUSR1 if ``DRASIL_TRACEMALLOC`` names a path; the path.
    Raises ValueError for a ``DRASIL_TRACEMALLOC_FRAMES`` that is no integer."""
    value = os.environ.get(ENV, "")
    if not value:
        return None
    path = Path(value)
    text = os.environ.get(FRAMES_ENV) or "1"
    if not text.isdigit():
        raise ValueError(f"{FRAMES_ENV}={text!r}: a traceback depth, 0 (no tracing) or more")
    frames = int(text)
    if frames > 0:
        tracemalloc.start(frames)

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        # Runs on the main thread between bytecodes, which here is the event loop: the
        # loop stands still for the second or so a report takes, as it should.
        try:
            write_report(path)
        except OSError as err:
            log.error("cannot write the heap report: %s", err)
        else:
            log.info("wrote the heap report", extra={"path": str(path)})

    signal.signal(signal.SIGUSR1, on_signal)
    return path

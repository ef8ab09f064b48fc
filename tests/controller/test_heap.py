"""The opt-in heap report (DRASIL_TRACEMALLOC)."""

from __future__ import annotations

import asyncio
import os
import signal
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from drasil.controller import heap


@pytest.fixture
def restored() -> Iterator[None]:
    handler = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, handler)
    tracemalloc.stop()


def test_off_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(heap.ENV, raising=False)

    assert heap.start_from_env() is None
    assert not tracemalloc.is_tracing()


def test_sigusr1_writes_the_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, restored: None
) -> None:
    path = tmp_path / "heap.txt"
    monkeypatch.setenv(heap.ENV, str(path))
    monkeypatch.setenv(heap.FRAMES_ENV, "3")

    assert heap.start_from_env() == path
    kept = [{"n": i} for i in range(1000)]
    os.kill(os.getpid(), signal.SIGUSR1)

    text = path.read_text()
    assert kept
    assert text.startswith("rss_mib ")
    assert "traced_mib " in text
    assert "## top 40 by line" in text
    assert "## top 15 by traceback" in text
    assert "test_heap.py" in text  # the list above is a retainer
    assert "dict" in text  # objects by type
    assert not (tmp_path / "heap.txt.partial").exists()


def test_frames_zero_reports_without_tracing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, restored: None
) -> None:
    path = tmp_path / "heap.txt"
    monkeypatch.setenv(heap.ENV, str(path))
    monkeypatch.setenv(heap.FRAMES_ENV, "0")

    heap.start_from_env()
    os.kill(os.getpid(), signal.SIGUSR1)

    assert not tracemalloc.is_tracing()
    text = path.read_text()
    assert "asyncio_queues " in text
    assert "traced_mib" not in text


def test_queued_items_counts_what_waits_in_asyncio_queues() -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    before = heap.queued_items()
    for i in range(3):
        queue.put_nowait(i)

    queues, items = heap.queued_items()

    assert queues == before[0]
    assert items == before[1] + 3


def test_malloc_holdings_and_trim_on_glibc() -> None:
    lines = heap.malloc_lines()

    if heap.LIBC is None or not hasattr(heap.LIBC, "mallinfo2"):
        pytest.skip("not glibc 2.33+")
    assert lines[0].startswith("malloc_in_use_mib ")
    assert lines[1].startswith("pymalloc_arenas ")
    assert heap.release_free_memory() is True


def test_a_depth_that_is_no_number_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(heap.ENV, str(tmp_path / "heap.txt"))
    monkeypatch.setenv(heap.FRAMES_ENV, "deep")
    with pytest.raises(ValueError, match="DRASIL_TRACEMALLOC_FRAMES='deep'"):
        heap.start_from_env()


def test_malloc_is_tuned_on_glibc() -> None:
    # The test machines run glibc; the settings are glibc's (mallopt accepts them).
    assert heap.LIBC is not None
    assert heap.tune_malloc()

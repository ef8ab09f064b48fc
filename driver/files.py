"""Crash-safe files: atomic replacement, durable removal, a cross-process lock, and
reading only regular files (``open_regular``: never a FIFO, directory or symlink).

Every on-disk write that must survive a crash goes through ``write_atomic``
(docs/design.md#decisions): a reader sees the old content or the new content, never a torn file.

Crash points (fault injection for the crash tests and the e2e kill tests). Start a
process with ``DRASIL_CRASH_AT=<point>`` and it exits with status 137 (what SIGKILL
gives) when it reaches that point. The variable is read once, at import, so setting it
later has no effect and an unset variable costs one comparison per point. ``<tag>`` is
the ``crash_tag`` a caller passes: ``cdi`` for CDI specs, ``checkpoint`` for the
checkpoint; callers may add their own points with ``crash_point``.

=========================  ==============================================================
point                      state left behind
=========================  ==============================================================
``<tag>-mid-write``        temp file holds the first half of the data (then zeros); target
                           untouched
``<tag>-before-rename``    temp file complete (fsynced if durable); target untouched
``<tag>-after-rename``     target replaced; the directory entry not yet fsynced
``<tag>-before-remove``    ``remove_file`` about to unlink; target untouched
=========================  ==============================================================
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import stat
import time
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Final

CRASH_ENV: Final = "DRASIL_CRASH_AT"
CRASH_EXIT_CODE: Final = 137
TEMP_SUFFIX: Final = ".tmp"

_CRASH_AT: Final = os.environ.get(CRASH_ENV) or None

log = logging.getLogger(__name__)


def crash_point(name: str) -> None:
    """Exit at once, as if killed, when ``DRASIL_CRASH_AT`` names this point."""
    if _CRASH_AT is not None and name == _CRASH_AT:
        # os._exit skips finally blocks, atexit and buffered writes: the closest a
        # process can come to SIGKILL-ing itself at a precise line.
        os._exit(CRASH_EXIT_CODE)


def temp_path_for(path: Path) -> Path:
    """A fresh temp name beside ``path``: ``<name>.<random>.tmp``.

    CDI runtimes read only ``*.json``/``*.yaml``, so the temp name must end in neither;
    the random part keeps concurrent writers of one target apart.
    """
    return path.with_name(f"{path.name}.{secrets.token_hex(6)}{TEMP_SUFFIX}")


def write_atomic(
    path: Path, data: bytes, *, mode: int = 0o644, crash_tag: str = "file", durable: bool = True
) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old or the new file.

    Temp file in the same directory (rename is atomic only within one file system),
    write, fsync, rename over the target, fsync the directory so the rename itself
    survives power loss. ``mode`` is applied exactly, whatever the umask.

    ``durable=False`` skips both fsyncs: the rename still makes the write atomic for
    every reader and across a process crash (the page cache outlives the process);
    only a kernel crash or power loss can lose it. Use it for state that a reboot
    invalidates anyway (each fsync costs milliseconds on the prepare path).
    """
    temp = temp_path_for(path)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)
            if os.path.lexists(path):
                _allocate(fd, len(data))
            _write_all(fd, data, crash_tag=crash_tag)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        crash_point(f"{crash_tag}-before-rename")
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    crash_point(f"{crash_tag}-after-rename")
    if durable:
        fsync_directory(path.parent)


def _allocate(fd: int, size: int) -> None:
    """Reserve the temp file's blocks before writing it, when it replaces a file.

    ext4 (auto_da_alloc) makes a rename over an existing file allocate and start
    writing back the new file's delayed-allocation blocks inside ``rename``, which on
    the prepare path costs more than the write. Blocks allocated up front are not
    delayed, so the rename stays a directory update. A new file is better left to
    delayed allocation: most of the plugin's new files (a PrepareStarted record, a
    claim's spec and metadata) are replaced or deleted again before write-back, and
    deleting a file that never got blocks is about ten times cheaper than one that did
    (12 against 120 µs, measured on ext4). Where fallocate is not supported the write
    simply goes on without it.
    """
    if size:
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, size)


def _write_all(fd: int, data: bytes, *, crash_tag: str) -> None:
    view = memoryview(data)
    half = len(view) // 2
    _write_view(fd, view[:half])
    crash_point(f"{crash_tag}-mid-write")
    _write_view(fd, view[half:])


def _write_view(fd: int, view: memoryview) -> None:
    # os.write may write less than asked (signals, pipes); loop until all is out.
    while view:
        written = os.write(fd, view)
        view = view[written:]


def remove_file(path: Path, *, crash_tag: str = "file", durable: bool = True) -> bool:
    """Remove ``path`` (and fsync its directory if ``durable``); a missing file is fine.

    Returns whether a file was removed.
    """
    crash_point(f"{crash_tag}-before-remove")
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    if durable:
        fsync_directory(path.parent)
    return True


def fsync_directory(directory: Path) -> None:
    """Make renames and unlinks in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_KINDS: Final = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a symlink",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


class NotRegularFile(OSError):
    """An entry that must be a regular file is something else (``kind``).

    An ``OSError``, so that a reader that already treats an unreadable file as missing
    or damaged does the same here. ``str()`` names only the kind (the caller names the
    path, as it does for its other errors); ``path`` is the entry.
    """

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(f"not a regular file ({kind})")
        self.path = path
        self.kind = kind


def _check_regular(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise NotRegularFile(path, _KINDS.get(stat.S_IFMT(mode), "not a file"))


def open_regular(path: Path, flags: int, mode: int = 0o600) -> int:
    """Open the regular file at ``path`` (``os.open`` flags); anything else is
    ``NotRegularFile``, nothing at all ``FileNotFoundError`` (without ``O_CREAT``).

    Whoever can write the plugin's state dir or CDI dir can leave a directory, FIFO,
    socket, device node or symlink under a file's name. Opening one must neither stop
    the plugin at every start (``EISDIR``) nor hang it (a FIFO blocks ``open`` until a
    writer comes), nor follow a symlink out of the directory. ``lstat`` refuses them
    without opening them (opening a device node can have side effects);
    ``O_NOFOLLOW | O_NONBLOCK`` and ``fstat`` cover an entry swapped in between: a
    symlink fails the open (``ELOOP``), a FIFO opens at once and fails the check.
    ``O_NONBLOCK`` changes nothing for a regular file. Only the last component is
    checked: the directories above are the caller's.
    """
    with contextlib.suppress(FileNotFoundError):  # os.open says so, or O_CREAT makes it
        _check_regular(path, os.lstat(path).st_mode)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # symlink, socket, dir
            raise NotRegularFile(path, str(err.strerror)) from err
        raise
    try:
        _check_regular(path, os.fstat(fd).st_mode)
    except NotRegularFile:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path) -> bytes:
    """The content of the regular file at ``path`` (see ``open_regular``)."""
    with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as file:
        return file.read()


def move_aside(path: Path, *, now: datetime | None = None) -> Path:
    """Rename ``path`` (any kind of entry) to ``<name>.corrupt-<UTC time>``, or
    ``<name>.corrupt-<time>.<n>`` when that is taken, and make the rename durable.

    The name the checkpoint gives a quarantined file: kept for a person to look at,
    never read again. A plain rename would replace an earlier one of the same name, and
    fails for a directory, which would stay in place and stop every load.
    """
    stamp = (now or datetime.now(UTC)).astimezone(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    taken = 0
    while os.path.lexists(target):
        taken += 1
        target = path.with_name(f"{path.name}.corrupt-{stamp}.{taken}")
    path.rename(target)
    fsync_directory(path.parent)
    return target


def sweep_temp_files(
    directory: Path, *, prefix: str, older_than: float | None = None
) -> list[Path]:
    """Remove temp files a crashed ``write_atomic`` left for targets named ``prefix*``.

    Only safe while no other process writes those targets (hold the ``FileLock``),
    because a live writer's temp file looks the same as a dead one's; or pass
    ``older_than`` (seconds): a live write takes milliseconds.

    A directory under a temp name is no write of ours (removing it would take a
    recursive delete of whatever is inside): it is left, with a warning, and blocks
    nothing, since ``write_atomic`` never reuses a temp name. Any other entry is
    unlinked: that removes the name only, never opens a FIFO or device node, never
    touches a symlink's target.
    """
    cutoff = time.time() - older_than if older_than is not None else None
    removed = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        named = entry.name.startswith(prefix) and entry.name.endswith(TEMP_SUFFIX)
        if named and _sweepable(entry, cutoff):
            Path(entry.path).unlink(missing_ok=True)
            removed.append(Path(entry.path))
    if removed:
        fsync_directory(directory)
    return sorted(removed)


def _sweepable(entry: os.DirEntry[str], cutoff: float | None) -> bool:
    try:
        if entry.is_dir(follow_symlinks=False):
            log.warning("left a directory named like a temp file", extra={"path": entry.path})
            return False
        return cutoff is None or entry.stat(follow_symlinks=False).st_mtime <= cutoff
    except FileNotFoundError:  # removed since the listing (its writer renamed it)
        return False


class LockTimeoutError(TimeoutError):
    """The lock stayed held by another process for longer than the timeout."""


class LockFileError(OSError):
    """The lock file's name holds something no lock can be taken on."""


def _move_aside_non_regular(path: Path) -> Path | None:
    """Move the entry at ``path`` aside (``move_aside``) if it is not a regular file.

    A lock file is never moved while someone may hold it. No ``FileLock`` locks
    anything but a regular file (``open_regular``), so a directory, FIFO, socket or
    symlink at the name is held by none (only a drasil from before this check, which
    opened a FIFO or followed a symlink, could hold one); a regular file is never
    moved. Two instances starting together may both find the entry: a lock on the
    directory makes them check and move in turn, so the second cannot move the lock
    file the first has just created and locked. Returns where the entry went (``None``:
    already gone, or a regular file by now).
    """
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                return None
        except FileNotFoundError:
            return None
        return move_aside(path)
    except OSError as err:
        raise LockFileError(
            f"{path}: not a regular file and it could not be moved aside ({err}); "
            "remove it (the lock file is created again)"
        ) from err
    finally:
        os.close(fd)  # and the directory lock with it


class FileLock:
    """An exclusive ``flock`` on a lock file (shared with ``shared``), held across processes.

    Serializes prepare/unprepare between plugin instances during a rolling update
    (docs/design.md#two-instances-on-one-node). The lock belongs to the open file, so a crashed
    holder releases it automatically. Not reentrant: one instance is one acquisition.
    The lock file is never deleted, because deleting it lets two processes lock two
    different inodes of the same name. Only a regular file is locked: anything else
    at the name (a directory, FIFO, socket, symlink) is moved aside to
    ``<name>.corrupt-<time>`` and the lock file created again; ``LockFileError`` when
    that fails.
    """

    _POLL_START: Final = 0.001
    _POLL_MAX: Final = 0.05

    def __init__(
        self,
        path: Path,
        *,
        timeout: float | None = None,
        keep_open: bool = False,
        shared: bool = False,
    ) -> None:
        self.path = path
        self.timeout = timeout
        self.keep_open = keep_open
        # Shared holders exclude an exclusive one, not each other (a node-wide lock that
        # per-GPU work takes shared, and an older release took exclusive).
        self._mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        self._fd: int | None = None
        self._kept: int | None = None  # keep_open: the lock file, open between holds

    @property
    def locked(self) -> bool:
        """Whether this instance holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, waiting at most ``timeout`` seconds (forever when ``None``).

        ``keep_open`` keeps the file open between holds (a lock taken several times a
        call saves its open and close); a lock file that lost its name meanwhile is
        opened again, so that every holder always locks the file the name points to.
        """
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already locked by this FileLock")
        while True:
            fd = self._kept if self._kept is not None else self._open()
            self._kept = None
            try:
                self._wait_for_lock(fd)
            except BaseException:
                os.close(fd)
                raise
            if os.fstat(fd).st_nlink > 0:
                break
            os.close(fd)  # deleted while we waited: lock the file the name is now
        self._fd = fd

    def _open(self) -> int:
        try:
            return open_regular(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except NotRegularFile as err:
            moved = _move_aside_non_regular(self.path)
            if moved is not None:
                log.warning(
                    "moved aside a lock file that was not a regular file",
                    extra={"path": str(self.path), "kind": err.kind, "movedTo": str(moved)},
                )
        try:
            return open_regular(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except NotRegularFile as err:  # put back at once: someone keeps doing it
            raise LockFileError(
                f"{self.path}: not a regular file ({err.kind}) even after it was moved "
                "aside; remove it (the lock file is created again)"
            ) from err

    def _wait_for_lock(self, fd: int) -> None:
        if self.timeout is None:
            fcntl.flock(fd, self._mode)
            return
        # flock has no timeout of its own; poll with a growing pause.
        deadline = time.monotonic() + self.timeout
        pause = self._POLL_START
        while True:
            try:
                fcntl.flock(fd, self._mode | fcntl.LOCK_NB)
                return
            except OSError as err:
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LockTimeoutError(f"{self.path} still locked after {self.timeout}s")
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, self._POLL_MAX)

    def release(self) -> None:
        """Drop the lock: close the file, or unlock it and keep it (``keep_open``)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if self.keep_open:
            fcntl.flock(fd, fcntl.LOCK_UN)
            self._kept = fd
        else:
            os.close(fd)

    def __del__(self) -> None:
        for fd in (self._fd, self._kept):
            if fd is not None:
                os.close(fd)

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

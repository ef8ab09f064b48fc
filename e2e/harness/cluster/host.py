"""What a run changes on this machine outside its run directory, and how it finds it
again: mounts, cgroups, a Linux bridge, loopback ports and unix sockets.

Everything is read from /proc and /sys (and changed with `ip`, mount(2) and the cgroup
filesystems), so `down` from another process finds what `up` made.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import ipaddress
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

MNT_DETACH = 2


# ---- loopback ports -----------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports: all sockets stay bound until every port is picked."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return ports


# ---- mounts -------------------------------------------------------------------------


def _unescape(path: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, char)
    return path


def mounts_under(root: Path) -> list[Path]:
    """Mount points at or below `root`, deepest (latest) first."""
    prefix = str(root).rstrip("/") + "/"
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = _unescape(line.split()[4])
        if point == str(root) or point.startswith(prefix):
            found.append(Path(point))
    return list(reversed(found))


def unmount_all(root: Path) -> list[str]:
    """Unmount everything under `root` (lazily when busy); returns what failed."""
    libc = ctypes.CDLL(None, use_errno=True)
    failed: list[str] = []
    for _ in range(5):  # stacked mounts need more than one pass
        points = mounts_under(root)
        if not points:
            return []
        failed = []
        for point in points:
            path = str(point).encode()
            if libc.umount2(path, 0) != 0 and libc.umount2(path, MNT_DETACH) != 0:
                failed.append(f"{point}: {os.strerror(ctypes.get_errno())}")
    return failed or [str(p) for p in mounts_under(root)]


# ---- cgroups ------------------------------------------------------------------------


def cgroup_mounts() -> list[Path]:
    """Mount points of every cgroup (v1) and cgroup2 hierarchy."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fstype = post.split()[0] if post else ""
        if fstype in ("cgroup", "cgroup2"):
            found.append(Path(_unescape(pre.split()[4])))
    return found


def make_cgroups(name: str) -> None:
    """A cgroup `name` in every hierarchy, with the CPUs and memory nodes of its parent."""
    for mount in cgroup_mounts():
        target = mount / name
        target.mkdir(exist_ok=True)
        # A new cpuset cgroup starts with no CPUs and no memory nodes.
        for file in ("cpuset.cpus", "cpuset.mems"):
            mine, parent = target / file, mount / file
            if mine.exists() and not mine.read_text().strip():
                mine.write_text(parent.read_text())


def _cgroup_dirs(name: str) -> list[Path]:
    return [m / name for m in cgroup_mounts() if (m / name).is_dir()]


def cgroup_pids(name: str) -> set[int]:
    """Every process in cgroup `name` or below it, in any hierarchy."""
    pids: set[int] = set()
    for top in _cgroup_dirs(name):
        for dirpath, _, files in os.walk(top):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError):
                    text = (Path(dirpath) / "cgroup.procs").read_text()
                    pids.update(int(p) for p in text.split())
    return pids


def kill_cgroup(name: str, timeout: float = 15.0) -> list[int]:
    """SIGKILL every process in cgroup `name` until none is left; returns those that
    would not die."""
    deadline = time.monotonic() + timeout
    while True:
        pids = cgroup_pids(name)
        if not pids:
            return []
        if time.monotonic() > deadline:
            return sorted(pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def remove_cgroups(name: str) -> list[str]:
    """Remove cgroup `name` and those below it; returns what could not be removed."""
    failed = []
    for top in _cgroup_dirs(name):
        for dirpath, _, _ in sorted(os.walk(top), key=lambda t: -len(t[0])):
            try:
                os.rmdir(dirpath)
            except OSError as e:
                failed.append(f"{dirpath}: {e.strerror}")
    return failed


# ---- the bridge and its subnet -------------------------------------------------------


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets: list[ipaddress.IPv4Network] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/route").read_text().splitlines()[1:]:
            fields = line.split()
            dest, mask = int(fields[1], 16), int(fields[7], 16)
            if mask == 0:
                continue
            addr = ipaddress.IPv4Address(dest.to_bytes(4, "little"))
            prefix = bin(mask).count("1")
            nets.append(ipaddress.IPv4Network(f"{addr}/{prefix}", strict=False))
    return nets


def free_subnet(base: ipaddress.IPv4Network, *, seed: str) -> str | None:
    """A /24 of `base` that no route of this machine overlaps (other runs' bridges
    included), starting from one derived from `seed`; None when all are taken."""
    used = _used_networks()
    subnets = list(base.subnets(new_prefix=24))
    start = int(hashlib.sha256(seed.encode()).hexdigest(), 16) % len(subnets)
    for i in range(len(subnets)):
        candidate = subnets[(start + i) % len(subnets)]
        if not any(candidate.overlaps(n) for n in used):
            return str(candidate)
    return None


def make_bridge(name: str, address: str) -> str | None:
    """Linux bridge `name` with `address` (CIDR notation), up; None, or the error of
    the `ip` command that failed."""
    steps = [
        ["ip", "link", "add", "name", name, "type", "bridge"],
        ["ip", "addr", "add", address, "dev", name],
        ["ip", "link", "set", name, "up"],
    ]
    if Path(f"/sys/class/net/{name}").exists():
        steps = steps[2:]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            return f"`{' '.join(cmd)}` failed: {done.stderr.strip()}"
    return None


def delete_bridge(name: str) -> None:
    if Path(f"/sys/class/net/{name}").exists():
        subprocess.run(["ip", "link", "delete", name], capture_output=True, check=False)


# ---- unix sockets -------------------------------------------------------------------


def socket_owners(path: Path) -> set[int]:
    """The pids that hold the listening unix socket bound at `path` (via /proc)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == str(path):
                inodes.add(f"socket:[{fields[6]}]")
    owners = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd") if inodes else ():
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in fd_dir.iterdir()):
                owners.add(int(fd_dir.parent.name))
    return owners


def listening(path: Path) -> bool:
    """Whether something accepts connections on the unix socket at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True

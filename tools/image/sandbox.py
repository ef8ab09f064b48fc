"""A container without a container runtime, for tests of the image.

`tools.image.run.sandbox_command` runs this file as a script (`python -I sandbox.py SPEC`,
SPEC a JSON object): it unshares its mount namespace, bind-mounts what a Pod would
mount (hostPath dirs, the service account token), mounts tmpfs, /proc and /dev, makes
the image's root read-only, chroots into it, takes the uid/gid, drops every capability
(bounding set included), sets no_new_privs and execs the command: what
`securityContext: {runAsUser: 0, capabilities: {drop: [ALL]}, allowPrivilegeEscalation:
false, readOnlyRootFilesystem: true}` gives a container. It shares the host's network.

Only the standard library: it runs as a script, before the chroot, as root.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from typing import Any

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT = 1, 2, 4, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
CLONE_NEWNS = 0x00020000
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
SYS_CAPSET = 126  # x86_64
LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _bytes(text: str | None) -> bytes | None:
    return text.encode() if text is not None else None


def _mount(
    libc: ctypes.CDLL,
    source: str | None,
    target: str,
    fstype: str | None,
    flags: int,
    data: str | None = None,
) -> None:
    result = libc.mount(
        _bytes(source), _bytes(target), _bytes(fstype), ctypes.c_ulong(flags), _bytes(data)
    )
    _check(result, f"mount {target}")


def enter(spec: dict[str, Any]) -> None:
    """Become the container `spec` describes (root, binds, tmpfs, workdir, uid, gid)."""
    libc = ctypes.CDLL(None, use_errno=True)
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    root = str(spec["root"])
    _mount(libc, root, root, None, MS_BIND | MS_REC)
    for target, source in spec["binds"]:
        _mount(libc, source, root + target, None, MS_BIND)
    for target in spec["tmpfs"]:
        _mount(libc, "tmpfs", root + target, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=1777")
    _mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV)
    _mount(libc, "/dev", root + "/dev", None, MS_BIND | MS_REC)
    _mount(libc, None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    os.chroot(root)
    os.chdir(spec["workdir"])
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last cap
    os.setgroups([])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    _check(libc.syscall(SYS_CAPSET, ctypes.byref(header), (_CapData * 2)()), "capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")


def main(argv: list[str]) -> None:
    spec = json.loads(argv[1])
    enter(spec)
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


if __name__ == "__main__":
    main(sys.argv)

"""A process that holds only what a claim's CDI spec gives: no runtime, no container.

``build_plan`` (pure) turns a CDI spec, the CDI devices a container was given and the
probe's own Python runtime into a ``Plan``: bind mounts (read-only where the spec says),
device nodes, the links and library path that stand for the spec's hooks, the env.
``run_plan`` carries it out in a child process: ``unshare(CLONE_NEWNS | CLONE_NEWPID)``
through ctypes (``os.unshare`` only came with Python 3.12; the bundle runs on 3.10),
a tmpfs root, the binds, ``/proc`` of the new PID namespace, ``chroot``, then ``exec``
of the probe. Nothing of this reaches the host's mount table: the namespace's mounts
are private and go with its last process.

The hooks are applied as far as a check without a runtime needs: ``create-symlinks``
makes the links it names; ``update-ldcache`` becomes ``LD_LIBRARY_PATH`` of its
folders (running it needs an OCI state on stdin); ``enable-cuda-compat`` and
``disable-device-node-modification`` change nothing a probe sees and are listed as
not applied. Besides the spec the sandbox gets the host's python3 (its executable,
standard library and the shared objects it maps, read-only), ``/dev/null``,
``/dev/zero``, ``/dev/urandom``, ``/proc`` and a read-only ``/sys``: what every
container runtime gives a container, and the probe's own interpreter.

This module imports only the standard library: the child runs it as a script
(``python3 -I -S sandbox.py PLAN``), outside any package.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

PROBE_PATH = "/gpucheck-probe.py"
RUNTIME_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
NOT_APPLIED_HOOKS = ("enable-cuda-compat", "disable-device-node-modification")
_FLAG_OPTIONS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}


class SandboxError(RuntimeError):
    """The plan could not be built or carried out."""


@dataclass(frozen=True)
class Bind:
    source: str  # on the host
    target: str  # in the sandbox
    flags: tuple[str, ...] = ("ro",)  # of _FLAG_OPTIONS, applied by a remount
    recursive: bool = False
    origin: str = "spec"  # "spec" or "runtime": who asked for it (the report says)


@dataclass(frozen=True)
class Node:
    path: str  # in the sandbox
    host_path: str
    type: str = "c"
    major: int | None = None
    minor: int | None = None
    origin: str = "spec"


@dataclass(frozen=True)
class Link:
    path: str  # in the sandbox
    target: str  # as the link's text
    origin: str = "spec"


@dataclass(frozen=True)
class Plan:
    binds: tuple[Bind, ...]
    nodes: tuple[Node, ...]
    links: tuple[Link, ...]
    env: dict[str, str]
    argv: tuple[str, ...]
    hooks_applied: tuple[str, ...] = ()
    hooks_not_applied: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        return cls(
            binds=tuple(Bind(**{**b, "flags": tuple(b["flags"])}) for b in data["binds"]),
            nodes=tuple(Node(**n) for n in data["nodes"]),
            links=tuple(Link(**x) for x in data["links"]),
            env=dict(data["env"]),
            argv=tuple(data["argv"]),
            hooks_applied=tuple(data["hooks_applied"]),
            hooks_not_applied=tuple(data["hooks_not_applied"]),
        )


@dataclass(frozen=True)
class Runtime:
    """The probe's interpreter: the files it needs at the paths it has on the host."""

    executable: str  # the real file, links resolved
    directories: tuple[str, ...]  # the standard library
    files: tuple[str, ...]  # shared objects it maps (libc, libffi, the loader, ...)
    links: tuple[Link, ...] = field(default=())  # e.g. /lib64 -> usr/lib64


# ---- the plan ----------------------------------------------------------------------------


def container_edits(spec: Mapping[str, Any], devices: Iterable[str]) -> list[Mapping[str, Any]]:
    """The spec-wide edits, then those of each named device (``<uid>-gpu-0``: the part
    after ``=`` of a CDI device ID), as a runtime merges them."""
    by_name = {d["name"]: d.get("containerEdits") or {} for d in spec.get("devices") or []}
    wanted = list(devices)
    missing = [d for d in wanted if d not in by_name]
    if missing:
        raise SandboxError(f"CDI devices not in the spec: {', '.join(missing)}")
    return [spec.get("containerEdits") or {}, *(by_name[d] for d in wanted)]


def _mount_flags(options: Sequence[str]) -> tuple[str, ...]:
    return tuple(o for o in options if o in _FLAG_OPTIONS)


def _binds(edits: Sequence[Mapping[str, Any]]) -> list[Bind]:
    return [
        Bind(
            source=m["hostPath"],
            target=m["containerPath"],
            flags=_mount_flags(m.get("options") or ()),
            recursive="rbind" in (m.get("options") or ()),
        )
        for e in edits
        for m in e.get("mounts") or []
    ]


def _nodes(edits: Sequence[Mapping[str, Any]]) -> list[Node]:
    return [
        Node(
            path=d["path"],
            host_path=d.get("hostPath") or d["path"],
            type=d.get("type") or "c",
            major=d.get("major"),
            minor=d.get("minor"),
        )
        for e in edits
        for d in e.get("deviceNodes") or []
    ]


def _env(edits: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for e in edits:
        for item in e.get("env") or []:
            name, _, value = item.partition("=")
            env[name] = value
    return env


def _flag_values(args: Sequence[str], flag: str) -> list[str]:
    """``--flag v`` and ``--flag=v`` values, in order."""
    values = []
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            values.append(args[i + 1])
        elif arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
    return values


@dataclass
class _Hooks:
    links: list[Link] = field(default_factory=list)
    folders: list[str] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)
    not_applied: list[str] = field(default_factory=list)


def _hooks(edits: Sequence[Mapping[str, Any]]) -> _Hooks:
    done = _Hooks()
    for e in edits:
        for hook in e.get("hooks") or []:
            args = list(hook.get("args") or [])
            command = args[1] if len(args) > 1 else Path(hook["path"]).name
            if command == "create-symlinks":
                for pair in _flag_values(args, "--link"):
                    target, _, link = pair.partition("::")
                    done.links.append(Link(path=link, target=target))
                done.applied.append(command)
            elif command == "update-ldcache":
                done.folders += _flag_values(args, "--folder")
                done.applied.append(f"{command} (as LD_LIBRARY_PATH)")
            else:
                done.not_applied.append(command)
    return done


def build_plan(
    spec: Mapping[str, Any],
    devices: Iterable[str],
    runtime: Runtime,
    *,
    probe_source: str,
    probe_args: Sequence[str] = (),
) -> Plan:
    """What the sandbox of a container given ``devices`` of ``spec`` holds; the probe
    runs with ``probe_args``."""
    edits = container_edits(spec, devices)
    hooks = _hooks(edits)
    env = _env(edits)
    folders = list(dict.fromkeys(hooks.folders))
    env["LD_LIBRARY_PATH"] = ":".join(folders)
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    runtime_binds = [Bind(source=runtime.executable, target=runtime.executable, origin="runtime")]
    runtime_binds += [Bind(source=d, target=d, origin="runtime") for d in runtime.directories]
    runtime_binds += [
        Bind(source=f, target=f, origin="runtime")
        for f in runtime.files
        if not any(_under(f, d) for d in runtime.directories)
    ]
    runtime_binds.append(Bind(source=probe_source, target=PROBE_PATH, origin="runtime"))
    runtime_binds.append(Bind(source="/sys", target="/sys", recursive=True, origin="runtime"))
    runtime_nodes = [Node(path=d, host_path=d, origin="runtime") for d in RUNTIME_DEVICES]
    return Plan(
        binds=tuple(_binds(edits) + runtime_binds),
        nodes=tuple(_nodes(edits) + runtime_nodes),
        links=tuple(list(runtime.links) + hooks.links),
        env=env,
        argv=(runtime.executable, "-I", "-S", PROBE_PATH, *probe_args),
        hooks_applied=tuple(hooks.applied),
        hooks_not_applied=tuple(hooks.not_applied),
    )


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


# ---- carrying it out (in the child) ------------------------------------------------------


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    libc = _libc()
    rc = libc.mount(
        source.encode() if source else None,
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    _check(rc, f"mount {source} on {target}")


def _inside(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _make_link(root: str, link: Link) -> None:
    """The link, with an absolute target made relative: it is made before ``chroot``,
    and must lead to the same place inside the root either way."""
    where = _inside(root, link.path)
    target = link.target
    if target.startswith("/"):
        target = os.path.relpath(_inside(root, target), os.path.dirname(where))
    os.makedirs(os.path.dirname(where), exist_ok=True)
    if not os.path.lexists(where):
        os.symlink(target, where)


def _placeholder(where: str, *, directory: bool) -> None:
    os.makedirs(os.path.dirname(where), exist_ok=True)
    if directory:
        os.makedirs(where, exist_ok=True)
    elif not os.path.lexists(where):
        with open(where, "w"):
            pass


def _bind(root: str, bind: Bind) -> None:
    where = _inside(root, bind.target)
    _placeholder(where, directory=os.path.isdir(bind.source))
    _mount(bind.source, where, None, MS_BIND | (MS_REC if bind.recursive else 0), None)
    flags = 0
    for name in bind.flags:
        flags |= _FLAG_OPTIONS[name]
    if flags:
        _mount(None, where, None, MS_BIND | MS_REMOUNT | flags, None)


def _node(root: str, node: Node) -> None:
    where = _inside(root, node.path)
    if os.path.exists(node.host_path):
        _placeholder(where, directory=False)
        _mount(node.host_path, where, None, MS_BIND, None)
        return
    if node.major is None:
        raise SandboxError(f"device node {node.host_path} is missing and the spec gives no major")
    kind = stat.S_IFBLK if node.type == "b" else stat.S_IFCHR
    os.makedirs(os.path.dirname(where), exist_ok=True)
    os.mknod(where, 0o666 | kind, os.makedev(node.major, node.minor or 0))


def _ordered(binds: Sequence[Bind]) -> list[Bind]:
    """Directories first, shortest path first, so a file bound below a bound folder
    lands in it instead of being hidden by it."""
    return sorted(binds, key=lambda b: (not os.path.isdir(b.source), len(b.target)))


def _build_root(plan: Plan, root: str) -> None:
    _mount("tmpfs", root, "tmpfs", MS_NOSUID, "mode=0755")
    for link in plan.links:
        if link.origin == "runtime":
            _make_link(root, link)
    for bind in _ordered(plan.binds):
        _bind(root, bind)
    for node in plan.nodes:
        _node(root, node)
    for link in plan.links:
        if link.origin != "runtime":
            _make_link(root, link)
    os.makedirs(_inside(root, "/proc"), exist_ok=True)
    _mount("proc", _inside(root, "/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    os.makedirs(_inside(root, "/tmp"), mode=0o1777, exist_ok=True)


def _child(plan: Plan, root: str) -> None:
    """PID 1 of the new PID namespace: build the root, enter it, become the probe."""
    try:
        _build_root(plan, root)
        os.chroot(root)
        os.chdir("/")
        os.execve(plan.argv[0], list(plan.argv), plan.env)
    except BaseException as err:  # report, never return into the parent's code
        sys.stderr.write(f"sandbox: {type(err).__name__}: {err}\n")
        sys.stderr.flush()
        os._exit(127)


def enter(plan: Plan, root: str) -> int:
    """Unshare, fork PID 1 of the new namespace, wait for it; its exit status."""
    libc = _libc()
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID), "unshare(CLONE_NEWNS|CLONE_NEWPID)")
    # Private: nothing mounted from here on propagates back to the host.
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    os.makedirs(root, exist_ok=True)
    pid = os.fork()
    if pid == 0:
        _child(plan, root)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stdout: str
    stderr: str


def run_plan(plan: Plan, *, work_dir: Path, python: str, timeout: float = 120.0) -> Outcome:
    """Carry ``plan`` out in a child process (this module as a script, so the check's
    own threads and loaded libraries never meet a ``fork``); what the probe printed."""
    work_dir.mkdir(parents=True, exist_ok=True)
    plan_file = work_dir / "sandbox-plan.json"
    plan_file.write_text(plan.to_json())
    done = subprocess.run(
        [python, "-I", "-S", str(Path(__file__).resolve()), str(plan_file), str(work_dir / "root")],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return Outcome(done.returncode, done.stdout, done.stderr)


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: sandbox.py PLAN_JSON ROOT_DIR\n")
        return 2
    plan = Plan.from_json(Path(argv[0]).read_text())
    return enter(plan, argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

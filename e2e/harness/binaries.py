"""Install the binaries of `e2e.harness.recipes` into the cache, and the host tools.

Each installed binary has its recipe hash in `bin/.stamp.json`; only a binary whose
recipe changed, or that is missing, is built again (`go build` in our own module
directory under `<cache>/e2e/<version>/work/`, its output in a log there). One build of
a version runs at a time (`build_lock`). Host tools (a C compiler, headers, `ip`,
`dpkg-deb`) are installed with apt-get when missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Protocol

from e2e.harness import paths, procs
from e2e.harness.recipes import BINARY_NAMES, Binary, GoModule, binaries

TAIL_LINES = 40
STAMP_NAME = ".stamp.json"


class Writer(Protocol):
    def write(self, text: str, /) -> object: ...
    def flush(self) -> object: ...


class BuildError(RuntimeError):
    """A build step failed; the message names the step and shows the Go output's tail."""

    def __init__(self, *, step: str, command: list[str] | None, detail: str, log: Path | None):
        self.step = step
        self.command = command
        self.log = log
        lines = [f"e2e build failed at step {step!r}"]
        if command is not None:
            lines.append(f"  command: {shlex.join(command)}")
        if log is not None:
            lines.append(f"  full output: {log}")
        lines.append(detail)
        super().__init__("\n".join(lines))


def _up_to_date(binary: Binary, bin_dir: Path, stamp: Mapping[str, Mapping[str, object]]) -> bool:
    entry = stamp.get(binary.name)
    path = binary.path(bin_dir.parent)
    if not entry or entry.get("recipe") != binary.recipe():
        return False
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_size == entry.get("size") and os.access(path, os.X_OK)


# What the harness needs from the host: a command on PATH (or, for a path, a file),
# and the Debian packages that provide it. On a machine without them (a fresh CI
# image), `ensure_host_tools` installs them with apt-get.
HOST_TOOLS: dict[str, tuple[str, ...]] = {
    "gcc": ("gcc", "libc6-dev"),  # runc's nsenter is cgo
    "/usr/include/seccomp.h": ("libseccomp-dev", "pkg-config"),  # runc with seccomp
    "ip": ("iproute2",),  # the node's Pod network bridge
    "dpkg-deb": ("dpkg",),  # unpacks busybox-static for the test image
    "buildah": ("buildah",),  # builds the images (tools.image, e2e.harness.node_images)
    "mmdebstrap": ("mmdebstrap", "gpg"),  # the image's base from Debian's packages
}


def _present(tool: str) -> bool:
    return Path(tool).exists() if tool.startswith("/") else shutil.which(tool) is not None


def ensure_host_tools(tools: Iterable[str], *, out: Writer | None = None) -> None:
    """Install (apt-get) the Debian packages of any of `tools` (keys of HOST_TOOLS)
    that is missing.

    Raises BuildError when a tool is missing and cannot be installed."""
    progress = out if out is not None else sys.stderr
    missing = [t for t in tools if not _present(t)]
    if not missing:
        return
    packages = sorted({p for t in missing for p in HOST_TOOLS[t]})
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise BuildError(
            step=f"find {', '.join(missing)}",
            command=None,
            detail=f"  not on PATH; install the packages {' '.join(packages)} (Debian names)",
            log=None,
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    print(f"build: {shlex.join(install)} (for {', '.join(missing)})", file=progress, flush=True)
    done = subprocess.run(install, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:  # package lists may be empty on a fresh image
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, check=False)
        done = subprocess.run(install, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0 or not all(_present(t) for t in missing):
        raise BuildError(
            step=f"install {' '.join(packages)}",
            command=install,
            detail=(done.stderr or done.stdout)[-2000:],
            log=None,
        )


def _find_go() -> Path:
    explicit = os.environ.get("DRASIL_GO")
    candidates = [explicit] if explicit else [shutil.which("go"), "/usr/local/go/bin/go"]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    raise BuildError(
        step="find the Go toolchain",
        command=None,
        detail="no `go` on PATH nor /usr/local/go/bin/go (set DRASIL_GO to its path)",
        log=None,
    )


@contextlib.contextmanager
def build_lock(version_dir: Path, out: Writer) -> Iterator[None]:
    """Two builds at once (two test sessions) would race on the same files."""
    version_dir.mkdir(parents=True, exist_ok=True)
    with open(version_dir / ".build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("build: waiting for another build of the same version", file=out)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _prepare_module(module: GoModule, work_dir: Path) -> Path:
    mod_dir = work_dir / module.name
    mod_dir.mkdir(parents=True, exist_ok=True)
    for name, content in module.files.items():
        target = mod_dir / name
        if not target.exists() or target.read_text() != content:
            paths.write_atomic(target, content)
    return mod_dir


def _go_env(binary: Binary | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # -mod=mod: resolve go.sum from the proxy and checksum database on first build.
    # Never `go mod tidy` here: it downgrades k8s.io/kubernetes to satisfy v0.0.0 requires.
    env["GOFLAGS"] = "-mod=mod -buildvcs=false"
    if binary is not None and binary.cgo is not None:
        env["CGO_ENABLED"] = "1" if binary.cgo else "0"
    return env


def _build_one(binary: Binary, *, go: Path, bin_dir: Path, work_dir: Path) -> float:
    mod_dir = _prepare_module(binary.module, work_dir)
    log = mod_dir / f"{binary.name}.build.log"
    target = binary.path(bin_dir.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{binary.name}.tmp-{os.getpid()}"
    cmd = [str(go), "build", "-o", str(tmp)]
    if binary.tags:
        cmd.append("-tags=" + ",".join(binary.tags))
    if binary.ldflags:
        cmd.append("-ldflags=" + " ".join(binary.ldflags))
    cmd.append(binary.package)
    started = time.monotonic()
    with open(log, "w") as out:
        cgo = "" if binary.cgo is None else f"CGO_ENABLED={int(binary.cgo)} "
        out.write(f"$ cd {mod_dir} && {cgo}{shlex.join(cmd)}\n")
        out.flush()
        try:
            rc = subprocess.call(
                cmd, cwd=mod_dir, env=_go_env(binary), stdout=out, stderr=subprocess.STDOUT
            )
        except OSError as e:
            raise BuildError(
                step=f"build {binary.name}", command=cmd, detail=str(e), log=log
            ) from e
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise BuildError(
            step=f"build {binary.name}",
            command=cmd,
            detail=(
                f"  in: {mod_dir}\n  exit status: {rc}\n"
                f"--- last {TAIL_LINES} lines of Go output ---\n{procs.tail(log, TAIL_LINES)}"
            ),
            log=log,
        )
    os.replace(tmp, target)
    return time.monotonic() - started


def ensure_binaries(
    names: Iterable[str] | None = None, *, out: Writer | None = None
) -> dict[str, Path]:
    """Build what is missing or stale and return name -> path for `names` (default: all).

    Raises BuildError naming the failed step.
    """
    progress = out if out is not None else sys.stderr
    wanted = set(BINARY_NAMES if names is None else names)
    unknown = wanted - set(BINARY_NAMES)
    if unknown:
        raise ValueError(f"unknown binaries {sorted(unknown)}; known: {list(BINARY_NAMES)}")
    todo = [b for b in binaries() if b.name in wanted]
    bin_dir = paths.bin_dir()
    result = {b.name: b.path(paths.version_dir()) for b in todo}

    # Fast path, no lock and no Go: everything is installed and current.
    stamp = paths.read_stamp(bin_dir / STAMP_NAME)
    if all(_up_to_date(b, bin_dir, stamp) for b in todo):
        return result

    with build_lock(paths.version_dir(), progress):
        bin_dir.mkdir(parents=True, exist_ok=True)
        stamp = paths.read_stamp(bin_dir / STAMP_NAME)  # another build may have finished meanwhile
        stale = [b for b in todo if not _up_to_date(b, bin_dir, stamp)]
        if not stale:
            return result
        go = _find_go()
        ensure_host_tools({t for b in stale for t in b.needs}, out=progress)
        total = time.monotonic()
        for i, binary in enumerate(stale, 1):
            print(
                f"build: [{i}/{len(stale)}] {binary.name}: go build {binary.package} "
                f"(logs in {paths.work_dir() / binary.module.name})",
                file=progress,
                flush=True,
            )
            seconds = _build_one(binary, go=go, bin_dir=bin_dir, work_dir=paths.work_dir())
            size = binary.path(paths.version_dir()).stat().st_size
            stamp[binary.name] = {
                "recipe": binary.recipe(),
                "size": size,
                "seconds": round(seconds, 1),
                "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            paths.write_atomic(bin_dir / STAMP_NAME, json.dumps(stamp, indent=2, sort_keys=True))
            print(
                f"build:   {binary.name} built in {seconds:.1f}s ({size / 2**20:.0f} MiB)",
                file=progress,
                flush=True,
            )
        print(
            f"build: built {len(stale)} binaries in {time.monotonic() - total:.1f}s into {bin_dir}",
            file=progress,
            flush=True,
        )
    return result

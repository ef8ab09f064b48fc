"""Build the pinned upstream binaries once, from the Go module proxy, into the cache.

`python -m e2e.build` builds whatever is missing or out of date into
`<cache>/e2e/<kubernetes-version>/bin/` (see `e2e.paths`) and reports progress on
stderr. With a warm cache it starts no Go process and returns in milliseconds: each
installed binary has a recipe hash (versions, go.mod, package, flags) in `bin/.stamp.json`,
and only a binary whose recipe changed, or that is missing, is rebuilt.

k8s.io/kubernetes cannot be `go install`ed: its go.mod requires the staging modules at
v0.0.0. Our own go.mod (written to `<cache>/e2e/<version>/work/kubernetes/`) requires it
at the pinned release and replaces every staging module with its published v0.Y.Z.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from e2e import paths, versions

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


@dataclass(frozen=True)
class GoModule:
    """A directory with our go.mod (and a main.go where needed) to build from."""

    name: str
    files: Mapping[str, str]


@dataclass(frozen=True)
class Binary:
    name: str
    module: GoModule
    package: str
    ldflags: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    # CGO_ENABLED for this build; None leaves Go's default (on where a C compiler is).
    cgo: bool | None = None
    # Installed as <version dir>/<subdir>/<name> (CNI plugins get their own directory).
    subdir: str = "bin"
    # Keys of HOST_TOOLS the build needs (a C compiler, headers); not part of the recipe.
    needs: tuple[str, ...] = ()

    def recipe(self) -> str:
        """Changes whenever anything that decides the binary's content changes."""
        data: dict[str, object] = {
            "name": self.name,
            "package": self.package,
            "ldflags": list(self.ldflags),
            "files": dict(sorted(self.module.files.items())),
        }
        # Only when set, so that adding these fields left older recipes (and the
        # binaries built from them) valid.
        if self.tags:
            data["tags"] = list(self.tags)
        if self.cgo is not None:
            data["cgo"] = self.cgo
        if self.subdir != "bin":
            data["subdir"] = self.subdir
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def path(self, version_dir: Path) -> Path:
        return version_dir / self.subdir / self.name


def _kubernetes_module() -> GoModule:
    replaces = "\n".join(f"\t{m} => {m} {versions.STAGING}" for m in versions.STAGING_MODULES)
    gomod = (
        "module drasil.dev/e2e-binaries\n\n"
        f"go {versions.GO_DIRECTIVE}\n\n"
        f"godebug default=go{'.'.join(versions.GO_DIRECTIVE.split('.')[:2])}\n\n"
        f"require k8s.io/kubernetes {versions.KUBERNETES}\n\n"
        f"replace (\n{replaces}\n)\n"
    )
    return GoModule("kubernetes", {"go.mod": gomod})


def _etcd_module() -> GoModule:
    gomod = (
        "module drasil.dev/e2e-etcd\n\n"
        f"go {versions.GO_DIRECTIVE}\n\n"
        f"require go.etcd.io/etcd/server/v3 {versions.ETCD}\n"
    )
    main = (
        "// etcd's own main package lives in a module the proxy does not serve for 3.7;\n"
        "// etcdmain.Main is what that main calls.\n"
        "package main\n\n"
        'import (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\n'
        "func main() { etcdmain.Main(os.Args) }\n"
    )
    return GoModule("etcd", {"go.mod": gomod, "main.go": main})


def _helm_module() -> GoModule:
    major = versions.HELM.split(".")[0]
    gomod = (
        "module drasil.dev/e2e-helm\n\n"
        f"go {versions.GO_DIRECTIVE}\n\n"
        f"require helm.sh/helm/{major} {versions.HELM}\n"
    )
    return GoModule("helm", {"go.mod": gomod})


def _kube_ldflags() -> tuple[str, ...]:
    major, minor, _ = versions.KUBERNETES.lstrip("v").split(".", 2)
    flags = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={versions.KUBERNETES}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitCommit={versions.KUBERNETES_COMMIT}",
            f"-X {pkg}.gitTreeState=clean",
        ]
    return tuple(flags)


def _containerd_module() -> GoModule:
    gomod = (
        "module drasil.dev/e2e-containerd\n\n"
        f"go {versions.GO_DIRECTIVE}\n\n"
        f"require github.com/containerd/containerd/v2 {versions.CONTAINERD}\n"
    )
    return GoModule("containerd", {"go.mod": gomod})


def _runc_module() -> GoModule:
    gomod = (
        "module drasil.dev/e2e-runc\n\n"
        f"go {versions.GO_DIRECTIVE}\n\n"
        f"require github.com/opencontainers/runc {versions.RUNC}\n"
    )
    return GoModule("runc", {"go.mod": gomod})


def _cni_module() -> GoModule:
    gomod = (
        "module drasil.dev/e2e-cni\n\n"
        f"go {versions.GO_DIRECTIVE}\n\n"
        f"require github.com/containernetworking/plugins {versions.CNI_PLUGINS}\n"
    )
    return GoModule("cni-plugins", {"go.mod": gomod})


PAUSE_MAIN = """\
// The sandbox ("pause") process of every Pod: PID 1 of the Pod's namespaces. It reaps
// orphans and exits on SIGINT/SIGTERM, like registry.k8s.io/pause.
package main

import (
\t"os"
\t"os/signal"
\t"syscall"
)

func main() {
\tsignals := make(chan os.Signal, 8)
\tsignal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
\tfor s := range signals {
\t\tif s != syscall.SIGCHLD {
\t\t\tos.Exit(0)
\t\t}
\t\tfor {
\t\t\tvar status syscall.WaitStatus
\t\t\tpid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
\t\t\tif pid <= 0 || err != nil {
\t\t\t\tbreak
\t\t\t}
\t\t}
\t}
}
"""


def _pause_module() -> GoModule:
    gomod = f"module drasil.dev/e2e-pause\n\ngo {versions.GO_DIRECTIVE}\n"
    return GoModule("pause", {"go.mod": gomod, "main.go": PAUSE_MAIN})


def _bench_client_module() -> GoModule:
    """bench/kubeletclient: calls a plugin's dra.sock with grpc-go, as kubelet does."""
    source = Path(__file__).resolve().parent.parent / "bench" / "kubeletclient"
    return GoModule("kubeletclient", {n: (source / n).read_text() for n in ("go.mod", "main.go")})


def node_binaries() -> tuple[Binary, ...]:
    """What a node runs besides kubelet: containerd, its shim, runc, CNI plugins, and the
    pause binary of the sandbox image."""
    ctrd = _containerd_module()
    ctrd_pkg = "github.com/containerd/containerd/v2"
    ctrd_flags = (
        "-s",
        "-w",
        f"-X {ctrd_pkg}/version.Version={versions.CONTAINERD}",
        f"-X {ctrd_pkg}/version.Package={ctrd_pkg}",
    )
    # Static (no cgo) like containerd's release builds; the btrfs, devmapper and zfs
    # snapshotters are left out (overlayfs is what we use).
    ctrd_tags = ("urfave_cli_no_docs", "no_btrfs", "no_devmapper", "no_zfs")
    cni = _cni_module()
    cni_flags = (
        "-s",
        "-w",
        "-X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion="
        + versions.CNI_PLUGINS,
    )
    cni_dirs = {"bridge": "main", "loopback": "main", "host-local": "ipam"}
    return (
        *(
            Binary(
                name,
                ctrd,
                f"{ctrd_pkg}/cmd/{name}",
                ctrd_flags,
                tags=(*ctrd_tags, "no_grpc") if name.startswith("containerd-shim") else ctrd_tags,
                cgo=False,
            )
            for name in ("containerd", "ctr", "containerd-shim-runc-v2")
        ),
        Binary(
            "runc",
            _runc_module(),
            "github.com/opencontainers/runc",
            (
                "-s",
                "-w",
                f"-X main.version={versions.RUNC.lstrip('v')}",
                f"-X main.gitCommit={versions.RUNC_COMMIT}",
            ),
            # seccomp: containerd gives every Pod sandbox the runtime/default profile.
            tags=("urfave_cli_no_docs", "seccomp"),
            cgo=True,  # runc's nsenter is C; libseccomp is linked dynamically
            needs=("gcc", "/usr/include/seccomp.h"),
        ),
        *(
            Binary(
                name,
                cni,
                f"github.com/containernetworking/plugins/plugins/{cni_dirs[name]}/{name}",
                cni_flags,
                cgo=False,
                subdir="cni-bin",
            )
            for name in versions.CNI_PLUGIN_NAMES
        ),
        Binary("drasil-pause", _pause_module(), ".", ("-s", "-w"), cgo=False),
    )


def binaries() -> tuple[Binary, ...]:
    """Every binary the harness provides, in build order."""
    kube = _kubernetes_module()
    kube_flags = _kube_ldflags()
    helm_major = versions.HELM.split(".")[0]
    helm_version_pkg = f"helm.sh/helm/{helm_major}/internal/version"
    return (
        *(
            Binary(name, kube, f"k8s.io/kubernetes/cmd/{name}", kube_flags)
            for name in (
                "kube-apiserver",
                "kube-controller-manager",
                "kube-scheduler",
                "kubectl",
                "kubelet",
            )
        ),
        Binary("etcd", _etcd_module(), ".", ("-s", "-w")),
        Binary(
            "helm",
            _helm_module(),
            f"helm.sh/helm/{helm_major}/cmd/helm",
            (
                "-s",
                "-w",
                f"-X {helm_version_pkg}.version={versions.HELM}",
                f"-X {helm_version_pkg}.gitTreeState=clean",
            ),
        ),
        *node_binaries(),
        Binary("drasil-kubelet-client", _bench_client_module(), ".", ("-s", "-w"), cgo=False),
    )


BINARY_NAMES = tuple(b.name for b in binaries())
NODE_BINARY_NAMES = ("kubelet", "kubectl", *(b.name for b in node_binaries()))


def _read_stamp(bin_dir: Path) -> dict[str, dict[str, object]]:
    try:
        data = json.loads((bin_dir / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


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
    print(f"e2e.build: {shlex.join(install)} (for {', '.join(missing)})", file=progress, flush=True)
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


def _tail(path: Path, n: int = TAIL_LINES) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return "\n".join(lines[-n:])


@contextlib.contextmanager
def build_lock(version_dir: Path, out: Writer) -> Iterator[None]:
    """Two builds at once (two test sessions) would race on the same files."""
    version_dir.mkdir(parents=True, exist_ok=True)
    with open(version_dir / ".build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("e2e.build: waiting for another build of the same version", file=out)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _prepare_module(module: GoModule, work_dir: Path) -> Path:
    mod_dir = work_dir / module.name
    mod_dir.mkdir(parents=True, exist_ok=True)
    for name, content in module.files.items():
        target = mod_dir / name
        if not target.exists() or target.read_text() != content:
            _write_atomic(target, content)
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
                f"--- last {TAIL_LINES} lines of Go output ---\n{_tail(log)}"
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
    stamp = _read_stamp(bin_dir)
    if all(_up_to_date(b, bin_dir, stamp) for b in todo):
        return result

    with build_lock(paths.version_dir(), progress):
        bin_dir.mkdir(parents=True, exist_ok=True)
        stamp = _read_stamp(bin_dir)  # another build may have finished meanwhile
        stale = [b for b in todo if not _up_to_date(b, bin_dir, stamp)]
        if not stale:
            return result
        go = _find_go()
        ensure_host_tools({t for b in stale for t in b.needs}, out=progress)
        total = time.monotonic()
        for i, binary in enumerate(stale, 1):
            print(
                f"e2e.build: [{i}/{len(stale)}] {binary.name}: go build {binary.package} "
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
            _write_atomic(bin_dir / STAMP_NAME, json.dumps(stamp, indent=2, sort_keys=True))
            print(
                f"e2e.build:   {binary.name} built in {seconds:.1f}s ({size / 2**20:.0f} MiB)",
                file=progress,
                flush=True,
            )
        print(
            f"e2e.build: built {len(stale)} binaries in {time.monotonic() - total:.1f}s "
            f"into {bin_dir}",
            file=progress,
            flush=True,
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.build",
        description="Build the pinned Kubernetes, etcd, helm and node binaries (containerd, "
        "runc, CNI plugins) and the node's images into the cache; install missing host "
        "tools (gcc, iproute2, dpkg) with apt-get.",
    )
    parser.add_argument("names", nargs="*", help=f"subset of {', '.join(BINARY_NAMES)}")
    parser.add_argument("--print-dir", action="store_true", help="print the bin directory")
    args = parser.parse_args(argv)
    started = time.monotonic()
    from e2e import node_images  # imports this module

    try:
        ensure_binaries(args.names or None)
        if not args.names:
            ensure_host_tools(HOST_TOOLS)
            node_images.ensure_images()
    except (BuildError, node_images.ImageError) as e:
        print(e, file=sys.stderr)
        return 1
    print(
        f"e2e.build: up to date in {paths.bin_dir()} ({time.monotonic() - started:.2f}s)",
        file=sys.stderr,
    )
    if args.print_dir:
        print(paths.bin_dir())
    return 0


if __name__ == "__main__":
    sys.exit(main())

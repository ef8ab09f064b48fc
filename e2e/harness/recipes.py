"""What the harness builds: each binary's Go module, package, flags and tags.

A binary's recipe hash covers everything that decides its content, so that
`e2e.harness.binaries` rebuilds exactly the binaries whose recipe changed. The Go sources of our
own small programs (etcd's main, the pause process) are the `main.go` files in e2e/harness/go/;
bench/kubeletclient is the benchmarks' kubelet client; dra-test-driver (Kubernetes' own e2e
DRA driver) is the reference the prepare benchmark measures drasil beside; nvidia-ctk and
nvidia-cdi-hook (the NVIDIA Container Toolkit) are the oracle of the driver files drasil
puts in its CDI specs (e2e.harness.nvidiatoolkit).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from e2e.harness import paths, versions

GO_SOURCES = Path(__file__).resolve().parent / "go"


@dataclass(frozen=True)
class Binary:
    """What `go build` makes of `package` in `module`, and where it is installed."""

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


@dataclass(frozen=True)
class GoModule:
    """A directory with our go.mod (and a main.go where needed) to build from."""

    name: str
    files: Mapping[str, str]


def _go_mod(name: str, require: str | None = None) -> str:
    """Our go.mod of module drasil.dev/e2e-<name>, requiring `require` if given."""
    text = f"module drasil.dev/e2e-{name}\n\ngo {versions.GO_DIRECTIVE}\n"
    return text + (f"\nrequire {require}\n" if require else "")


def _module(
    name: str, require: str, *, mod_name: str | None = None, directory: str | None = None
) -> GoModule:
    """A module (drasil.dev/e2e-<mod_name or name>) that only requires `require`, whose
    main packages build from there, plus the main.go of GO_SOURCES/<directory> if given."""
    files = {"go.mod": _go_mod(mod_name or name, require)}
    if directory is not None:
        files["main.go"] = (GO_SOURCES / directory / "main.go").read_text()
    return GoModule(name, files)


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


def _kube_ldflags() -> tuple[str, ...]:
    major, minor, _ = versions.KUBERNETES.lstrip("v").split(".", 2)
    flags = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={versions.KUBERNETES}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
        ]
        if versions.KUBERNETES_COMMIT:
            flags.append(f"-X {pkg}.gitCommit={versions.KUBERNETES_COMMIT}")
    return tuple(flags)


def _pause_module() -> GoModule:
    """The sandbox ("pause") process of every Pod (pause/main.go): no dependencies."""
    main = (GO_SOURCES / "pause" / "main.go").read_text()
    return GoModule("pause", {"go.mod": _go_mod("pause"), "main.go": main})


def _bench_client_module() -> GoModule:
    """bench/kubeletclient: calls a plugin's dra.sock with grpc-go, as kubelet does."""
    source = paths.CHECKOUT / "bench" / "kubeletclient"
    return GoModule("kubeletclient", {n: (source / n).read_text() for n in ("go.mod", "main.go")})


def node_binaries() -> tuple[Binary, ...]:
    """What a node runs besides kubelet: containerd, its shim, runc, CNI plugins, and the
    pause binary of the sandbox image."""
    ctrd_pkg = "github.com/containerd/containerd/v2"
    ctrd = _module("containerd", f"{ctrd_pkg} {versions.CONTAINERD}")
    ctrd_flags = (
        "-s",
        "-w",
        f"-X {ctrd_pkg}/version.Version={versions.CONTAINERD}",
        f"-X {ctrd_pkg}/version.Package={ctrd_pkg}",
    )
    # Static (no cgo) like containerd's release builds; the btrfs, devmapper and zfs
    # snapshotters are left out (overlayfs is what we use).
    ctrd_tags = ("urfave_cli_no_docs", "no_btrfs", "no_devmapper", "no_zfs")
    cni_pkg = "github.com/containernetworking/plugins"
    cni = _module("cni-plugins", f"{cni_pkg} {versions.CNI_PLUGINS}", mod_name="cni")
    cni_flags = (
        "-s",
        "-w",
        f"-X {cni_pkg}/pkg/utils/buildversion.BuildVersion={versions.CNI_PLUGINS}",
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
            _module("runc", f"github.com/opencontainers/runc {versions.RUNC}"),
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
                f"{cni_pkg}/plugins/{cni_dirs[name]}/{name}",
                cni_flags,
                cgo=False,
                subdir="cni-bin",
            )
            for name in versions.CNI_PLUGIN_NAMES
        ),
        Binary("drasil-pause", _pause_module(), ".", ("-s", "-w"), cgo=False),
    )


def kwok_binary() -> Binary:
    """KWOK's controller (`up --fake-nodes`): fake Nodes and their Pods, no kubelet."""
    return Binary(
        "kwok",
        _module("kwok", f"sigs.k8s.io/kwok {versions.KWOK}"),
        "sigs.k8s.io/kwok/cmd/kwok",
        ("-s", "-w", f"-X sigs.k8s.io/kwok/pkg/consts.Version={versions.KWOK.lstrip('v')}"),
        cgo=False,
    )


NVIDIA_TOOLKIT_NAMES = ("nvidia-ctk", "nvidia-cdi-hook")


def nvidia_toolkit_binaries() -> tuple[Binary, ...]:
    """nvidia-ctk (`cdi generate`) and nvidia-cdi-hook, built as NVIDIA's Makefile does:
    cgo (go-nvml dlopens libnvidia-ml.so.1 and calls into it), with the NVML symbols
    left unresolved at link time and bound lazily at the first call."""
    pkg = "github.com/NVIDIA/nvidia-container-toolkit"
    module = _module("nvidia-container-toolkit", f"{pkg} {versions.NVIDIA_CONTAINER_TOOLKIT}")
    flags = (
        "-s",
        "-w",
        "'-extldflags=-Wl,--export-dynamic -Wl,--unresolved-symbols=ignore-in-object-files"
        " -Wl,-z,lazy'",
        f"-X {pkg}/internal/info.version={versions.NVIDIA_CONTAINER_TOOLKIT.lstrip('v')}",
    )
    return tuple(
        Binary(name, module, f"{pkg}/cmd/{name}", flags, cgo=True, needs=("gcc",))
        for name in NVIDIA_TOOLKIT_NAMES
    )


def binaries() -> tuple[Binary, ...]:
    """Every binary the harness provides, in build order."""
    kube = _kubernetes_module()
    kube_flags = _kube_ldflags()
    helm_major = versions.HELM.split(".")[0]
    helm_version_pkg = f"helm.sh/helm/{helm_major}/internal/version"
    etcd = _module("etcd", f"go.etcd.io/etcd/server/v3 {versions.ETCD}", directory="etcd")
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
        Binary("etcd", etcd, ".", ("-s", "-w")),
        Binary(
            "helm",
            _module("helm", f"helm.sh/helm/{helm_major} {versions.HELM}"),
            f"helm.sh/helm/{helm_major}/cmd/helm",
            (
                "-s",
                "-w",
                f"-X {helm_version_pkg}.version={versions.HELM}",
                f"-X {helm_version_pkg}.gitTreeState=clean",
            ),
        ),
        *node_binaries(),
        kwok_binary(),
        Binary("drasil-kubelet-client", _bench_client_module(), ".", ("-s", "-w"), cgo=False),
        # The upstream e2e DRA test driver (kubelet-plugin mode): bench/prepare.py's
        # reference, from the same Kubernetes module as the cluster.
        Binary(
            "dra-test-driver",
            kube,
            "k8s.io/kubernetes/test/e2e/dra/test-driver",
            kube_flags,
            cgo=False,
        ),
        *nvidia_toolkit_binaries(),
    )


BINARY_NAMES = tuple(b.name for b in binaries())
NODE_BINARY_NAMES = ("kubelet", "kubectl", *(b.name for b in node_binaries()))

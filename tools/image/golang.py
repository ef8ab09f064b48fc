"""The Dockerfile's Go image (`GO_IMAGE`, the stage that builds `nvidia-cdi-hook`), made
locally.

No registry is reachable where the tests run, so the public `golang:1.26-bookworm`
cannot be pulled. In its place: Debian 12 minbase with what that image adds for cgo
(`gcc`, `libc6-dev` with the static C library, `ca-certificates`; mmdebstrap, as the
Python base in `tools.image.base`) and the host's Go toolchain (its GOROOT, the one that
builds the Kubernetes binaries, Go 1.26 or newer as the toolkit's go.mod asks) copied to
/usr/local/go, with the public image's `GOPATH=/go`, `PATH` and `GOTOOLCHAIN=local`.

The Debian root is cached as `<cache>/images/drasil/golang-<key>.tar`, keyed like the
Python base (recipe and apt's Release files); the image
`localhost/drasil-base/golang:<go version>-bookworm-<key>` (key: the root's and the
toolchain's) is made from the tar and GOROOT when buildah's storage lacks it. The
module itself comes from the Go module proxy during the build, as for users; the
host's `GOPROXY` and `GOSUMDB` (`go env`) are passed as build arguments.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from e2e.harness import paths
from e2e.harness.binaries import Writer
from tools.image.base import SUITE, debian_key, debootstrap, installed_packages, prune_tars
from tools.image.steps import ImageBuildError, buildah, image_exists, images_dir, run

REPOSITORY = "localhost/drasil-base/golang"
PACKAGES = ("gcc", "libc6-dev", "ca-certificates")
GOROOT = "/usr/local/go"  # as in the public image
GOPATH = "/go"
ENV = (
    f"PATH={GOPATH}/bin:{GOROOT}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    f"GOPATH={GOPATH}",
    "GOTOOLCHAIN=local",
    "LANG=C.UTF-8",
)
# nvidia-container-toolkit v1.20.2's go.mod says `go 1.26.0`.
MIN_GO = (1, 26)
# The module proxy settings the build stage takes as build arguments (Dockerfile).
PROXY_ENV = ("GOPROXY", "GOSUMDB")


@dataclass(frozen=True)
class HostGo:
    """The host's Go toolchain, as `go env` reports it."""

    go: Path
    goroot: Path
    version: str  # go1.26.8
    arch: str  # amd64
    proxy: dict[str, str]  # GOPROXY, GOSUMDB (only those set)

    @property
    def tag_version(self) -> str:
        return self.version.removeprefix("go")

    def build_args(self) -> list[str]:
        """The module proxy settings as `buildah bud` arguments."""
        return [f"--build-arg={k}={v}" for k, v in sorted(self.proxy.items())]


def find_go() -> Path:
    """`DRASIL_GO`, else `go` on PATH, else /usr/local/go/bin/go (as e2e.harness.binaries)."""
    explicit = os.environ.get("DRASIL_GO")
    for c in [explicit] if explicit else [shutil.which("go"), "/usr/local/go/bin/go"]:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    raise ImageBuildError(
        "the image's hook stage needs a Go toolchain: no `go` on PATH nor "
        "/usr/local/go/bin/go (set DRASIL_GO to its path)"
    )


def host_go() -> HostGo:
    go = find_go()
    names = ["GOROOT", "GOVERSION", "GOARCH", *PROXY_ENV]
    found = json.loads(run("go env", [str(go), "env", "-json", *names]))
    version = str(found["GOVERSION"])
    match = re.match(r"go(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) < MIN_GO:
        raise ImageBuildError(
            f"{go} is {version}; nvidia-cdi-hook needs Go {'.'.join(map(str, MIN_GO))} or "
            "newer (set DRASIL_GO to a newer toolchain)"
        )
    return HostGo(
        go=go,
        goroot=Path(found["GOROOT"]),
        version=version,
        arch=str(found["GOARCH"]),
        proxy={k: str(found[k]) for k in PROXY_ENV if found.get(k)},
    )


def go_key(host: HostGo) -> str:
    """The Debian root's key and the toolchain's version and architecture."""
    recipe = {"debian": debian_key(PACKAGES), "go": host.version, "arch": host.arch, "env": ENV}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def go_image(host: HostGo, out: Writer) -> str:
    """The local Go image's name, built (or made from the cached tar) if missing."""
    key = go_key(host)
    name = f"{REPOSITORY}:{host.tag_version}-{SUITE}-{key}"
    if image_exists(name):
        return name
    tar = images_dir() / f"golang-{debian_key(PACKAGES)}.tar"
    if not tar.exists():
        print(
            f"image: Go base {name} from Debian's packages (mmdebstrap) and {host.goroot}",
            file=out,
            flush=True,
        )
        debootstrap(tar, PACKAGES)
    print(f"image: importing {tar.name} and {host.goroot} as {name}", file=out, flush=True)
    _import(tar, host, name)
    prune_tars("golang-*.tar", keep=tar)
    return name


def _import(tar: Path, host: HostGo, name: str) -> None:
    container = buildah("buildah from scratch", "from", "--quiet", "scratch").strip()
    try:
        root = Path(buildah("buildah mount", "mount", container).strip())
        run("unpack the Go base", ["tar", "--numeric-owner", "-xpf", str(tar), "-C", str(root)])
        packages = installed_packages(root)
        paths.write_atomic(tar.with_suffix(".json"), json.dumps(packages, indent=1))
        target = root / GOROOT.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        run("copy the host's GOROOT", ["cp", "-a", f"{host.goroot}/.", f"{target}/"])
        gopath = root / GOPATH.lstrip("/")
        gopath.mkdir(exist_ok=True)
        gopath.chmod(0o777)  # as in the public image
        buildah("buildah umount", "umount", container)
        config = ["--os=linux", f"--arch={host.arch}", "--cmd=bash", "--workingdir=/go"]
        config += [f"--env={e}" for e in ENV]
        config += [
            f"--label=org.opencontainers.image.description=Debian 12 with gcc and the "
            f"host's {host.version} (drasil's local stand-in for golang:1.26-bookworm)",
            f"--label=dev.drasil.go.version={host.version}",
            f"--label=dev.drasil.debian.gcc={packages.get('gcc', '?')}",
        ]
        buildah("buildah config", "config", *config, container)
        buildah("buildah commit", "commit", "--quiet", "--rm", container, name)
    except BaseException:
        buildah("buildah rm", "rm", container)
        raise

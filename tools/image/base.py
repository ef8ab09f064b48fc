"""The Dockerfile's base image, built locally from Debian 12's packages.

No registry is reachable where the tests run, so the public `python:3.11-slim-bookworm`
cannot be pulled. In its place: `mmdebstrap --variant=minbase bookworm` (dpkg, apt,
coreutils, bash: what Debian's slim images hold) with Debian's own Python 3.11
(`python3.11`, `python3-minimal` for `/usr/bin/python3`, `python3.11-venv` for the
stdlib's `venv`/`ensurepip`, which the public image has too) and `passwd` (`useradd`),
documentation, manuals and locales left out as in Debian's slim images, `/usr` merged
by mmdebstrap's own hook (not the `usrmerge` package, which drags in Perl).

The root filesystem is cached as `base-<key>.tar` (and `.json`: the packages in it);
the key is this recipe and apt's package indexes (their Release files), so an
`apt-get update` that brings new packages makes a new base. The image is
`localhost/drasil-base/python:3.11-bookworm-<key>` in buildah's storage, made from the
tar (`buildah from scratch`, mount, unpack, commit) when missing.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from e2e.harness import paths
from e2e.harness.binaries import Writer
from tools.image.steps import (
    ImageBuildError,
    buildah,
    ensure_tools,
    image_exists,
    images_dir,
    run,
)

REPOSITORY = "localhost/drasil-base/python"
SUITE = "bookworm"
PACKAGES = ("python3.11", "python3-minimal", "python3.11-venv", "passwd")
# What Debian's slim images leave out; copyright files stay, as Debian's licences ask.
DPKG_OPTIONS = (
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/lintian/*",
)
MERGED_USR_HOOK = "/usr/share/mmdebstrap/hooks/merged-usr"
ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8")
APT_LISTS = Path("/var/lib/apt/lists")


def mmdebstrap_args(target: Path, packages: Sequence[str] = PACKAGES) -> list[str]:
    """Debian 12 minbase with `packages`, slimmed like Debian's slim images, as a tar."""
    return [
        "mmdebstrap",
        "--variant=minbase",
        "--mode=root",
        "--format=tar",
        f"--hook-dir={MERGED_USR_HOOK}",
        f"--include={','.join(packages)}",
        *(f"--dpkgopt={o}" for o in DPKG_OPTIONS),
        "--aptopt=Acquire::Languages none",
        SUITE,
        str(target),
    ]


def _release_files() -> list[Path]:
    if not any(APT_LISTS.glob("*Release")):
        run("apt-get update (no package lists yet)", ["apt-get", "update", "-q"])
    return sorted(APT_LISTS.glob("*Release"))


def debian_key(packages: Sequence[str] = PACKAGES) -> str:
    """The recipe of a root with `packages` and the state of apt's package indexes
    (mmdebstrap uses the host's sources)."""
    sha = hashlib.sha256(json.dumps(mmdebstrap_args(Path("-"), packages)).encode())
    for release in _release_files():
        sha.update(release.name.encode() + hashlib.sha256(release.read_bytes()).digest())
    return sha.hexdigest()[:16]


def base_key() -> str:
    """The key of the Python base: its recipe and apt's package indexes."""
    return debian_key(PACKAGES)


def base_image(out: Writer) -> str:
    """The local base image's name, built (or imported from the cached tar) if missing."""
    key = base_key()
    name = f"{REPOSITORY}:3.11-{SUITE}-{key}"
    if image_exists(name):
        return name
    tar = images_dir() / f"base-{key}.tar"
    if not tar.exists():
        print(f"image: base {name} from Debian's packages (mmdebstrap)", file=out, flush=True)
        debootstrap(tar, PACKAGES)
    print(f"image: importing {tar.name} as {name}", file=out, flush=True)
    _import(tar, name)
    prune_tars("base-*.tar", keep=tar)
    return name


def debootstrap(tar: Path, packages: Sequence[str]) -> None:
    """`tar`: a Debian 12 root with `packages` (mmdebstrap), written atomically."""
    tmp = tar.with_name(f".{tar.name}.tmp-{os.getpid()}")
    try:
        run("mmdebstrap", mmdebstrap_args(tmp, packages))
        os.replace(tmp, tar)
    finally:
        tmp.unlink(missing_ok=True)


def _import(tar: Path, name: str) -> None:
    container = buildah("buildah from scratch", "from", "--quiet", "scratch").strip()
    try:
        root = buildah("buildah mount", "mount", container).strip()
        run("unpack the base", ["tar", "--numeric-owner", "-xpf", str(tar), "-C", root])
        packages = installed_packages(Path(root))
        paths.write_atomic(tar.with_suffix(".json"), json.dumps(packages, indent=1))
        buildah("buildah umount", "umount", container)
        config = ["--os=linux", "--arch=amd64", "--cmd=python3"]
        config += [f"--env={e}" for e in ENV]
        config += [
            "--label=org.opencontainers.image.description=Debian 12 with its python3.11 "
            "(drasil's local stand-in for python:3.11-slim-bookworm)",
            f"--label=dev.drasil.debian.python3.11={packages.get('python3.11', '?')}",
        ]
        buildah("buildah config", "config", *config, container)
        buildah("buildah commit", "commit", "--quiet", "--rm", container, name)
    except BaseException:
        buildah("buildah rm", "rm", container)
        raise


def installed_packages(root: Path) -> dict[str, str]:
    """name -> version of every package dpkg installed in `root`."""
    status = (root / "var/lib/dpkg/status").read_text()
    found: dict[str, str] = {}
    for record in status.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in record.splitlines() if ": " in line)
        if "Package" in fields and "installed" in fields.get("Status", ""):
            found[fields["Package"]] = fields.get("Version", "?")
    return dict(sorted(found.items()))


def prune_tars(pattern: str, *, keep: Path) -> None:
    """Only the newest root tar of a kind stays (the Python base's is ~130 MB)."""
    for old in images_dir().glob(pattern):
        if old != keep:
            old.with_suffix(".json").unlink(missing_ok=True)
            old.unlink(missing_ok=True)


def require_tools(out: Writer) -> None:
    """buildah and mmdebstrap, installed with apt-get when missing."""
    ensure_tools(["buildah", "mmdebstrap"], out)
    if not Path(MERGED_USR_HOOK).is_dir():
        raise ImageBuildError(f"mmdebstrap has no {MERGED_USR_HOOK} (needs mmdebstrap >= 1.1)")

"""`build_image()`: the Dockerfile built with buildah, as an image in buildah's local
storage and an OCI archive in the cache.

The key of a build is everything it is made of: the Dockerfile and .dockerignore, the
files of the build context (what .dockerignore lets through: constraints.txt,
pyproject.toml, README.md and the four packages), the two base images' keys, the Go
module proxy settings, the version (pyproject.toml) and the git revision the labels
name. A warm call hashes those (well under a second) and finds `drasil-<key>.oci.tar`
and its `.json` in the cache; a cold one builds the bases if needed (`tools.image.base`,
`tools.image.golang`), runs `buildah bud` with the local bases as `PYTHON_IMAGE` and
`GO_IMAGE`, and pushes the image to the archive. The newest three archives stay. The
hook stage's Go module and build caches are buildah cache mounts: after the first
build, a rebuild (changed code) links `nvidia-cdi-hook` again in seconds.

The build's pip and Go trust what the host's pip trusts: when the host configures a CA
bundle for pip (`PIP_CERT`, `REQUESTS_CA_BUNDLE`, `SSL_CERT_FILE` or `cert` in
/etc/pip.conf, as behind a proxy that intercepts TLS), the bundle and a pip.conf naming
it are mounted read-only at /mnt of the RUN steps, `PIP_CONFIG_FILE` points there and
`SSL_CERT_FILE` names the bundle (build arguments of the build and hook stages only:
nothing of it reaches the image).
"""

from __future__ import annotations

import configparser
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e.harness import paths
from e2e.harness.binaries import Writer
from tools.image import base, golang, steps
from tools.image.steps import ImageBuildError, buildah, images_dir

REPOSITORY = "localhost/drasil"
DOCKERFILE = paths.CHECKOUT / "Dockerfile"
IGNORE_FILE = paths.CHECKOUT / ".dockerignore"
# What the Dockerfile copies (the same list .dockerignore lets through).
CONTEXT = (
    "constraints.txt",
    "pyproject.toml",
    "README.md",
    "api",
    "driver",
    "kubeletplugin",
    "controller",
)
SKIPPED_PARTS = frozenset({"__pycache__", ".mypy_cache"})
SOURCE = "https://github.com/drasil-dev/drasil"
KEEP_ARCHIVES = 3  # each is ~90 MB
HERE = Path(__file__).resolve()
MNT = "/mnt"  # exists in both bases: a mount there leaves no mount point behind


@dataclass(frozen=True)
class LocalImage:
    """A built image: its name in buildah's storage, its OCI archive in the cache."""

    name: str  # localhost/drasil:<version>-<key>
    archive: Path
    manifest_digest: str
    config: dict[str, Any]  # the image config (its "config" holds Env, User, Labels)
    layers: tuple[str, ...]  # blob digests, base first
    annotations: dict[str, str]  # of the manifest

    @property
    def repository(self) -> str:
        return self.name.rsplit(":", 1)[0]

    @property
    def tag(self) -> str:
        return self.name.rsplit(":", 1)[1]

    @property
    def version(self) -> str:
        return self.annotations["org.opencontainers.image.version"]


def dockerfile_arg(name: str) -> str:
    """The default of `ARG name=...` in the Dockerfile (the version pins the tests read)."""
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    if match is None:
        raise ImageBuildError(f"the Dockerfile has no ARG {name}=...")
    return match[1]


def project_version(root: Path = paths.CHECKOUT) -> str:
    with open(root / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def context_files(root: Path = paths.CHECKOUT) -> list[Path]:
    files: list[Path] = []
    for part in CONTEXT:
        path = root / part
        if path.is_file():
            files.append(path)
            continue
        for found in path.rglob("*"):
            rel = found.relative_to(root)
            if found.is_file() and not SKIPPED_PARTS & set(rel.parts) and found.suffix != ".pyc":
                files.append(found)
    return files


def revision(root: Path = paths.CHECKOUT) -> str:
    """The git commit the build context is, `-dirty` when it differs from it."""
    git = ["git", "-C", str(root)]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
        changed = subprocess.run(
            [*git, "status", "--porcelain", "--", *CONTEXT, "Dockerfile", ".dockerignore"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"  # not a git checkout (a source tarball)
    return f"{head}-dirty" if changed else head


def image_annotations(version: str, rev: str) -> dict[str, str]:
    return {
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.revision": rev,
        "org.opencontainers.image.source": SOURCE,
    }


def _key(root: Path, base_key: str, go: golang.HostGo, notes: dict[str, str]) -> str:
    recipe = {
        "format": steps.FORMAT,
        "builder": hashlib.sha256(HERE.read_bytes()).hexdigest(),
        "dockerfile": steps.hash_files(
            [root / DOCKERFILE.name, root / IGNORE_FILE.name], root=root
        ),
        "context": steps.hash_files(context_files(root), root=root),
        "base": base_key,
        "go": [golang.go_key(go), go.build_args()],
        "annotations": notes,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def build_image(
    *, out: Writer | None = None, root: Path = paths.CHECKOUT, rev: str | None = None
) -> LocalImage:
    """The image (from the cache, else built into it); its archive and name.

    ``root``: the source tree, this checkout unless another is given (the upgrade test
    builds an earlier commit's tree, exported without git: ``rev`` names its commit)."""
    progress = out if out is not None else sys.stderr
    with steps.lock():
        base.require_tools(progress)
        version = project_version(root)
        notes = image_annotations(version, rev or revision(root))
        go = golang.host_go()
        key = _key(root, base.base_key(), go, notes)
        name = f"{REPOSITORY}:{version}-{key}"
        archive = images_dir() / f"drasil-{key}.oci.tar"
        meta = archive.with_suffix(".json")
        if archive.exists() and meta.exists():
            _mark_used(archive)
            image = _load(archive, meta)
            if not steps.image_exists(name):  # storage wiped since: restore it
                buildah("buildah pull", "pull", "--quiet", f"oci-archive:{archive}")
            return image
        base_name = base.base_image(progress)
        go_name = golang.go_image(go, progress)
        print(f"image: buildah bud -> {name}", file=progress, flush=True)
        _bud(root, name, (base_name, go_name), go, notes)
        _push(name, archive, progress)
        _prune()
        return _load(archive, meta)


def _bud(
    root: Path, name: str, bases: tuple[str, str], go: golang.HostGo, notes: dict[str, str]
) -> None:
    base_name, go_name = bases
    args = [
        "bud",
        "--quiet",
        f"--isolation={steps.ISOLATION}",
        f"--file={root / DOCKERFILE.name}",
        f"--tag={name}",
        f"--build-arg=PYTHON_IMAGE={base_name}",
        f"--build-arg=GO_IMAGE={go_name}",
        *go.build_args(),
        f"--build-arg=VERSION={notes['org.opencontainers.image.version']}",
        f"--build-arg=REVISION={notes['org.opencontainers.image.revision']}",
        f"--build-arg=SOURCE={notes['org.opencontainers.image.source']}",
        *(f"--annotation={k}={v}" for k, v in notes.items()),
    ]
    with tempfile.TemporaryDirectory(prefix="drasil-image-pip-") as tmp:
        args += _host_pip_trust(Path(tmp))
        buildah("buildah bud", *args, str(root))


def _host_ca_bundle() -> Path | None:
    for var in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        value = os.environ.get(var)
        if value and Path(value).is_file():
            return Path(value)
    config = configparser.ConfigParser()
    config.read(["/etc/pip.conf", "/etc/xdg/pip/pip.conf"])
    cert = config.get("global", "cert", fallback="")
    return Path(cert) if cert and Path(cert).is_file() else None


def _host_pip_trust(tmp: Path) -> list[str]:
    """bud arguments that make the build's pip and Go trust the host pip's CA bundle."""
    bundle = _host_ca_bundle()
    if bundle is None:
        return []
    shutil.copyfile(bundle, tmp / "ca.crt")
    (tmp / "pip.conf").write_text(f"[global]\ncert = {MNT}/ca.crt\n")
    tmp.chmod(0o755)
    return [
        f"--volume={tmp}:{MNT}:ro",
        f"--build-arg=PIP_CONFIG_FILE={MNT}/pip.conf",
        f"--build-arg=SSL_CERT_FILE={MNT}/ca.crt",
    ]


def _push(name: str, archive: Path, out: Writer) -> None:
    """The image as an OCI archive (gzip layers) whose index names it `name`."""
    tmp = archive.with_name(f".{archive.name}.tmp-{os.getpid()}")
    try:
        buildah("buildah push", "push", "--quiet", name, f"oci-archive:{tmp}:{name}")
        manifest, config = _read_archive(tmp)
        meta = {
            "name": name,
            "manifest": manifest,
            "config": config,
        }
        os.replace(tmp, archive)
    finally:
        tmp.unlink(missing_ok=True)
    paths.write_atomic(archive.with_suffix(".json"), json.dumps(meta, indent=1))
    size = archive.stat().st_size / 1e6
    print(f"image: {name} -> {archive} ({size:.0f} MB)", file=out, flush=True)


def _read_archive(archive: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest and config of the one image in an OCI archive."""
    with tarfile.open(archive) as tar:

        def blob(digest: str) -> dict[str, Any]:
            f = tar.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}")
            if f is None:
                raise ImageBuildError(f"{archive}: no blob {digest}")
            data: dict[str, Any] = json.load(f)
            return data

        index = tar.extractfile("index.json")
        if index is None:
            raise ImageBuildError(f"{archive}: no index.json")
        (entry,) = json.load(index)["manifests"]
        manifest = blob(entry["digest"])
        manifest["digest"] = entry["digest"]
        return manifest, blob(manifest["config"]["digest"])


def _load(archive: Path, meta_path: Path) -> LocalImage:
    meta = json.loads(meta_path.read_text())
    manifest = meta["manifest"]
    return LocalImage(
        name=meta["name"],
        archive=archive,
        manifest_digest=manifest["digest"],
        config=meta["config"],
        layers=tuple(layer["digest"] for layer in manifest["layers"]),
        annotations=manifest.get("annotations") or {},
    )


def _mark_used(archive: Path) -> None:
    """The archive counts as new again for ``_prune`` (which orders archives by their
    mtime): an image every test run takes from the cache (the upgrade test's earlier
    release) then outlives the builds of newer commits, instead of being built again
    after the next KEEP_ARCHIVES of them."""
    os.utime(archive)


def _prune() -> None:
    """Drop all but the most recently used archives (built, or taken from the cache),
    with their images in buildah's storage."""
    found = sorted(
        images_dir().glob("drasil-*.oci.tar"), key=lambda f: f.stat().st_mtime, reverse=True
    )
    for old in found[KEEP_ARCHIVES:]:
        meta = old.with_suffix(".json")
        try:
            name = json.loads(meta.read_text())["name"]
        except (OSError, ValueError, KeyError):
            name = None
        if name and steps.image_exists(name):
            buildah("buildah rmi", "rmi", name)
        meta.unlink(missing_ok=True)
        old.unlink(missing_ok=True)

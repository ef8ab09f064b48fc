"""Container images for the node, built as OCI archives without any registry.

No registry is reachable from the machines this runs on, so the two images the node
needs are written here, byte by byte, as OCI image layouts (`oci-layout`, `index.json`,
`blobs/sha256/...`: one uncompressed tar layer, a config, a manifest) packed into a tar,
which `ctr -n k8s.io images import` loads into containerd:

- the pause image (`versions.PAUSE_IMAGE`): our static `drasil-pause` binary (built by
  `e2e.build` from a few lines of Go), the sandbox image containerd runs for every Pod;
- the test image (`versions.TEST_IMAGE`): busybox from Debian's `busybox-static`
  package (fetched with `apt-get download`, no install), with its applet links,
  `/etc/passwd`, `/etc/group` and `/tmp`. Default command `sh`.

Archives are cached in `<cache>/e2e/<version>/images/` with a stamp of what they were
built from; a warm call touches neither apt nor Go. Everything in an archive is
deterministic (sorted entries, fixed mtimes), so the image IDs do not change between
builds of the same inputs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from e2e import binaries, paths, versions

# Bump when the layout written here changes: every archive is rebuilt.
FORMAT = 2
STAMP_NAME = ".stamp.json"
MTIME = 0
ANNOTATION_NAME = "io.containerd.image.name"
ANNOTATION_REF = "org.opencontainers.image.ref.name"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Applets a test or a user in `kubectl exec` reaches for; the rest come from
# `busybox --list-full` when the binary runs here.
FALLBACK_APPLETS = (
    "bin/sh",
    "bin/cat",
    "bin/echo",
    "bin/ls",
    "bin/sleep",
    "bin/env",
    "usr/bin/env",
    "bin/printenv",
    "bin/grep",
    "bin/ps",
    "bin/mount",
    "bin/hostname",
    "bin/true",
    "bin/false",
    "usr/bin/tail",
    "usr/bin/head",
)


PASSWD = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"


class ImageError(RuntimeError):
    """An image could not be built; says which step and why."""


@dataclass(frozen=True)
class Image:
    """One OCI archive in the cache and the image name it carries."""

    name: str
    archive: Path


@dataclass(frozen=True)
class _File:
    path: str  # relative, no leading slash
    mode: int
    data: bytes = b""
    link: str | None = None  # a symlink target
    directory: bool = False


def images_dir() -> Path:
    return paths.version_dir() / "images"


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _tar_bytes(files: Iterable[_File]) -> bytes:
    """A deterministic tar: sorted, root-owned, fixed mtime, parents before children."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for f in sorted(files, key=lambda f: f.path):
            info = tarfile.TarInfo(f.path)
            info.mtime = MTIME
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mode = f.mode
            if f.directory:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif f.link is not None:
                info.type = tarfile.SYMTYPE
                info.linkname = f.link
                tar.addfile(info)
            else:
                info.size = len(f.data)
                tar.addfile(info, io.BytesIO(f.data))
    return buf.getvalue()


def _with_parents(files: list[_File]) -> list[_File]:
    """Add a directory entry for every parent that has none."""
    have = {f.path for f in files}
    dirs: set[str] = set()
    for f in files:
        parts = f.path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    return files + [_File(d, 0o755, directory=True) for d in sorted(dirs - have)]


def oci_archive(
    *, name: str, files: list[_File], entrypoint: list[str] | None, cmd: list[str] | None = None
) -> bytes:
    """An OCI image layout of one layer, as a tar, named `name` for containerd."""
    layer = _tar_bytes(_with_parents(files))
    layer_digest = _sha256(layer)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {
            "Env": [f"PATH={DEFAULT_PATH}"],
            **({"Entrypoint": entrypoint} if entrypoint else {}),
            **({"Cmd": cmd} if cmd else {}),
            "WorkingDir": "/",
        },
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "drasil e2e.node_images"}],
    }
    config_bytes = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {
            "mediaType": MEDIA_CONFIG,
            "digest": _sha256(config_bytes),
            "size": len(config_bytes),
        },
        "layers": [{"mediaType": MEDIA_LAYER, "digest": layer_digest, "size": len(layer)}],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    tag = name.rsplit(":", 1)[1]
    index = {
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [
            {
                "mediaType": MEDIA_MANIFEST,
                "digest": _sha256(manifest_bytes),
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                # ctr names the image after the first annotation; other tools read the
                # second (a tag only).
                "annotations": {ANNOTATION_NAME: name, ANNOTATION_REF: tag},
            }
        ],
    }
    blobs = [layer, config_bytes, manifest_bytes]
    layout = [
        _File("oci-layout", 0o644, json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
        _File("index.json", 0o644, json.dumps(index, sort_keys=True).encode()),
        *(_File(f"blobs/sha256/{_sha256(b)[7:]}", 0o644, b) for b in blobs),
    ]
    return _tar_bytes(_with_parents(layout))


# -- the two images ----------------------------------------------------------------


def pause_files(pause_binary: Path) -> list[_File]:
    return [_File("pause", 0o755, pause_binary.read_bytes())]


def _run(step: str, cmd: list[str], *, cwd: Path | None = None) -> bytes:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, check=False, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ImageError(f"{step}: {' '.join(cmd)}: {e}") from e
    if done.returncode != 0:
        raise ImageError(
            f"{step}: `{' '.join(cmd)}` exited {done.returncode}:\n"
            f"{done.stderr.decode(errors='replace')[-2000:]}"
        )
    return done.stdout


def _download_deb(package: str, into: Path, out: binaries.Writer) -> Path:
    """`apt-get download` (no install, no root needed for the file); runs
    `apt-get update` once first if the package lists are empty or stale."""
    if shutil.which("apt-get") is None:
        raise ImageError(
            f"the test image needs Debian's {package} package and there is no apt-get here; "
            "this harness expects a Debian/Ubuntu machine"
        )
    try:
        _run(f"download {package}", ["apt-get", "download", package], cwd=into)
    except ImageError:
        print(f"e2e.node_images: apt-get update (to find {package})", file=out, flush=True)
        _run("apt-get update", ["apt-get", "update", "-qq"])
        _run(f"download {package}", ["apt-get", "download", package], cwd=into)
    debs = sorted(into.glob(f"{package}_*.deb"))
    if not debs:
        raise ImageError(f"apt-get download {package} wrote no .deb into {into}")
    return debs[-1]


def _deb_version(deb: Path) -> str:
    return _run("read .deb version", ["dpkg-deb", "-f", str(deb), "Version"]).decode().strip()


def _busybox_from_deb(deb: Path) -> bytes:
    data = _run("unpack .deb", ["dpkg-deb", "--fsys-tarfile", str(deb)])
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            if member.name.lstrip("./") in ("bin/busybox", "usr/bin/busybox") and member.isfile():
                f = tar.extractfile(member)
                if f is not None:
                    return f.read()
    raise ImageError(f"{deb} has no bin/busybox")


def _applets(busybox: bytes) -> list[str]:
    """Paths of busybox's applets, from the binary itself if it runs here."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "busybox"
        exe.write_bytes(busybox)
        exe.chmod(0o755)
        try:
            listed = subprocess.run(
                [str(exe), "--list-full"], capture_output=True, text=True, timeout=30, check=True
            ).stdout.split()
        except (OSError, subprocess.SubprocessError):
            listed = []
    return sorted(set(listed) | set(FALLBACK_APPLETS))


def busybox_files(busybox: bytes) -> list[_File]:
    files = [_File("bin/busybox", 0o755, busybox)]
    for applet in _applets(busybox):
        if applet == "bin/busybox":
            continue
        files.append(_File(applet, 0o777, link="/bin/busybox"))
    files += [
        _File("etc/passwd", 0o644, PASSWD),
        _File("etc/group", 0o644, b"root:x:0:\nnogroup:x:65534:\n"),
        _File("etc/hostname", 0o644, b"busybox\n"),
        _File("root", 0o700, directory=True),
        _File("tmp", 0o1777, directory=True),
        _File("proc", 0o555, directory=True),
        _File("sys", 0o555, directory=True),
        _File("dev", 0o755, directory=True),
    ]
    return files


# -- cache -------------------------------------------------------------------------


def _read_stamp() -> dict[str, dict[str, object]]:
    try:
        data = json.loads((images_dir() / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _recipe(*parts: object) -> str:
    return hashlib.sha256(json.dumps([FORMAT, *parts], sort_keys=True).encode()).hexdigest()


def _cached(key: str, recipe: str, stamp: dict[str, dict[str, object]]) -> Path | None:
    entry = stamp.get(key) or {}
    archive = images_dir() / str(entry.get("archive", ""))
    if entry.get("recipe") != recipe or not archive.is_file():
        return None
    return archive if archive.stat().st_size == entry.get("size") else None


def _archive_name(image: str, suffix: str = "") -> str:
    repo, tag = image.rsplit("/", 1)[-1].rsplit(":", 1)
    return f"{repo}-{tag}{suffix}.oci.tar"


def ensure_images(*, out: binaries.Writer | None = None) -> dict[str, Image]:
    """The pause and test image archives ("pause", "test"), built if missing or stale.

    Raises ImageError (or binaries.BuildError for the pause binary) naming the step."""
    progress = out if out is not None else sys.stderr
    pause_bin = binaries.ensure_binaries(["drasil-pause"], out=progress)["drasil-pause"]
    pause_digest = hashlib.sha256(pause_bin.read_bytes()).hexdigest()
    pause_recipe = _recipe(versions.PAUSE_IMAGE, pause_digest)
    # The test image's real input (the .deb) is only known after downloading it; the
    # stamp records which package version the cached archive holds.
    test_recipe = _recipe(versions.TEST_IMAGE, versions.BUSYBOX_DEBIAN_PACKAGE)
    stamp = _read_stamp()
    pause = _cached("pause", pause_recipe, stamp)
    test = _cached("test", test_recipe, stamp)
    if pause is not None and test is not None:
        return {
            "pause": Image(versions.PAUSE_IMAGE, pause),
            "test": Image(versions.TEST_IMAGE, test),
        }
    with _lock(progress):
        images_dir().mkdir(parents=True, exist_ok=True)
        stamp = _read_stamp()
        if _cached("pause", pause_recipe, stamp) is None:
            started = time.monotonic()
            data = oci_archive(
                name=versions.PAUSE_IMAGE, files=pause_files(pause_bin), entrypoint=["/pause"]
            )
            archive = images_dir() / _archive_name(versions.PAUSE_IMAGE)
            _write_atomic(archive, data)
            stamp["pause"] = {"recipe": pause_recipe, "archive": archive.name, "size": len(data)}
            _write_atomic(images_dir() / STAMP_NAME, json.dumps(stamp, indent=2).encode())
            print(
                f"e2e.node_images: {versions.PAUSE_IMAGE} -> {archive} "
                f"({time.monotonic() - started:.1f}s)",
                file=progress,
                flush=True,
            )
        if _cached("test", test_recipe, stamp) is None:
            started = time.monotonic()
            debs = images_dir() / "debs"
            shutil.rmtree(debs, ignore_errors=True)
            debs.mkdir()
            binaries.ensure_host_tools(["dpkg-deb"], out=progress)
            deb = _download_deb(versions.BUSYBOX_DEBIAN_PACKAGE, debs, progress)
            deb_version = _deb_version(deb)
            data = oci_archive(
                name=versions.TEST_IMAGE,
                files=busybox_files(_busybox_from_deb(deb)),
                entrypoint=[],
                cmd=["sh"],
            )
            archive = images_dir() / _archive_name(versions.TEST_IMAGE)
            _write_atomic(archive, data)
            shutil.rmtree(debs, ignore_errors=True)
            stamp["test"] = {
                "recipe": test_recipe,
                "archive": archive.name,
                "size": len(data),
                "debian_package": f"{versions.BUSYBOX_DEBIAN_PACKAGE}={deb_version}",
            }
            _write_atomic(images_dir() / STAMP_NAME, json.dumps(stamp, indent=2).encode())
            print(
                f"e2e.node_images: {versions.TEST_IMAGE} (busybox {deb_version}) -> {archive} "
                f"({time.monotonic() - started:.1f}s)",
                file=progress,
                flush=True,
            )
    return {
        "pause": Image(versions.PAUSE_IMAGE, images_dir() / str(stamp["pause"]["archive"])),
        "test": Image(versions.TEST_IMAGE, images_dir() / str(stamp["test"]["archive"])),
    }


@contextlib.contextmanager
def _lock(out: binaries.Writer) -> Iterator[None]:
    with binaries.build_lock(paths.version_dir(), out):
        yield

"""Container images for the node, built with buildah without any registry.

No registry is reachable from the machines this runs on, so the two images the node
needs are built `FROM scratch` by buildah (a Containerfile that copies a prepared root
filesystem, `--timestamp 0`: the same inputs give the same image) and pushed as OCI
archives, which `ctr -n k8s.io images import` loads into containerd:

- the pause image (`versions.PAUSE_IMAGE`): our static `drasil-pause` binary (built by
  `e2e.build` from e2e/go/pause/main.go), the sandbox image containerd runs for every Pod;
- the test image (`versions.TEST_IMAGE`): busybox from Debian's `busybox-static`
  package (fetched with `apt-get download`, no install), with its applet links,
  `/etc/passwd`, `/etc/group` and `/tmp`. Default command `sh`.

Archives are cached in `<cache>/e2e/<version>/images/` with a stamp of what they were
built from; a warm call touches neither apt, Go nor buildah.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from e2e import binaries, paths, versions

# Bump when the layout written here changes: every archive is rebuilt.
FORMAT = 3
STAMP_NAME = ".stamp.json"
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
FILES = {
    "etc/passwd": PASSWD,
    "etc/group": b"root:x:0:\nnogroup:x:65534:\n",
    "etc/hostname": b"busybox\n",
}
DIRECTORIES = (
    ("bin", 0o755),
    ("etc", 0o755),
    ("root", 0o700),
    ("tmp", 0o1777),
    ("proc", 0o555),
    ("sys", 0o555),
    ("dev", 0o755),
)


class ImageError(RuntimeError):
    """An image could not be built; says which step and why."""


@dataclass(frozen=True)
class Image:
    """One OCI archive in the cache and the image name it carries."""

    name: str
    archive: Path


def images_dir() -> Path:
    return paths.version_dir() / "images"


# -- the two images ----------------------------------------------------------------


def pause_root(pause_binary: Path) -> Callable[[Path], None]:
    def write(root: Path) -> None:
        shutil.copyfile(pause_binary, root / "pause")
        (root / "pause").chmod(0o755)

    return write


def _run(
    step: str, cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> bytes:
    try:
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, check=False, timeout=600)
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


def busybox_root(busybox: bytes) -> Callable[[Path], None]:
    def write(root: Path) -> None:
        for directory, mode in DIRECTORIES:
            (root / directory).mkdir(parents=True, exist_ok=True)
            (root / directory).chmod(mode)
        (root / "bin" / "busybox").write_bytes(busybox)
        (root / "bin" / "busybox").chmod(0o755)
        for applet in _applets(busybox):
            link = root / applet
            if applet != "bin/busybox" and not os.path.lexists(link):
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to("/bin/busybox")
        for name, content in FILES.items():
            (root / name).write_bytes(content)
            (root / name).chmod(0o644)

    return write


# -- cache -------------------------------------------------------------------------


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


def _write_image(
    name: str,
    write_root: Callable[[Path], None],
    *,
    entrypoint: list[str] | None = None,
    cmd: list[str],
) -> Image:
    """The archive of image `name` in the cache: buildah `FROM scratch`, one layer of
    the root filesystem `write_root` fills."""
    archive = images_dir() / _archive_name(name)
    lines = ["FROM scratch", "COPY root/ /", f"ENV PATH={DEFAULT_PATH}"]
    if entrypoint:
        lines.append(f"ENTRYPOINT {json.dumps(entrypoint)}")
    if cmd:
        lines.append(f"CMD {json.dumps(cmd)}")
    with tempfile.TemporaryDirectory(dir=images_dir()) as tmp:
        context = Path(tmp)
        (context / "root").mkdir()
        write_root(context / "root")
        (context / "Containerfile").write_text("\n".join(lines) + "\n")
        env = {**os.environ, "BUILDAH_ISOLATION": "chroot"}
        bud = ["buildah", "bud", "--quiet", "--timestamp=0", f"--tag={name}", str(context)]
        _run(f"buildah bud {name}", bud, env=env)
        tmp_archive = context / "image.oci.tar"
        push = ["buildah", "push", "--quiet", name, f"oci-archive:{tmp_archive}:{name}"]
        _run(f"buildah push {name}", push, env=env)
        _run(f"buildah rmi {name}", ["buildah", "rmi", name], env=env)
        os.replace(tmp_archive, archive)
    return Image(name, archive)


def _built(
    stamp: dict[str, dict[str, object]],
    key: str,
    image: Image,
    out: binaries.Writer,
    **entry: object,
) -> None:
    """Record `image` as the cached image `key`, and say so."""
    size = image.archive.stat().st_size
    stamp[key] = {"archive": image.archive.name, "size": size, **entry}
    paths.write_atomic(images_dir() / STAMP_NAME, json.dumps(stamp, indent=2))
    print(f"e2e.node_images: {image.name} -> {image.archive}", file=out, flush=True)


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
    stamp = paths.read_stamp(images_dir() / STAMP_NAME)
    pause = _cached("pause", pause_recipe, stamp)
    test = _cached("test", test_recipe, stamp)
    if pause is not None and test is not None:
        return {
            "pause": Image(versions.PAUSE_IMAGE, pause),
            "test": Image(versions.TEST_IMAGE, test),
        }
    with binaries.build_lock(paths.version_dir(), progress):
        images_dir().mkdir(parents=True, exist_ok=True)
        stamp = paths.read_stamp(images_dir() / STAMP_NAME)
        if _cached("pause", pause_recipe, stamp) is None:
            binaries.ensure_host_tools(["buildah"], out=progress)
            root = pause_root(pause_bin)
            image = _write_image(versions.PAUSE_IMAGE, root, entrypoint=["/pause"], cmd=[])
            _built(stamp, "pause", image, progress, recipe=pause_recipe)
        if _cached("test", test_recipe, stamp) is None:
            debs = images_dir() / "debs"
            shutil.rmtree(debs, ignore_errors=True)
            debs.mkdir()
            binaries.ensure_host_tools(["dpkg-deb", "buildah"], out=progress)
            deb = _download_deb(versions.BUSYBOX_DEBIAN_PACKAGE, debs, progress)
            package = f"{versions.BUSYBOX_DEBIAN_PACKAGE}={_deb_version(deb)}"
            root = busybox_root(_busybox_from_deb(deb))
            image = _write_image(versions.TEST_IMAGE, root, cmd=["sh"])
            shutil.rmtree(debs, ignore_errors=True)
            _built(stamp, "test", image, progress, recipe=test_recipe, debian_package=package)
    return {
        "pause": Image(versions.PAUSE_IMAGE, images_dir() / str(stamp["pause"]["archive"])),
        "test": Image(versions.TEST_IMAGE, images_dir() / str(stamp["test"]["archive"])),
    }

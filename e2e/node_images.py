"""Container images for the node, built as OCI archives without any registry.

No registry is reachable from the machines this runs on, so the two images the node
needs are written by `e2e.oci` as OCI archives of one uncompressed tar layer, which
`ctr -n k8s.io images import` loads into containerd:

- the pause image (`versions.PAUSE_IMAGE`): our static `drasil-pause` binary (built by
  `e2e.build` from e2e/go/pause/main.go), the sandbox image containerd runs for every Pod;
- the test image (`versions.TEST_IMAGE`): busybox from Debian's `busybox-static`
  package (fetched with `apt-get download`, no install), with its applet links,
  `/etc/passwd`, `/etc/group` and `/tmp`. Default command `sh`.

Archives are cached in `<cache>/e2e/<version>/images/` with a stamp of what they were
built from; a warm call touches neither apt nor Go. Everything in an archive is
deterministic, so the image IDs do not change between builds of the same inputs.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from e2e import binaries, oci, paths, versions
from e2e.oci import Entry

# Bump when the layout written here changes: every archive is rebuilt.
FORMAT = 2
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


def pause_files(pause_binary: Path) -> list[Entry]:
    return [Entry("pause", 0o755, pause_binary.read_bytes())]


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


def busybox_files(busybox: bytes) -> list[Entry]:
    files = [Entry("bin/busybox", 0o755, busybox)]
    for applet in _applets(busybox):
        if applet == "bin/busybox":
            continue
        files.append(Entry(applet, 0o777, link="/bin/busybox"))
    files += [
        Entry("etc/passwd", 0o644, PASSWD),
        Entry("etc/group", 0o644, b"root:x:0:\nnogroup:x:65534:\n"),
        Entry("etc/hostname", 0o644, b"busybox\n"),
        Entry("root", 0o700),
        Entry("tmp", 0o1777),
        Entry("proc", 0o555),
        Entry("sys", 0o555),
        Entry("dev", 0o755),
    ]
    return files


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
    name: str, files: list[Entry], *, entrypoint: list[str] | None = None, cmd: list[str]
) -> Image:
    """The archive of image `name` in the cache, of one layer of `files`."""
    archive = images_dir() / _archive_name(name)
    config: dict[str, object] = {"Env": [f"PATH={DEFAULT_PATH}"]}
    if entrypoint:
        config["Entrypoint"] = entrypoint
    if cmd:
        config["Cmd"] = cmd
    with tempfile.TemporaryDirectory(dir=images_dir()) as tmp:
        layer = oci.write_layer(files, Path(tmp) / "layer.tar", compress=False)
        config = oci.image_config([layer], ["drasil e2e.node_images"], **config)
        oci.write_archive(archive, name=name, config=config, layers=[layer])
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
            files = pause_files(pause_bin)
            image = _write_image(versions.PAUSE_IMAGE, files, entrypoint=["/pause"], cmd=[])
            _built(stamp, "pause", image, progress, recipe=pause_recipe)
        if _cached("test", test_recipe, stamp) is None:
            debs = images_dir() / "debs"
            shutil.rmtree(debs, ignore_errors=True)
            debs.mkdir()
            binaries.ensure_host_tools(["dpkg-deb"], out=progress)
            deb = _download_deb(versions.BUSYBOX_DEBIAN_PACKAGE, debs, progress)
            package = f"{versions.BUSYBOX_DEBIAN_PACKAGE}={_deb_version(deb)}"
            files = busybox_files(_busybox_from_deb(deb))
            image = _write_image(versions.TEST_IMAGE, files, cmd=["sh"])
            shutil.rmtree(debs, ignore_errors=True)
            _built(stamp, "test", image, progress, recipe=test_recipe, debian_package=package)
    return {
        "pause": Image(versions.PAUSE_IMAGE, images_dir() / str(stamp["pause"]["archive"])),
        "test": Image(versions.TEST_IMAGE, images_dir() / str(stamp["test"]["archive"])),
    }

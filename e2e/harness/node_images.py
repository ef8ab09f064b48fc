"""Container images for the node, built with buildah without any registry.

No registry is reachable from the machines this runs on, so the two images the node
needs are built `FROM scratch` by buildah (a Containerfile that copies a prepared root
filesystem, `--timestamp 0`: the same inputs give the same image) and pushed as OCI
archives, which `ctr -n k8s.io images import` loads into containerd:

- the pause image (`versions.PAUSE_IMAGE`): our static `drasil-pause` binary (built by
  `e2e.harness.build` from e2e/harness/go/pause/main.go), the sandbox image containerd
  runs for every Pod;
- the test image (`versions.TEST_IMAGE`): busybox from Debian's `busybox-static`
  package (fetched with `apt-get download`, no install), with its applet links,
  `/etc/passwd`, `/etc/group` and `/tmp`. Default command `sh`;
- the probe image (`versions.PROBE_IMAGE`, `ensure_probe_image()`): the test image's
  busybox plus what a dynamically linked program needs, copied from this host: the
  dynamic loader (`/lib64/ld-linux-x86-64.so.2`, a link to the real file as on the
  host), glibc's libraries in `/lib/x86_64-linux-gnu/` (libc, libm, libdl, libpthread,
  librt: what the probe and a real libcuda/libnvidia-ml link against), the static
  `/sbin/ldconfig` (so `ldconfig -p` shows the cache inside a container),
  `/etc/ld.so.conf` (`include /etc/ld.so.conf.d/*.conf`), an empty
  `/etc/ld.so.conf.d/`, `/etc/ld.so.cache` written by the host's `ldconfig -r` for the
  image's own directories, the host's `/etc/debian_version` (the glibc is Debian's:
  nvidia-cdi-hook's update-ldcache reads the file to pick Debian's search paths), and
  `/usr/local/bin/gpu-probe` compiled here from e2e/harness/probe/gpu_probe.c (it dlopens
  libcuda.so.1 and libnvidia-ml.so.1 by SONAME and prints one JSON object), and
  `/usr/local/bin/mps-client` compiled from e2e/harness/probe/mps_client.c (it connects to the
  simulated backend's MPS stand-in as a CUDA client would), and `/usr/local/bin/gpu-kernel`
  from e2e/harness/probe/gpu_kernel.c (it runs one PTX kernel through the driver API and
  checks its values: `make gpu-check`'s container step). Default command
  `gpu-probe`. Nothing of NVIDIA's is in it: the driver comes from CDI.

Archives are cached in `<cache>/e2e/<version>/images/` with a stamp of what they were
built from; a warm call touches neither apt, Go nor buildah. The probe image has its own
stamp (`.probe-stamp.json`) and lock (`.probe.lock`), so it is built without waiting for
a cold Go build that holds the build lock, and it needs no Go at all.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from e2e.harness import binaries, paths, versions

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
        print(f"node images: apt-get update (to find {package})", file=out, flush=True)
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
    *,
    stamp_name: str = STAMP_NAME,
    **entry: object,
) -> None:
    """Record `image` as the cached image `key` (in the stamp file `stamp_name`), and
    say so."""
    size = image.archive.stat().st_size
    stamp[key] = {"archive": image.archive.name, "size": size, **entry}
    paths.write_atomic(images_dir() / stamp_name, json.dumps(stamp, indent=2))
    print(f"node images: {image.name} -> {image.archive}", file=out, flush=True)


def ensure_images(*, out: binaries.Writer | None = None) -> dict[str, Image]:
    """The pause, test and probe image archives ("pause", "test", "probe"), built if
    missing or stale; the node imports every one of them into containerd.

    Raises ImageError (or binaries.BuildError for the pause binary or a host tool)
    naming the step."""
    progress = out if out is not None else sys.stderr
    probe = ensure_probe_image(out=progress)
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
            "probe": probe,
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
        "probe": probe,
    }


# -- the probe image ----------------------------------------------------------------

PROBE_SOURCE = Path(__file__).parent / "probe" / "gpu_probe.c"
PROBE_IN_IMAGE = "/usr/local/bin/gpu-probe"
MPS_CLIENT_SOURCE = Path(__file__).parent / "probe" / "mps_client.c"
MPS_CLIENT_IN_IMAGE = "/usr/local/bin/mps-client"
KERNEL_SOURCE = Path(__file__).parent / "probe" / "gpu_kernel.c"
PROBE_JSON_HEADER = Path(__file__).parent / "probe" / "probe_json.h"  # both probes'
KERNEL_IN_IMAGE = "/usr/local/bin/gpu-kernel"
PROBE_STAMP_NAME = ".probe-stamp.json"
PROBE_LOCK_NAME = ".probe.lock"
# The host's dynamic loader (the probe's PT_INTERP) and glibc's directory, by machine;
# the image has both at the same paths.
LOADERS = {"x86_64": "/lib64/ld-linux-x86-64.so.2", "aarch64": "/lib/ld-linux-aarch64.so.1"}
LIB_DIRS = {"x86_64": "/lib/x86_64-linux-gnu", "aarch64": "/lib/aarch64-linux-gnu"}
# libc is the probe's only NEEDED; a real libcuda.so / libnvidia-ml.so also names libm,
# libdl, libpthread and librt (stubs since glibc 2.34, still looked up by name).
GLIBC_LIBRARIES = ("libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1")
# Ubuntu's /sbin/ldconfig is a shell script around ldconfig.real; Debian's is the
# program itself. Both are static, so they run inside any root filesystem.
HOST_LDCONFIGS = ("/sbin/ldconfig.real", "/sbin/ldconfig")
LDCONFIG_IN_IMAGE = "sbin/ldconfig"
LD_SO_CONF = b"include /etc/ld.so.conf.d/*.conf\n"
DEBIAN_VERSION = "/etc/debian_version"


@dataclass(frozen=True)
class HostGlibc:
    """The host files the probe image copies (host paths, as programs name them)."""

    loader: str
    libraries: tuple[str, ...]
    ldconfig: str
    debian_version: str | None

    def files(self) -> list[str]:
        extra = [self.debian_version] if self.debian_version else []
        return [self.loader, *self.libraries, self.ldconfig, *extra]


def host_glibc() -> HostGlibc:
    """This host's dynamic loader, glibc libraries and ldconfig; ImageError when one is
    missing (the harness expects a glibc-based Linux on x86_64 or aarch64)."""
    machine = platform.machine()
    if machine not in LOADERS:
        raise ImageError(f"the probe image needs an x86_64 or aarch64 host, not {machine}")
    loader = LOADERS[machine]
    libraries = tuple(f"{LIB_DIRS[machine]}/{name}" for name in GLIBC_LIBRARIES)
    ldconfig = next((p for p in HOST_LDCONFIGS if os.path.isfile(p)), None)
    missing = [p for p in (loader, *libraries) if not os.path.isfile(p)]
    if ldconfig is None:
        missing.append(" or ".join(HOST_LDCONFIGS))
    if missing or ldconfig is None:
        raise ImageError(f"the probe image copies glibc from this host; missing: {missing}")
    debian = DEBIAN_VERSION if os.path.isfile(DEBIAN_VERSION) else None
    return HostGlibc(loader, libraries, ldconfig, debian)


def _files_digest(files: list[str]) -> str:
    """The content and link targets of `files` (following links): a glibc update on
    the host rebuilds the image."""
    digest = hashlib.sha256()
    for name in files:
        digest.update(f"{name}\0{os.path.realpath(name)}\0".encode())
        with open(name, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def compile_probe(output: Path, *, compiler: str = "gcc") -> Path:
    """Compile e2e/harness/probe/gpu_probe.c with the host's compiler (dynamically linked, as
    every program that dlopens the driver is); returns `output`."""
    cmd = [compiler, "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(output)]
    _run("compile gpu-probe", [*cmd, str(PROBE_SOURCE), "-ldl"])
    return output


def compile_mps_client(output: Path, *, compiler: str = "gcc") -> Path:
    """Compile e2e/harness/probe/mps_client.c (libc only) with the host's compiler; returns
    `output`."""
    cmd = [compiler, "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(output)]
    _run("compile mps-client", [*cmd, str(MPS_CLIENT_SOURCE)])
    return output


def compile_kernel_probe(output: Path, *, compiler: str = "gcc") -> Path:
    """Compile e2e/harness/probe/gpu_kernel.c (libc and libdl) with the host's compiler;
    returns `output`."""
    cmd = [compiler, "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(output)]
    _run("compile gpu-kernel", [*cmd, str(KERNEL_SOURCE), "-ldl"])
    return output


def _needed(binary: Path) -> list[str]:
    """The file names of the libraries `binary` loads at start (ldd)."""
    listed = _run(f"ldd {binary.name}", ["ldd", str(binary)]).decode()
    names = []
    for line in listed.splitlines():
        if "=>" in line:
            names.append(line.split("=>", 1)[0].strip())
    return [n for n in names if not n.startswith("linux-vdso")]


def _copy_from_host(root: Path, path: str) -> None:
    """`path` of the host at the same path under `root`: a chain of symbolic links
    (the last component only) as the same links, the file at the end as a copy."""
    seen = {path}
    while True:
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(target):
            target.unlink()
        if not os.path.islink(path):
            shutil.copyfile(path, target)
            target.chmod(0o755)
            return
        link = os.readlink(path)
        target.symlink_to(link)
        path = os.path.normpath(os.path.join(os.path.dirname(path), link))
        if path in seen:
            raise ImageError(f"{path}: a loop of symbolic links")
        seen.add(path)


def probe_root(
    busybox: bytes, probe: Path, glibc: HostGlibc, mps_client: Path, kernel: Path
) -> Callable[[Path], None]:
    def write(root: Path) -> None:
        busybox_root(busybox)(root)
        (root / "etc" / "hostname").write_bytes(b"probe\n")
        for path in (glibc.loader, *glibc.libraries):
            _copy_from_host(root, path)
        ldconfig = root / LDCONFIG_IN_IMAGE
        ldconfig.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(ldconfig):
            ldconfig.unlink()
        shutil.copyfile(glibc.ldconfig, ldconfig)
        ldconfig.chmod(0o755)
        programs = (
            (probe, PROBE_IN_IMAGE),
            (mps_client, MPS_CLIENT_IN_IMAGE),
            (kernel, KERNEL_IN_IMAGE),
        )
        for program, in_image in programs:
            target = root / in_image.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(program, target)
            target.chmod(0o755)
        (root / "etc" / "ld.so.conf").write_bytes(LD_SO_CONF)
        (root / "etc" / "ld.so.conf").chmod(0o644)
        (root / "etc" / "ld.so.conf.d").mkdir(mode=0o755, exist_ok=True)
        if glibc.debian_version:
            shutil.copyfile(glibc.debian_version, root / DEBIAN_VERSION.lstrip("/"))
            (root / DEBIAN_VERSION.lstrip("/")).chmod(0o644)
        # The cache of the image's own directories, as ldconfig inside it would write
        # it (-r: chroot into the root, so the entries are the image's paths; root).
        _run("ldconfig -r (the image's /etc/ld.so.cache)", [glibc.ldconfig, "-r", str(root)])
        if not (root / "etc" / "ld.so.cache").is_file():
            raise ImageError(f"{glibc.ldconfig} -r {root} wrote no etc/ld.so.cache")

    return write


@contextlib.contextmanager
def _file_lock(path: Path, out: binaries.Writer, what: str) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"node images: waiting for another build of {what}", file=out, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _probe_recipe(glibc: HostGlibc) -> str:
    source = hashlib.sha256(PROBE_SOURCE.read_bytes()).hexdigest()
    mps_client = hashlib.sha256(MPS_CLIENT_SOURCE.read_bytes()).hexdigest()
    kernel = hashlib.sha256(KERNEL_SOURCE.read_bytes()).hexdigest()
    header = hashlib.sha256(PROBE_JSON_HEADER.read_bytes()).hexdigest()
    return _recipe(
        versions.PROBE_IMAGE,
        versions.BUSYBOX_DEBIAN_PACKAGE,
        source,
        mps_client,
        kernel,
        header,
        glibc.files(),
        _files_digest(glibc.files()),
    )


def ensure_probe_image(*, out: binaries.Writer | None = None) -> Image:
    """The probe image's archive (`versions.PROBE_IMAGE`), built if missing or stale:
    when a program of e2e/harness/probe/ (gpu_probe.c, mps_client.c, gpu_kernel.c, their
    probe_json.h) or the host's glibc changed.

    Needs no Go and does not wait for the build lock (it has its own); a cold build
    installs buildah (and gcc, dpkg) if missing, compiles the probe, downloads
    busybox-static and runs buildah; root is needed (`ldconfig -r` chroots).
    Raises ImageError (or binaries.BuildError for a host tool) naming the step."""
    progress = out if out is not None else sys.stderr
    glibc = host_glibc()
    recipe = _probe_recipe(glibc)
    stamp_path = images_dir() / PROBE_STAMP_NAME
    cached = _cached("probe", recipe, paths.read_stamp(stamp_path))
    if cached is not None:
        return Image(versions.PROBE_IMAGE, cached)
    with _file_lock(images_dir() / PROBE_LOCK_NAME, progress, versions.PROBE_IMAGE):
        stamp = paths.read_stamp(stamp_path)
        cached = _cached("probe", recipe, stamp)
        if cached is not None:
            return Image(versions.PROBE_IMAGE, cached)
        binaries.ensure_host_tools(["gcc", "dpkg-deb", "buildah"], out=progress)
        with tempfile.TemporaryDirectory(dir=images_dir()) as tmp:
            work = Path(tmp)
            probe = compile_probe(work / "gpu-probe")
            mps_client = compile_mps_client(work / "mps-client")
            kernel = compile_kernel_probe(work / "gpu-kernel")
            for program in (probe, mps_client, kernel):
                lacking = sorted(set(_needed(program)) - set(GLIBC_LIBRARIES))
                if lacking:
                    raise ImageError(f"{program.name} links against {lacking}, the image lacks")
            (work / "debs").mkdir()
            deb = _download_deb(versions.BUSYBOX_DEBIAN_PACKAGE, work / "debs", progress)
            package = f"{versions.BUSYBOX_DEBIAN_PACKAGE}={_deb_version(deb)}"
            root = probe_root(_busybox_from_deb(deb), probe, glibc, mps_client, kernel)
            image = _write_image(versions.PROBE_IMAGE, root, cmd=[PROBE_IN_IMAGE])
        _built(
            stamp,
            "probe",
            image,
            progress,
            stamp_name=PROBE_STAMP_NAME,
            recipe=recipe,
            debian_package=package,
        )
        return image


def unpack_image(image: Image, into: Path) -> Path:
    """The root filesystem of the OCI archive `image`, its layers unpacked in order
    into `into` (tar, as root: owners, modes and links as in the image); returns
    `into`. For tests that run the image's files with chroot or runc."""
    with tempfile.TemporaryDirectory() as tmp:
        layout = Path(tmp)
        _run("unpack the OCI archive", ["tar", "-xf", str(image.archive), "-C", str(layout)])
        blobs = layout / "blobs"

        def blob(digest: str) -> Path:
            algorithm, hexdigest = digest.split(":", 1)
            return blobs / algorithm / hexdigest

        index = json.loads((layout / "index.json").read_text())
        manifest = json.loads(blob(index["manifests"][0]["digest"]).read_text())
        into.mkdir(parents=True, exist_ok=True)
        for layer in manifest["layers"]:
            _run("unpack a layer", ["tar", "-xf", str(blob(layer["digest"])), "-C", str(into)])
    return into

"""Fake NVIDIA driver roots: what a node's driver install leaves on disk, without a GPU.

`build_fake_root(dest, layout=...)` writes a driver root under `dest` that NVIDIA's own
CDI generator (`nvidia-ctk cdi generate`, e2e.harness.nvidiatoolkit) and drasil's discovery read
as they would a real one:

- the driver's libraries as real ELF shared objects made by the system C compiler (`cc
  -shared -fPIC -Wl,-soname,<SONAME>`), named `<name>.so.<version>` with the real
  SONAMEs, and `libnvidia-nvvm70.so.4`, which real drivers install under that name.
  `libnvidia-ml.so.<version>` is a small NVML of our own (fake_nvml.c: init, shutdown,
  the driver version, the CUDA version, the device count from `FAKE_NVML_GPU_COUNT`,
  every call traced to `FAKE_NVML_TRACE`), `libcuda.so.<version>` a small CUDA driver
  API (fake_cuda.c: cuInit, cuDeviceGetCount, cuDriverGetVersion); the others only carry
  their name (fake_stub.c). They are compiled once per version into
  `<cache>/e2e/driverroot/` and copied;
- the links a real install has: `<SONAME> -> <name>.so.<version>` for every library
  whose SONAME is not its file name (the packages and the .run installer make them, and
  so does ldconfig), and the development links `<name>.so -> <SONAME>` of
  `Layout.dev_links` (libcuda.so, libnvcuvid.so, libnvidia-encode.so everywhere; also
  libnvidia-ml.so for the .run installer of the GPU Operator's driver container, and
  libnvidia-ml.so and libnvidia-nvvm.so on `rhel`, as RPM Fusion's 580 packages have).
  All links are relative, as ldconfig makes them, so they resolve inside the root
  wherever it is mounted;
- `etc/ld.so.conf` listing the library folder and `etc/ld.so.cache` made by `ldconfig
  -r <root>` (chroot: needs root), which may also update the SONAME links as it does on
  a real system;
- the GSP firmware `lib/firmware/nvidia/<version>/gsp_ga10x.bin` and `gsp_tu10x.bin`;
- `usr/bin/nvidia-smi`, a small C program of our own (nvidia_smi.c, dynamically linked
  against glibc like the real one): `nvidia-smi -L` dlopens `libnvidia-ml.so.1` by SONAME
  and lists the GPUs and MIG devices that NVML serves where it runs, in NVIDIA's format
  (in a container of a glibc image, the NVML its CDI spec mounted); other options exit 2.
  Over the mock NVML (e2e.harness.mocknvml) it lists exactly the devices whose device
  nodes the container has. Executable stub scripts `nvidia-debugdump`,
  `nvidia-persistenced`, `nvidia-cuda-mps-control`, `nvidia-cuda-mps-server` beside it;
- the persistence daemon's socket `run/nvidia-persistenced/socket` (a unix socket bound
  and left, as the daemon leaves it);
- with `dev_nodes=True`, the character devices `dev/nvidiactl` (195, 255),
  `dev/nvidia-modeset` (195, 254), `dev/nvidia-uvm` (510, 0), `dev/nvidia-uvm-tools`
  (510, 1) and `dev/nvidia<N>` (195, N) made with mknod (needs CAP_MKNOD). A real
  driver root has none: the nodes are the host's /dev (a dev root of its own).

Layouts (`LAYOUTS`):

- `debian`: Debian/Ubuntu multiarch, libraries in /usr/lib/x86_64-linux-gnu;
- `operator`: the root of the GPU Operator's driver container, mounted on the host at
  /run/nvidia/driver: an Ubuntu root where the .run installer put the driver (the same
  multiarch folder, libvdpau_nvidia in its vdpau/ subfolder, libnvidia-ml.so, and the
  installer's own binaries nvidia-installer and nvidia-modprobe besides the usual ones);
- `rhel`: libraries in /usr/lib64;
- `no-ldcache`: `debian` without etc/ld.so.cache (ld.so.conf stays);
- `leftovers`: `debian` plus an older driver's `<name>.so.<old_version>` files in the
  same folder (no links point at them; ldconfig lists the ones whose SONAME carries the
  version, libnvidia-gpucomp and libnvidia-pkcs11-openssl3) and its firmware folder;
- `custom-dir`: libraries in /opt/nvidia/lib64, a folder no generator searches by
  itself: only etc/ld.so.cache leads there.

Nothing here touches the host outside `dest` and the cache.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import socket
import stat
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from e2e.harness import paths
from e2e.harness.cbuild import cached_build, compile_c, compiler

SOURCES = Path(__file__).resolve().parent
DEFAULT_VERSION = "580.95.05"
DEFAULT_OLD_VERSION = "570.172.08"
# What the fake NVML and libcuda say the CUDA driver version is (13.0), unless
# FAKE_CUDA_DRIVER_VERSION says otherwise at run time.
CUDA_DRIVER_VERSION = 13000
# The real driver's libraries need glibc's libdl.so.2 and libpthread.so.0 (seen in
# 580.159.04's libcuda.so and libnvidia-ml.so); a container image brings them, a CDI spec
# never does. The fakes need them too, so a sandbox that lacks them fails here as on a GPU.
GLIBC_NEEDED = ("-Wl,--no-as-needed", "-l:libdl.so.2", "-l:libpthread.so.0")

MULTIARCH_LIB_DIR = "/usr/lib/x86_64-linux-gnu"
FIRMWARE_DIR = "/lib/firmware/nvidia"
FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")
BIN_DIR = "/usr/bin"
# The binaries that are programs of ours (compiled with the libraries), not stub scripts.
PROGRAMS = {"nvidia-smi": "nvidia_smi.c"}
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
PERSISTENCED_SOCKET = "/run/nvidia-persistenced/socket"

# Character devices: NVIDIA's fixed major 195 (nvidiactl is minor 255, nvidia-modeset
# 254, GPU N minor N); nvidia-uvm's major is dynamic on a real host, 510 here.
NVIDIA_MAJOR = 195
UVM_MAJOR = 510
CONTROL_NODES = {
    "/dev/nvidiactl": (NVIDIA_MAJOR, 255),
    "/dev/nvidia-modeset": (NVIDIA_MAJOR, 254),
    "/dev/nvidia-uvm": (UVM_MAJOR, 0),
    "/dev/nvidia-uvm-tools": (UVM_MAJOR, 1),
}


@dataclass(frozen=True)
class Library:
    """One driver library: `<name>.so.<version>`, in `subdir` of the library folder."""

    name: str
    # None: the SONAME is the versioned file name itself (libnvidia-gpucomp, ...).
    soname: str | None
    source: str = "fake_stub.c"
    subdir: str = ""
    # The few libraries whose file name carries no driver version (libnvidia-nvvm70.so.4):
    # every driver version installs the same name.
    fixed_name: str | None = None

    def file_name(self, version: str) -> str:
        return self.fixed_name or f"{self.name}.so.{version}"

    def soname_for(self, version: str) -> str:
        return self.soname or self.file_name(version)


# The compute libraries of a 580 driver, with their real SONAMEs. Left out: the
# graphics ones, and libnvidia-sandboxutils.so.<version> (SONAME libnvidia-sandboxutils.so.1),
# which nvidia-ctk would load and ask for the version before NVML (a stub would crash it).
DRIVER_LIBRARIES = (
    Library("libcuda", "libcuda.so.1", "fake_cuda.c"),
    Library("libcudadebugger", "libcudadebugger.so.1"),
    Library("libnvcuvid", "libnvcuvid.so.1"),
    Library("libnvidia-allocator", "libnvidia-allocator.so.1"),
    Library("libnvidia-cfg", "libnvidia-cfg.so.1"),
    Library("libnvidia-encode", "libnvidia-encode.so.1"),
    Library("libnvidia-gpucomp", None),
    Library("libnvidia-ml", "libnvidia-ml.so.1", "fake_nvml.c"),
    Library("libnvidia-nvvm", "libnvidia-nvvm.so.4"),
    # Real 580 drivers install it under this name, without the driver version.
    Library("libnvidia-nvvm70", "libnvidia-nvvm70.so.4", fixed_name="libnvidia-nvvm70.so.4"),
    Library("libnvidia-opencl", "libnvidia-opencl.so.1"),
    Library("libnvidia-opticalflow", "libnvidia-opticalflow.so.1"),
    Library("libnvidia-pkcs11-openssl3", None),
    Library("libnvidia-ptxjitcompiler", "libnvidia-ptxjitcompiler.so.1"),
)
VDPAU_LIBRARY = Library("libvdpau_nvidia", "libvdpau_nvidia.so.1", subdir="vdpau")
ALL_LIBRARIES = (*DRIVER_LIBRARIES, VDPAU_LIBRARY)


@dataclass(frozen=True)
class Layout:
    """Where a kind of install puts things (paths as the root sees them)."""

    lib_dir: str
    ld_cache: bool = True
    leftovers: bool = False
    vdpau: bool = False
    dev_links: tuple[str, ...] = ("libcuda", "libnvcuvid", "libnvidia-encode")
    extra_binaries: tuple[str, ...] = ()


LAYOUTS: Mapping[str, Layout] = {
    "debian": Layout(MULTIARCH_LIB_DIR),
    "operator": Layout(
        MULTIARCH_LIB_DIR,
        vdpau=True,
        dev_links=("libcuda", "libnvcuvid", "libnvidia-encode", "libnvidia-ml"),
        extra_binaries=("nvidia-installer", "nvidia-modprobe"),
    ),
    # RPM Fusion's 580 cuda-libs package also ships libnvidia-ml.so and libnvidia-nvvm.so.
    "rhel": Layout(
        "/usr/lib64",
        dev_links=("libcuda", "libnvcuvid", "libnvidia-encode", "libnvidia-ml", "libnvidia-nvvm"),
    ),
    "no-ldcache": Layout(MULTIARCH_LIB_DIR, ld_cache=False),
    "leftovers": Layout(MULTIARCH_LIB_DIR, leftovers=True),
    "custom-dir": Layout("/opt/nvidia/lib64"),
}


class DriverRootError(RuntimeError):
    """A fake root could not be made (compiler, ldconfig, mknod)."""


@dataclass(frozen=True)
class FakeRoot:
    """What `build_fake_root` made. Paths are absolute as the root sees them (the
    container path of a CDI mount); `host(path)` is where the file is on this machine."""

    root: Path
    layout: str
    version: str
    old_version: str | None
    # Folders holding the current version's libraries (the main folder first).
    lib_dirs: tuple[str, ...]
    # The current version's library files (regular files), sorted: `<name>.so.<version>`
    # and the version-less libnvidia-nvvm70.so.4.
    libraries: tuple[str, ...]
    # Every symlink in the library folders after ldconfig: link path -> target as written.
    symlinks: Mapping[str, str]
    # The older version's library files (`leftovers`), sorted; empty otherwise. Its
    # libnvidia-nvvm70.so.4 is the same file name, so the current one replaced it.
    old_libraries: tuple[str, ...]
    firmware: tuple[str, ...]
    old_firmware: tuple[str, ...]
    # The executables (nvidia-smi a program, the others stubs), the generators' five first,
    # then the layout's extra ones.
    binaries: tuple[str, ...]
    sockets: tuple[str, ...]
    # Character devices made under <root>/dev (dev_nodes=True), sorted.
    device_nodes: tuple[str, ...]
    ld_so_conf: str
    ld_cache: str | None
    gpus: int
    soname_of: Mapping[str, str] = field(default_factory=dict)

    def host(self, path: str) -> Path:
        """`path` (absolute, in the root) on this machine."""
        return self.root / path.lstrip("/")

    def env(self) -> dict[str, str]:
        """The environment the fake NVML and libcuda read: the GPU count."""
        return {"FAKE_NVML_GPU_COUNT": str(self.gpus)}


def _cache_key(version: str) -> str:
    """Changes whenever anything that decides the compiled libraries changes."""
    h = hashlib.sha256()
    h.update(f"{version}\0{compiler()}\0{CUDA_DRIVER_VERSION}\0{GLIBC_NEEDED}\0".encode())
    for lib in ALL_LIBRARIES:
        h.update(f"{lib.name}\0{lib.soname}\0{lib.source}\0{lib.fixed_name}\0".encode())
    for source in sorted({lib.source for lib in ALL_LIBRARIES} | set(PROGRAMS.values())):
        h.update(source.encode() + b"\0" + (SOURCES / source).read_bytes())
    return h.hexdigest()[:16]


def _check_version(version: str) -> None:
    parts = version.split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"a driver version is digits and dots, like 580.95.05: {version!r}")


def compiled_libraries(version: str) -> Path:
    """A folder with every library of `version` (`ALL_LIBRARIES`, by file name) and
    the `PROGRAMS` (by name), compiled on first use into
    `<cache>/e2e/driverroot/<version>-<key>/`."""
    _check_version(version)

    def build(work: Path) -> None:
        for lib in ALL_LIBRARIES:
            name = lib.file_name(version)
            cmd = [
                compiler(),
                "-shared",
                "-fPIC",
                "-O2",
                f"-Wl,-soname,{lib.soname_for(version)}",
                f'-DFAKE_DRIVER_VERSION="{version}"',
                f'-DFAKE_LIBRARY="{name}"',
                "-o",
                str(work / name),
                str(SOURCES / lib.source),
                *GLIBC_NEEDED,
            ]
            compile_c(cmd, error=DriverRootError)
        for name, source in PROGRAMS.items():
            cmd = [
                compiler(),
                "-O2",
                "-Wall",
                "-Wextra",
                "-Werror",
                f'-DFAKE_DRIVER_VERSION="{version}"',
                "-o",
                str(work / name),
                str(SOURCES / source),
                "-ldl",
            ]
            compile_c(cmd, error=DriverRootError)

    target = paths.e2e_root() / "driverroot" / f"{version}-{_cache_key(version)}"
    return cached_build(target, build)


def compiled_nvidia_smi(version: str = DEFAULT_VERSION) -> Path:
    """The fake driver's `nvidia-smi` program of `version` (nvidia_smi.c, compiled once)."""
    return compiled_libraries(version) / "nvidia-smi"


def _write(path: Path, data: str | bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)
    path.chmod(mode)


def _stub_binary(name: str, version: str) -> str:
    return (
        "#!/bin/sh\n"
        f"# {name} of drasil's fake NVIDIA driver {version} (e2e/harness/driverroot): a stand-in.\n"
        f'echo "{name}: drasil fake NVIDIA driver {version}"\n'
    )


def _make_socket(path: Path) -> None:
    """A unix socket inode at `path`, as a daemon that bound it and exited leaves it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    if len(os.fsencode(path)) < 108:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(str(path))
    else:  # too long for sun_path: the same kind of inode, made directly
        os.mknod(path, stat.S_IFSOCK | 0o755)


def make_device_nodes(dev_root: Path, gpus: int) -> tuple[str, ...]:
    """The NVIDIA character devices under `<dev_root>/dev`: nvidiactl, nvidia-modeset,
    nvidia-uvm, nvidia-uvm-tools and nvidia0..nvidia<gpus-1>. Returns their paths as
    `/dev/...`, sorted. Needs CAP_MKNOD."""
    nodes = dict(CONTROL_NODES)
    nodes.update({f"/dev/nvidia{i}": (NVIDIA_MAJOR, i) for i in range(gpus)})
    (dev_root / "dev").mkdir(parents=True, exist_ok=True)
    for name, (major, minor) in nodes.items():
        path = dev_root / name.lstrip("/")
        path.unlink(missing_ok=True)
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        except PermissionError as e:
            raise DriverRootError(f"mknod {path} needs CAP_MKNOD (root): {e}") from e
        path.chmod(0o666)  # as the driver makes them, whatever the umask
    return tuple(sorted(nodes))


def _ldconfig(root: Path) -> None:
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    if os.geteuid() != 0:
        raise DriverRootError(f"`ldconfig -r {root}` chroots: it needs root")
    (root / "var/cache/ldconfig").mkdir(parents=True, exist_ok=True)
    cmd = [ldconfig, "-r", str(root)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (root / "etc/ld.so.cache").is_file():
        raise DriverRootError(f"{shlex.join(cmd)} failed:\n{done.stderr[-2000:]}")


def _copy_libraries(
    root: Path, layout: Layout, version: str, *, links: bool
) -> tuple[list[str], dict[str, str]]:
    """Copy `version`'s libraries into the layout's folder(s); with `links`, also the
    SONAME and development links. Returns the files and {SONAME: file name}."""
    compiled = compiled_libraries(version)
    files: list[str] = []
    sonames: dict[str, str] = {}
    libs = [*DRIVER_LIBRARIES, *([VDPAU_LIBRARY] if layout.vdpau else [])]
    for lib in libs:
        if lib.fixed_name and not links:  # an older driver's copy was overwritten
            continue
        folder = f"{layout.lib_dir}/{lib.subdir}" if lib.subdir else layout.lib_dir
        name = lib.file_name(version)
        target = root / folder.lstrip("/") / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(compiled / name, target)
        target.chmod(0o755)
        files.append(f"{folder}/{name}")
        soname = lib.soname_for(version)
        sonames[name] = soname
        if not links:
            continue
        if soname != name:
            (target.parent / soname).symlink_to(name)
        if lib.name in layout.dev_links:
            (target.parent / f"{lib.name}.so").symlink_to(soname)
    return files, sonames


def _symlinks(root: Path, folders: list[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for folder in folders:
        for entry in sorted((root / folder.lstrip("/")).iterdir()):
            if entry.is_symlink():
                found[f"{folder}/{entry.name}"] = os.readlink(entry)
    return found


def build_fake_root(
    dest: Path,
    *,
    layout: str,
    version: str = DEFAULT_VERSION,
    old_version: str | None = None,
    dev_nodes: bool = False,
    gpus: int = 1,
) -> FakeRoot:
    """Write a fake driver root of `layout` (a key of LAYOUTS) at `dest` (missing or
    empty) and say what it holds.

    `old_version` is the older driver of the `leftovers` layout (default
    DEFAULT_OLD_VERSION; ignored by the others). `dev_nodes` adds <dest>/dev with the
    device nodes of `gpus` GPUs; `gpus` is also what `FakeRoot.env()` tells the fake NVML.

    Raises ValueError for an unknown layout or a bad version, DriverRootError when the
    compiler, ldconfig or mknod fails."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    _check_version(version)
    if gpus < 0:
        raise ValueError(f"gpus must be >= 0: {gpus}")
    spec = LAYOUTS[layout]
    old = (old_version or DEFAULT_OLD_VERSION) if spec.leftovers else None
    if old is not None:
        _check_version(old)
        if old == version:
            raise ValueError(f"old_version must differ from version {version}")
    if dest.exists() and any(dest.iterdir()):
        raise ValueError(f"{dest} is not empty")
    root = dest.resolve()
    root.mkdir(parents=True, exist_ok=True)

    libraries, soname_of = _copy_libraries(root, spec, version, links=True)
    old_libraries: list[str] = []
    if old is not None:
        old_libraries, _ = _copy_libraries(root, spec, old, links=False)

    firmware = [f"{FIRMWARE_DIR}/{version}/{name}" for name in FIRMWARE]
    old_firmware = [f"{FIRMWARE_DIR}/{old}/{name}" for name in FIRMWARE] if old else []
    for path in (*firmware, *old_firmware):
        fw_version = path.split("/")[-2]
        _write(root / path.lstrip("/"), f"drasil fake GSP firmware {fw_version}\n".encode())

    binaries = [f"{BIN_DIR}/{name}" for name in (*BINARIES, *spec.extra_binaries)]
    compiled = compiled_libraries(version)
    for path in binaries:
        name = Path(path).name
        if name in PROGRAMS:
            _write(root / path.lstrip("/"), (compiled / name).read_bytes(), 0o755)
        else:
            _write(root / path.lstrip("/"), _stub_binary(name, version), 0o755)

    _make_socket(root / PERSISTENCED_SOCKET.lstrip("/"))

    conf = "/etc/ld.so.conf"
    _write(root / conf.lstrip("/"), f"{spec.lib_dir}\n")
    if spec.ld_cache:
        _ldconfig(root)

    nodes = make_device_nodes(root, gpus) if dev_nodes else ()
    lib_dirs = [spec.lib_dir, *([f"{spec.lib_dir}/vdpau"] if spec.vdpau else [])]
    return FakeRoot(
        root=root,
        layout=layout,
        version=version,
        old_version=old,
        lib_dirs=tuple(lib_dirs),
        libraries=tuple(sorted(libraries)),
        symlinks=_symlinks(root, lib_dirs),
        old_libraries=tuple(sorted(old_libraries)),
        firmware=tuple(firmware),
        old_firmware=tuple(old_firmware),
        binaries=tuple(binaries),
        sockets=(PERSISTENCED_SOCKET,),
        device_nodes=nodes,
        ld_so_conf=conf,
        ld_cache="/etc/ld.so.cache" if spec.ld_cache else None,
        gpus=gpus,
        soname_of=soname_of,
    )


def upgrade_fake_root(fake: FakeRoot, version: str) -> FakeRoot:
    """Replace `fake`'s driver by `version`'s in place, as a package upgrade does: the
    old files go before the new ones come (a prepare in between finds no driver). The
    root as it is then; its folder stays the same."""
    staging = fake.root.parent / f"{fake.root.name}-{version}"
    shutil.rmtree(staging, ignore_errors=True)
    newer = build_fake_root(staging, layout=fake.layout, version=version, gpus=fake.gpus)
    for folder in ("usr", "lib", "etc"):
        shutil.rmtree(fake.root / folder, ignore_errors=True)
        if (newer.root / folder).exists():
            shutil.copytree(newer.root / folder, fake.root / folder, symlinks=True)
    shutil.rmtree(staging)
    return replace(newer, root=fake.root)

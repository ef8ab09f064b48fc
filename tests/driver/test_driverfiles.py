"""The driver's files under a driver root: ld.so.cache and SONAME readers, the files a
container gets, the edits and hooks, and keeping them current when the driver changes.

The roots are small and real: ELF shared objects made by the system C compiler with
their SONAMEs, an ``ld.so.cache`` written by ``ldconfig -r``. What NVIDIA's own
generator makes of the same kind of roots is checked in e2e/test_driver_files.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from cdicheck import assert_valid_cdi

from drasil.driver.cdi.claimspecs import ClaimDevice, ClaimSpecRequest, build_claim_spec
from drasil.driver.cdi.spec import CdiSpecError, Mount, validate_spec
from drasil.driver.nvidia.driveredits import (
    HOOK_ENV,
    VOID_MOUNT,
    NodeEdits,
    control_edits,
    driver_edits,
    graphics_links,
    without_void,
)
from drasil.driver.nvidia.driverfiles import (
    DriverFilesError,
    DriverRoot,
    find_driver_files,
    root_driver_version,
)
from drasil.driver.nvidia.ldcache import elf_interpreter, elf_soname, parse_ld_cache, read_ld_cache
from drasil.driver.simulated.nvml import simulated_library

VERSION = "580.95.05"
NEWER = "590.44.01"
OLD = "550.54.15"
DEBIAN = "/usr/lib/x86_64-linux-gnu"
HOOK = "/var/lib/kubelet/plugins/gpu.drasil.dev/nvidia-cdi-hook"
pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


def _compile(path: Path, soname: str, cache: dict[str, bytes]) -> None:
    """A shared object with ``soname``; compiled once per SONAME and copied."""
    if soname not in cache:
        src = path.parent / f".{soname}.c"
        src.write_text("int drasil_stub(void) { return 0; }\n")
        out = path.parent / f".{soname}.so"
        subprocess.run(
            ["cc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", out, src], check=True
        )
        cache[soname] = out.read_bytes()
        out.unlink()
        src.unlink()
    path.write_bytes(cache[soname])


class Root:
    """A driver root being built: libraries with links as an installer leaves them."""

    def __init__(self, path: Path, cache: dict[str, bytes]) -> None:
        self.path = path
        self.cache = cache

    def lib(self, folder: str, name: str, version: str, soname: str, *, links: bool = True) -> None:
        where = self.path / folder.lstrip("/")
        where.mkdir(parents=True, exist_ok=True)
        _compile(where / f"{name}.so.{version}", soname, self.cache)
        if links:
            _link(where / soname, f"{name}.so.{version}")

    def file(self, inside: str, *, mode: int = 0o644) -> None:
        path = self.path / inside.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
        path.chmod(mode)

    def ldconfig(self, *folders: str) -> None:
        (self.path / "etc").mkdir(exist_ok=True)
        (self.path / "etc/ld.so.conf").write_text("".join(f"{f}\n" for f in folders))
        subprocess.run(["ldconfig", "-r", str(self.path)], check=True, capture_output=True)

    @property
    def root(self) -> DriverRoot:
        return DriverRoot(host="/run/nvidia/driver", local=self.path)


def _link(path: Path, target: str) -> None:
    if path.is_symlink() or path.exists():
        path.unlink()
    path.symlink_to(target)


@pytest.fixture(scope="module")
def so_cache() -> dict[str, bytes]:
    return {}


@pytest.fixture
def debian(tmp_path: Path, so_cache: dict[str, bytes]) -> Iterator[Root]:
    """A Debian-layout root with driver VERSION, firmware, utilities and a socket."""
    r = Root(tmp_path / "root", so_cache)
    r.lib(DEBIAN, "libcuda", VERSION, "libcuda.so.1")
    _link(r.path / DEBIAN.lstrip("/") / "libcuda.so", "libcuda.so.1")
    r.lib(DEBIAN, "libnvidia-ml", VERSION, "libnvidia-ml.so.1")
    r.lib(DEBIAN, "libnvidia-gpucomp", VERSION, f"libnvidia-gpucomp.so.{VERSION}", links=False)
    r.lib(DEBIAN, "libnvidia-nvvm", VERSION, "libnvidia-nvvm.so.4")
    r.file(f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin")
    r.file(f"/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin")
    r.file(f"/lib/firmware/nvidia/{OLD}/gsp_ga10x.bin")
    r.file("/usr/bin/nvidia-smi", mode=0o755)
    r.file("/usr/bin/nvidia-debugdump", mode=0o644)  # not executable: not a utility
    sock = socket.socket(socket.AF_UNIX)
    (r.path / "run/nvidia-persistenced").mkdir(parents=True)
    sock.bind(str(r.path / "run/nvidia-persistenced/socket"))
    sock.close()
    r.ldconfig(DEBIAN)
    return r


# --- ld.so.cache and SONAME -------------------------------------------------------------


def test_the_cache_ldconfig_writes_reads_back(debian: Root) -> None:
    entries = read_ld_cache(debian.path / "etc/ld.so.cache")
    by_name = {e.name: e for e in entries}
    assert by_name["libcuda.so.1"].path == f"{DEBIAN}/libcuda.so.1"
    assert by_name["libcuda.so.1"].bits == 64
    assert "libnvidia-ml.so.1" in by_name


def test_the_host_cache_agrees_with_ldconfig_p() -> None:
    listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True)
    paths = {line.rsplit("=> ", 1)[1] for line in listed.stdout.splitlines() if "=> " in line}
    assert {e.path for e in read_ld_cache(Path("/etc/ld.so.cache"))} == paths


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"garbage" * 100,
        b"glibc-ld.so.cache1.1" + b"\xff" * 28,  # claims 4 billion entries
        b"ld.so-1.7.0\0\xff\xff\xff\xff",  # old header with an impossible count
    ],
)
def test_bytes_that_are_no_cache_read_as_no_entries(data: bytes) -> None:
    assert parse_ld_cache(data) == []


def test_a_truncated_cache_reads_as_the_entries_it_still_holds(debian: Root) -> None:
    data = (debian.path / "etc/ld.so.cache").read_bytes()
    whole = parse_ld_cache(data)
    for cut in range(0, len(data), 7):  # never an exception; only entries read whole
        assert set(parse_ld_cache(data[:cut])) <= set(whole)


def test_soname_of_a_shared_object_and_of_other_files(debian: Root, tmp_path: Path) -> None:
    lib = debian.path / DEBIAN.lstrip("/") / f"libcuda.so.{VERSION}"
    assert elf_soname(lib) == "libcuda.so.1"
    (tmp_path / "text").write_text("not elf")
    assert elf_soname(tmp_path / "text") is None
    (tmp_path / "cut").write_bytes(lib.read_bytes()[:70])
    assert elf_soname(tmp_path / "cut") is None
    assert elf_soname(tmp_path / "missing") is None


def test_a_shared_object_or_a_text_file_names_no_loader(debian: Root, tmp_path: Path) -> None:
    # A program's PT_INTERP (test_mpsview.py reads one); libraries and scripts have none.
    assert elf_interpreter(debian.path / DEBIAN.lstrip("/") / f"libcuda.so.{VERSION}") is None
    (tmp_path / "text").write_text("#!/bin/sh\n")
    assert elf_interpreter(tmp_path / "text") is None
    assert elf_interpreter(tmp_path / "missing") is None


# --- the files ----------------------------------------------------------------------------


def test_files_of_the_running_version_only(debian: Root) -> None:
    debian.lib(DEBIAN, "libcuda", OLD, "libcuda.so.1", links=False)  # an older driver's leftover
    files = find_driver_files(debian.root, VERSION)
    assert set(files.libraries) == {
        f"{DEBIAN}/libcuda.so.{VERSION}",
        f"{DEBIAN}/libnvidia-ml.so.{VERSION}",
        f"{DEBIAN}/libnvidia-gpucomp.so.{VERSION}",
        f"{DEBIAN}/libnvidia-nvvm.so.{VERSION}",
    }
    assert files.library_folders == (DEBIAN,)
    assert set(files.firmware) == {
        f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin",
        f"/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin",
    }
    assert files.binaries == ("/usr/bin/nvidia-smi",)
    assert files.sockets == ("/run/nvidia-persistenced/socket",)


def test_links_are_the_ones_the_install_has(debian: Root) -> None:
    links = set(find_driver_files(debian.root, VERSION).links)
    assert links == {
        f"libcuda.so.1::{DEBIAN}/libcuda.so",
        f"libcuda.so.{VERSION}::{DEBIAN}/libcuda.so.1",
        f"libnvidia-ml.so.{VERSION}::{DEBIAN}/libnvidia-ml.so.1",
        f"libnvidia-nvvm.so.{VERSION}::{DEBIAN}/libnvidia-nvvm.so.4",
    }


def test_a_folder_only_the_cache_knows(tmp_path: Path, so_cache: dict[str, bytes]) -> None:
    r = Root(tmp_path / "root", so_cache)
    r.lib("/opt/nvidia/lib64", "libcuda", VERSION, "libcuda.so.1")
    r.lib("/opt/nvidia/lib64", "libnvidia-ml", VERSION, "libnvidia-ml.so.1")
    assert root_driver_version(r.root) is None  # not in a usual folder, no cache yet
    r.ldconfig("/opt/nvidia/lib64")
    files = find_driver_files(r.root, VERSION)
    assert files.library_folders == ("/opt/nvidia/lib64",)
    assert len(files.libraries) == 2


def test_no_cache_falls_back_to_the_usual_folders(
    tmp_path: Path, so_cache: dict[str, bytes]
) -> None:
    r = Root(tmp_path / "root", so_cache)
    r.lib("/usr/lib64", "libcuda", VERSION, "libcuda.so.1")
    assert not (r.path / "etc/ld.so.cache").exists()
    assert find_driver_files(r.root, VERSION).libraries == (f"/usr/lib64/libcuda.so.{VERSION}",)


def test_absolute_links_resolve_inside_the_root(tmp_path: Path, so_cache: dict[str, bytes]) -> None:
    r = Root(tmp_path / "root", so_cache)
    r.lib("/usr/lib/nvidia-real", "libcuda", VERSION, "libcuda.so.1", links=False)
    (r.path / "usr/lib64").mkdir(parents=True)
    # /usr/lib64/libcuda.so.<v> -> /usr/lib/nvidia-real/...: absolute, so inside the root.
    _link(r.path / f"usr/lib64/libcuda.so.{VERSION}", f"/usr/lib/nvidia-real/libcuda.so.{VERSION}")
    files = find_driver_files(r.root, VERSION)
    assert files.libraries == (f"/usr/lib/nvidia-real/libcuda.so.{VERSION}",)


def test_a_link_loop_is_no_file(tmp_path: Path) -> None:
    root = DriverRoot(host="/", local=tmp_path)
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("/a")
    assert root.resolve("/a") is None


def test_no_driver_and_a_different_driver_name_what_is_there(debian: Root, tmp_path: Path) -> None:
    with pytest.raises(
        DriverFilesError, match=f"holds driver {VERSION}, but NVML .* reports {NEWER}"
    ):
        find_driver_files(debian.root, NEWER)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DriverFilesError, match="holds no NVIDIA driver libraries"):
        find_driver_files(DriverRoot(host="/", local=tmp_path / "empty"), VERSION)


def test_root_version_is_the_newest_there(debian: Root) -> None:
    debian.lib(DEBIAN, "libcuda", OLD, "libcuda.so.1", links=False)
    assert root_driver_version(debian.root) == VERSION


# --- edits and specs --------------------------------------------------------------------


def test_edits_use_host_paths_and_the_hooks_in_nvidias_order(debian: Root) -> None:
    files = find_driver_files(debian.root, VERSION)
    edits = driver_edits(files, debian.root, hook_path=HOOK)
    assert {m.host_path for m in edits.mounts} == {f"/run/nvidia/driver{p}" for p in files.files}
    assert all(m.container_path in files.files for m in edits.mounts)
    commands = [h.args[1] for h in edits.hooks]
    assert commands == [
        "create-symlinks",
        "enable-cuda-compat",
        "update-ldcache",
        "disable-device-node-modification",
    ]
    assert all(h.path == HOOK and h.args[0] == "nvidia-cdi-hook" for h in edits.hooks)
    assert edits.hooks[2].args[2:] == ("--folder", DEBIAN)
    assert edits.env == {"NVIDIA_CTK_LIBCUDA_DIR": DEBIAN}
    assert driver_edits(files, debian.root, hook_path=None).hooks == ()


def test_the_allocator_gets_gbms_backend_link_in_a_hook_of_its_own_first(debian: Root) -> None:
    debian.lib(DEBIAN, "libnvidia-allocator", VERSION, "libnvidia-allocator.so.1")
    # An older driver's, left in the folder: no link of its own.
    debian.lib(DEBIAN, "libnvidia-allocator", OLD, "libnvidia-allocator.so.1", links=False)
    files = find_driver_files(debian.root, VERSION)
    hooks = driver_edits(files, debian.root, hook_path=HOOK).hooks
    # NVIDIA's generator (nvml mode, its graphics part): ../libnvidia-allocator.so.1 from
    # the library's folder, the SONAME link itself left to the driver's create-symlinks.
    assert hooks[0].args == (
        "nvidia-cdi-hook",
        "create-symlinks",
        "--link",
        f"../libnvidia-allocator.so.1::{DEBIAN}/gbm/nvidia-drm_gbm.so",
    )
    assert hooks[1].args[1] == "create-symlinks"
    assert f"libnvidia-allocator.so.{VERSION}::{DEBIAN}/libnvidia-allocator.so.1" in hooks[1].args
    assert hooks[0].env == hooks[1].env == HOOK_ENV


def test_a_vulkan_producer_library_gets_its_link_with_the_graphics_ones(debian: Root) -> None:
    soname = f"libnvidia-vulkan-producer.so.{VERSION}"
    debian.lib(DEBIAN, "libnvidia-vulkan-producer", VERSION, soname, links=False)
    files = find_driver_files(debian.root, VERSION)
    assert graphics_links(files) == [
        f"libnvidia-vulkan-producer.so.{VERSION}::{DEBIAN}/libnvidia-vulkan-producer.so"
    ]


def test_no_graphics_library_no_graphics_hook(debian: Root) -> None:
    files = find_driver_files(debian.root, VERSION)
    assert graphics_links(files) == []
    commands = [h.args[1] for h in driver_edits(files, debian.root, hook_path=HOOK).hooks]
    assert commands.count("create-symlinks") == 1


def test_the_control_edits_mark_void_by_variable_and_by_mount() -> None:
    edits = control_edits(("/dev/nvidiactl",))
    assert edits.env == {"NVIDIA_VISIBLE_DEVICES": "void"}
    # NVIDIA's generator, every mode: /dev/null where the legacy hook's volume-mounts
    # strategy reads the device list.
    assert edits.mounts == (
        Mount(
            "/dev/null", "/var/run/nvidia-container-devices/void", ("ro", "nosuid", "nodev", "bind")
        ),
    )
    bare = without_void(edits)
    assert (bare.env, bare.mounts, bare.device_nodes) == ({}, (), edits.device_nodes)


def test_a_claim_spec_with_the_driver_is_valid_cdi(
    debian: Root, schema_validator: jsonschema.Draft7Validator
) -> None:
    lib = simulated_library("h100-80gb:1", node_name="n")
    files = find_driver_files(debian.root, VERSION)
    from drasil.driver.nvidia.driveredits import merged
    from drasil.driver.nvidia.nodedevices import discover

    device = discover(lib, node_name="n").devices[0]
    common = merged(
        control_edits(("/dev/nvidiactl",)), driver_edits(files, debian.root, hook_path=HOOK)
    )
    spec = build_claim_spec(
        ClaimSpecRequest(
            claim_uid="uid-1",
            namespace="ns",
            name="c",
            devices=(ClaimDevice(device=device),),
            common_edits=common,
        ),
        driver="gpu.drasil.dev",
    )
    assert_valid_cdi(schema_validator, spec)
    assert len(spec["containerEdits"]["hooks"]) == 4


@pytest.mark.parametrize(
    ("hook", "field"),
    [
        ({"hookName": "onBoot", "path": "/h"}, "hookName"),
        ({"hookName": "createContainer", "path": "h"}, "path"),
        ({"hookName": "createContainer", "path": "/h", "args": [1]}, "args"),
        ({"hookName": "createContainer", "path": "/h", "env": ["=x"]}, "env[0]"),
        ({"hookName": "createContainer", "path": "/h", "timeout": 0}, "timeout"),
        ({"hookName": "createContainer", "path": "/h", "when": {}}, "when"),
    ],
)
def test_bad_hooks_are_refused_naming_the_field(hook: dict[str, object], field: str) -> None:
    spec = {
        "cdiVersion": "0.5.0",
        "kind": "k8s.gpu.drasil.dev/claim",
        "devices": [{"name": "d", "containerEdits": {"env": ["A=1"]}}],
        "containerEdits": {"hooks": [hook]},
    }
    where = field.split("[", maxsplit=1)[0]
    with pytest.raises(CdiSpecError, match=rf"containerEdits\.hooks\[0\]\.?{where}"):
        validate_spec(spec)


# --- kept current -----------------------------------------------------------------------


def test_files_are_found_once_and_again_after_the_driver_changed(
    debian: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    from drasil.driver.nvidia import driveredits

    scans: list[str] = []
    real = driveredits.find_driver_files

    def counted(root: DriverRoot, version: str) -> object:
        scans.append(version)
        return real(root, version)

    monkeypatch.setattr(driveredits, "find_driver_files", counted)
    nvml = [VERSION]
    edits = NodeEdits(
        control=control_edits(()), root=debian.root, version=lambda: nvml[0], hook_path=HOOK
    )
    first = edits.current()
    assert edits.current() is first
    assert scans == [VERSION]

    # The driver is upgraded: the old files go, the new ones come, NVML says so.
    folder = debian.path / DEBIAN.lstrip("/")
    for old in folder.glob(f"*.so.{VERSION}"):
        old.unlink()
    debian.lib(DEBIAN, "libcuda", NEWER, "libcuda.so.1")
    debian.lib(DEBIAN, "libnvidia-ml", NEWER, "libnvidia-ml.so.1")
    nvml[0] = NEWER
    after = edits.current()
    assert scans == [VERSION, NEWER]
    libraries = [m.host_path for m in after.mounts if ".so." in m.host_path]
    assert libraries
    assert all(p.endswith(NEWER) for p in libraries)
    files = [m for m in after.mounts if m != VOID_MOUNT]  # the void marker is /dev/null
    assert all(os.path.exists(debian.path / m.container_path.lstrip("/")) for m in files)


def test_a_root_behind_nvml_is_an_error_naming_both_versions(debian: Root) -> None:
    edits = NodeEdits(control=control_edits(()), root=debian.root, version=lambda: NEWER)
    with pytest.raises(DriverFilesError, match=f"{VERSION}.*{NEWER}"):
        edits.current()


def test_without_a_root_only_the_control_nodes(tmp_path: Path) -> None:
    control = control_edits(("/dev/nvidiactl",))
    assert NodeEdits(control=control).current() is control


def test_nvml_is_loaded_from_the_root_and_found_by_its_soname(debian: Root) -> None:
    # In a child: a library loaded into this process would answer pynvml's dlopen later.
    code = (
        "import ctypes, sys\n"
        "from pathlib import Path\n"
        "from drasil.driver.nvidia.driverfiles import DriverRoot, load_nvml\n"
        "path = load_nvml(DriverRoot(host='/', local=Path(sys.argv[1])))\n"
        "lib = ctypes.CDLL('libnvidia-ml.so.1')\n"
        "print(path, lib.drasil_stub())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(debian.path)], capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == [
        str(debian.path / DEBIAN.lstrip("/") / f"libnvidia-ml.so.{VERSION}"),
        "0",
    ]


def test_a_root_without_nvml_loads_nothing(tmp_path: Path) -> None:
    from drasil.driver.nvidia.driverfiles import load_nvml

    assert load_nvml(DriverRoot(host="/", local=tmp_path)) is None

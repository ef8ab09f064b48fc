"""What NVIDIA's own CDI generator makes of each fake driver root (e2e.harness.driverroot).

These tests document `nvidia-ctk cdi generate --mode=management` at the pinned toolkit
version (e2e.harness.nvidiatoolkit) on every layout: which files it mounts, which hooks it adds
and with which arguments; and what nvml mode (NVIDIA's DRA driver's) adds to it. drasil's own
discovery is compared against the same oracle (e2e/test_driver_files.py).

No cluster: the e2e harness only builds the binaries first (nvidia-ctk among them). The
fake roots need root (mknod for the device nodes, `ldconfig -r` for the ld cache).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.harness import driverroot, mocknvml, nvidiatoolkit, versions
from e2e.harness.driverroot import FakeRoot, build_fake_root

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="fake driver roots need root (mknod, ldconfig -r)"
)

GPUS = 2
LIB_OPTIONS = ["ro", "nosuid", "nodev", "rbind", "rprivate"]
SOCKET_OPTIONS = ["nosuid", "nodev", "rbind", "rprivate", "noexec"]


@pytest.fixture(scope="module")
def hook() -> Path:
    return nvidiatoolkit.cdi_hook_path()


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FakeRoot]:
    base = tmp_path_factory.mktemp("driver-roots")
    return {
        layout: build_fake_root(base / layout, layout=layout, dev_nodes=True, gpus=GPUS)
        for layout in driverroot.LAYOUTS
    }


def _edits(spec: dict[str, Any]) -> dict[str, Any]:
    edits: dict[str, Any] = spec["containerEdits"]
    return edits


def _hooks(spec: dict[str, Any]) -> dict[str, list[str]]:
    """hook name -> its arguments after the name."""
    found: dict[str, list[str]] = {}
    for h in _edits(spec)["hooks"]:
        assert h["args"][0] == "nvidia-cdi-hook"
        assert h["args"][1] not in found, f"two {h['args'][1]} hooks"
        found[h["args"][1]] = h["args"][2:]
    return found


def _links(args: list[str]) -> list[str]:
    assert args[0::2] == ["--link"] * (len(args) // 2)
    return args[1::2]


def _expected_links(root: FakeRoot) -> set[str]:
    """The rule NVIDIA's generator follows (internal/discover/symlinks.go), applied to
    what the root holds: per mounted library, `<SONAME>` -> file when the SONAME link
    exists in the root; `<name>.so` -> SONAME when that link exists in the root; and
    always `libcuda.so` -> libcuda.so.1 and `libnvidia-opticalflow.so` ->
    libnvidia-opticalflow.so.1."""
    links: set[str] = set()
    for path in root.libraries:
        folder, name = path.rsplit("/", 1)
        soname = root.soname_of[name]
        if soname != name and f"{folder}/{soname}" in root.symlinks:
            links.add(f"{name}::{folder}/{soname}")
        dev = soname.split(".so")[0] + ".so"
        if f"{folder}/{dev}" in root.symlinks or dev in (
            "libcuda.so",
            "libnvidia-opticalflow.so",
        ):
            links.add(f"{soname}::{folder}/{dev}")
    return links


def test_the_tools_report_the_pinned_version(hook: Path) -> None:
    pinned = versions.NVIDIA_CONTAINER_TOOLKIT.lstrip("v")
    for tool in (nvidiatoolkit.ctk_path(), hook):
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, check=True)
        assert f"version {pinned}" in out.stdout


def test_fake_libraries_are_real_shared_objects(roots: dict[str, FakeRoot]) -> None:
    root = roots["debian"]
    for path in root.libraries:
        dynamic = subprocess.run(
            ["readelf", "-d", root.host(path)], capture_output=True, text=True, check=True
        ).stdout
        soname = root.soname_of[path.rsplit("/", 1)[1]]
        assert f"Library soname: [{soname}]" in dynamic, path
    # Loaded in a child process: once a library whose SONAME is libnvidia-ml.so.1 is in
    # a process, dlopen("libnvidia-ml.so.1") (pynvml, in the unit tests) would get it.
    probe = f"""
import ctypes
nvml = ctypes.CDLL({str(root.host(f"{root.lib_dirs[0]}/libnvidia-ml.so.1"))!r})
count, buf, cuda = ctypes.c_uint(), ctypes.create_string_buffer(80), ctypes.c_int()
assert nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 1  # uninitialized
assert nvml.nvmlInit_v2() == 0
assert nvml.nvmlSystemGetDriverVersion(buf, 80) == 0
assert nvml.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(cuda)) == 0
assert nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
nvml.nvmlErrorString.restype = ctypes.c_char_p
print(buf.value.decode(), cuda.value, count.value, nvml.nvmlErrorString(1).decode())
assert nvml.nvmlShutdown() == 0
lib = ctypes.CDLL({str(root.host(f"{root.lib_dirs[0]}/libcuda.so.1"))!r})
n, v = ctypes.c_int(), ctypes.c_int()
assert lib.cuDeviceGetCount(ctypes.byref(n)) == 3  # CUDA_ERROR_NOT_INITIALIZED
assert lib.cuInit(0) == 0
assert lib.cuDeviceGetCount(ctypes.byref(n)) == 0
assert lib.cuDriverGetVersion(ctypes.byref(v)) == 0
print(n.value, v.value)
"""
    env = {**os.environ, "FAKE_NVML_GPU_COUNT": "3"}
    env.pop("FAKE_CUDA_DRIVER_VERSION", None)
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [root.version, "13000", "3", "Uninitialized", "3", "13000"]


def test_fake_roots_are_cached_and_quick(tmp_path: Path) -> None:
    compiled = driverroot.compiled_libraries(driverroot.DEFAULT_VERSION)
    assert driverroot.compiled_libraries(driverroot.DEFAULT_VERSION) == compiled
    started = time.monotonic()
    root = build_fake_root(tmp_path / "root", layout="debian")
    assert time.monotonic() - started < 5
    assert root.device_nodes == ()
    assert not (tmp_path / "root" / "dev").exists()
    for path in root.binaries:
        assert os.access(root.host(path), os.X_OK)
    with pytest.raises(ValueError, match="not empty"):
        build_fake_root(tmp_path / "root", layout="debian")
    with pytest.raises(ValueError, match="unknown layout"):
        build_fake_root(tmp_path / "other", layout="arch")


@pytest.mark.parametrize("layout", list(driverroot.LAYOUTS))
def test_the_generator_on_each_layout(layout: str, roots: dict[str, FakeRoot], hook: Path) -> None:
    """Mounts: the current version's libraries, firmware, the five binaries, the
    persistenced socket, the `void` marker; hooks: create-symlinks, enable-cuda-compat,
    update-ldcache; env: NVIDIA_CTK_LIBCUDA_DIR, NVIDIA_VISIBLE_DEVICES=void."""
    root = roots[layout]
    run = nvidiatoolkit.reference_run(root.root, hook_path=hook, env=root.env())
    spec = run.spec
    # The fake NVML was asked for the version, nothing else (management mode).
    assert run.nvml_calls == ("nvmlInit_v2", "nvmlSystemGetDriverVersion", "nvmlShutdown")
    assert spec["kind"] == "nvidia.com/gpu"
    assert spec["cdiVersion"] == "0.5.0"
    edits = _edits(spec)

    mounts = {m["containerPath"]: m for m in edits["mounts"]}
    assert len(mounts) == len(edits["mounts"])
    for path, m in mounts.items():
        if path != "/var/run/nvidia-container-devices/void":
            assert m["hostPath"] == str(root.host(path))
    expected = {
        *root.libraries,
        *root.firmware,
        *(f"/usr/bin/{b}" for b in driverroot.BINARIES),
        *root.sockets,
        "/var/run/nvidia-container-devices/void",
    }
    assert set(mounts) == expected
    # Not version-suffixed, found by its own rule (libnvidia-nvvm70.so.*).
    assert f"{root.lib_dirs[0]}/libnvidia-nvvm70.so.4" in mounts
    # The layout's extra binaries (nvidia-installer, nvidia-modprobe) are not mounted.
    assert not set(root.binaries) - expected & set(mounts)
    for path in (*root.libraries, *root.firmware):
        assert mounts[path]["options"] == LIB_OPTIONS
    assert mounts["/run/nvidia-persistenced/socket"]["options"] == SOCKET_OPTIONS
    assert mounts["/var/run/nvidia-container-devices/void"] == {
        "hostPath": "/dev/null",
        "containerPath": "/var/run/nvidia-container-devices/void",
        "options": ["ro", "nosuid", "nodev", "bind"],
    }

    assert edits["env"] == [
        f"NVIDIA_CTK_LIBCUDA_DIR={root.lib_dirs[0]}",
        "NVIDIA_VISIBLE_DEVICES=void",
    ]
    for h in edits["hooks"]:
        assert h["hookName"] == "createContainer"
        assert h["path"] == str(hook)
        assert h["env"] == ["NVIDIA_CTK_DEBUG=false"]
    hooks = _hooks(spec)
    assert list(hooks) == ["create-symlinks", "enable-cuda-compat", "update-ldcache"]
    links = _links(hooks["create-symlinks"])
    assert len(links) == len(set(links))
    assert set(links) == _expected_links(root)
    assert hooks["enable-cuda-compat"] == [f"--host-driver-version={root.version}"]
    assert hooks["update-ldcache"] == [a for d in root.lib_dirs for a in ("--folder", d)]

    (device,) = spec["devices"]
    assert device["name"] == "all"
    nodes = {d["path"]: d for d in device["containerEdits"]["deviceNodes"]}
    assert set(nodes) == set(root.device_nodes)
    assert nodes["/dev/nvidiactl"]["major"] == 195
    assert nodes["/dev/nvidiactl"]["minor"] == 255
    assert nodes["/dev/nvidia-uvm-tools"]["major"] == 510
    assert "minor" not in nodes["/dev/nvidia0"]  # 0 is left out (omitempty)
    assert nodes["/dev/nvidia1"]["hostPath"] == str(root.host("/dev/nvidia1"))
    assert set(device["containerEdits"]) == {"deviceNodes"}


def test_the_generator_in_nvml_mode_adds_its_graphics_hooks(tmp_path: Path, hook: Path) -> None:
    """nvml mode (NVIDIA's DRA driver's), over the mock NVML of one H100: management
    mode's spec-wide edits, plus a create-symlinks hook of the graphics part first (GBM's
    backend, `../libnvidia-allocator.so.1`), disable-device-node-modification and
    update-application-profile last; each GPU's device gets apply-cuda-memory-limits."""
    root = build_fake_root(tmp_path / "root", layout="debian", dev_nodes=True)
    node = mocknvml.make_mock_node(tmp_path / "mock", "h100-80gb:1", node_name="n")
    mocknvml.install_mock(root.host(f"{root.lib_dirs[0]}/libnvidia-ml.so.{root.version}"), node)
    spec = nvidiatoolkit.reference_run(
        root.root, hook_path=hook, mode="nvml", require_fake_nvml=False
    ).spec
    commands = [h["args"][1] for h in _edits(spec)["hooks"]]
    assert commands == [
        "create-symlinks",
        "create-symlinks",
        "enable-cuda-compat",
        "update-ldcache",
        "disable-device-node-modification",
        "update-application-profile",
    ]
    lib = root.lib_dirs[0]
    gbm = _edits(spec)["hooks"][0]["args"][2:]
    assert gbm == ["--link", f"../libnvidia-allocator.so.1::{lib}/gbm/nvidia-drm_gbm.so"]
    void = {m["containerPath"]: m["hostPath"] for m in _edits(spec)["mounts"]}
    assert void["/var/run/nvidia-container-devices/void"] == "/dev/null"
    uuid = node.gpus[0].uuid
    device = next(d for d in spec["devices"] if d["name"] == uuid)
    (limits,) = device["containerEdits"]["hooks"]
    assert limits["hookName"] == "createRuntime"
    assert limits["args"][1:] == [
        "apply-cuda-memory-limits",
        "--driver-root",
        str(root.root),
        "--gpu-id",
        uuid,
    ]


def test_leftovers_of_an_older_driver_never_reach_the_spec(
    roots: dict[str, FakeRoot], hook: Path
) -> None:
    root = roots["leftovers"]
    assert root.old_version is not None
    assert root.old_libraries
    text = json.dumps(nvidiatoolkit.reference_spec(root.root, hook_path=hook))
    assert root.old_version not in text
    assert root.version in text


def test_without_nvml_the_generator_takes_the_first_libcuda_it_finds(
    hook: Path, tmp_path: Path
) -> None:
    """The hazard drasil must not copy: with no libnvidia-ml.so.1 to load, nvidia-ctk
    infers the version from the first `libcuda.so.*.*` (in glob order), here the
    leftover of the older driver, and mounts that driver's files."""
    root = build_fake_root(tmp_path / "root", layout="leftovers", dev_nodes=True)
    old = root.old_version
    root.host(f"{root.lib_dirs[0]}/libnvidia-ml.so.1").unlink()
    run = nvidiatoolkit.reference_run(root.root, hook_path=hook, require_fake_nvml=False)
    assert run.nvml_calls == ()
    assert f"Using driver version {old}" in run.log
    mounts = {m["containerPath"] for m in _edits(run.spec)["mounts"]}
    assert f"/usr/lib/x86_64-linux-gnu/libcuda.so.{old}" in mounts
    assert f"/lib/firmware/nvidia/{old}/gsp_ga10x.bin" in mounts
    assert _hooks(run.spec)["enable-cuda-compat"] == [f"--host-driver-version={old}"]


def test_libraries_outside_the_usual_folders_need_the_ld_cache(hook: Path, tmp_path: Path) -> None:
    """`custom-dir` works through etc/ld.so.cache alone (see the layout test); without
    it nothing leads to /opt/nvidia/lib64 and the generator fails."""
    root = build_fake_root(tmp_path / "root", layout="custom-dir", dev_nodes=True)
    root.host("/etc/ld.so.cache").unlink()
    with pytest.raises(nvidiatoolkit.OracleError, match="failed to determine driver version"):
        nvidiatoolkit.reference_run(root.root, hook_path=hook, require_fake_nvml=False)


def test_device_nodes_come_from_the_dev_root(hook: Path, tmp_path: Path) -> None:
    root = build_fake_root(tmp_path / "root", layout="debian")
    with pytest.raises(nvidiatoolkit.OracleError, match="no NVIDIA device nodes found"):
        nvidiatoolkit.reference_spec(root.root, hook_path=hook)
    dev_root = tmp_path / "host"
    nodes = driverroot.make_device_nodes(dev_root, 1)
    spec = nvidiatoolkit.reference_spec(root.root, dev_root=dev_root, hook_path=hook)
    (device,) = spec["devices"]
    found = {d["path"]: d["hostPath"] for d in device["containerEdits"]["deviceNodes"]}
    assert found == {n: str(dev_root.resolve() / n.lstrip("/")) for n in nodes}
    assert {m["containerPath"] for m in _edits(spec)["mounts"]} >= set(root.libraries)

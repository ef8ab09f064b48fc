"""The probe image (`versions.PROBE_IMAGE`) and its gpu-probe, without a cluster.

gpu-probe dlopens libcuda.so.1 and libnvidia-ml.so.1 by SONAME and prints one JSON
object. Here it runs against a tiny fake driver compiled by the test: on this host (with
LD_LIBRARY_PATH), inside the image's root filesystem with chroot (the image's own loader,
glibc and ld.so.cache), and, where `python -m e2e.harness.build` has built NVIDIA's
nvidia-cdi-hook, after that hook's create-symlinks and update-ldcache ran on the image's
root as runc runs them (a createContainer hook: in a private mount namespace where the
root filesystem is a mount point, before pivot_root).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from e2e.harness import node_images, paths, versions

DRIVER_VERSION = "999.12.3"
CUDA_VERSION = 12080
DEVICES = 3

FAKE_CUDA = r"""
int cuInit(unsigned int flags) { return flags == 0 ? CU_INIT_RESULT : 1; }
int cuDeviceGetCount(int *count) { *count = DEVICES; return 0; }
#ifndef OMIT_DRIVER_VERSION
int cuDriverGetVersion(int *version) { *version = CUDA_VERSION; return 0; }
#endif
"""
FAKE_NVML = r"""
#include <string.h>
static int initialized;
int nvmlInit_v2(void) { initialized = 1; return 0; }
int nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialized) return 1;
    strncpy(version, DRIVER_VERSION, length);
    return 0;
}
int nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialized) return 1;
    *count = DEVICES;
    return 0;
}
int nvmlShutdown(void) { initialized = 0; return 0; }
"""


def _cc(source: str, output: Path, soname: str, *defines: str) -> Path:
    src = output.with_suffix(".c")
    src.write_text(source)
    flags = [f"-DDEVICES={DEVICES}", f"-DCUDA_VERSION={CUDA_VERSION}"]
    flags.append(f'-DDRIVER_VERSION="{DRIVER_VERSION}"')
    if not any(d.startswith("CU_INIT_RESULT=") for d in defines):
        flags.append("-DCU_INIT_RESULT=0")
    flags += [f"-D{d}" for d in defines]
    cmd = ["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", *flags, "-o", str(output)]
    subprocess.run([*cmd, str(src)], check=True, capture_output=True, timeout=60)
    src.unlink()
    return output


def fake_driver(into: Path, *cuda_defines: str, soname_links: bool = True) -> Path:
    """libcuda.so.<version> and libnvidia-ml.so.<version> in `into` (SONAMEs
    libcuda.so.1 and libnvidia-ml.so.1), with the SONAME links unless told not to (the
    driver's real files are named by version; ldconfig makes the links)."""
    into.mkdir(parents=True, exist_ok=True)
    for stem, source, defines in (
        ("libcuda.so", FAKE_CUDA, cuda_defines),
        ("libnvidia-ml.so", FAKE_NVML, ()),
    ):
        _cc(source, into / f"{stem}.{DRIVER_VERSION}", f"{stem}.1", *defines)
        if soname_links:
            (into / f"{stem}.1").symlink_to(f"{stem}.{DRIVER_VERSION}")
    return into


def expected(lib_dir: str) -> dict[str, Any]:
    return {
        "libcuda": f"{lib_dir}/libcuda.so.1",
        "cuInit": 0,
        "cudaDevices": DEVICES,
        "cudaDriverVersion": CUDA_VERSION,
        "libnvml": f"{lib_dir}/libnvidia-ml.so.1",
        "nvmlInit": 0,
        "driverVersion": DRIVER_VERSION,
        "nvmlDevices": DEVICES,
    }


def run_probe(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """gpu-probe's exit code and its JSON (stdout must be exactly one object)."""
    done = subprocess.run(
        cmd,
        env=env or {"PATH": node_images.DEFAULT_PATH},
        capture_output=True,
        check=False,
        timeout=60,
    )
    lines = done.stdout.decode().splitlines()
    assert len(lines) == 1, (done.stdout, done.stderr)
    result: dict[str, Any] = json.loads(lines[0])
    return done.returncode, result


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("no gcc here (python -m e2e.harness.build installs it)")
    return node_images.compile_probe(tmp_path_factory.mktemp("probe") / "gpu-probe")


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the probe image is built with `ldconfig -r` and run with chroot: root")


@pytest.fixture(scope="module")
def image() -> node_images.Image:
    _needs_root()
    return node_images.ensure_probe_image()


@pytest.fixture
def rootfs(image: node_images.Image, tmp_path: Path) -> Path:
    return node_images.unpack_image(image, tmp_path / "bundle" / "rootfs")


# -- on this host -------------------------------------------------------------------


def test_the_probe_loads_the_driver_by_soname(probe: Path, tmp_path: Path) -> None:
    lib = fake_driver(tmp_path / "lib")
    env = {"PATH": node_images.DEFAULT_PATH, "LD_LIBRARY_PATH": str(lib)}
    code, result = run_probe([str(probe)], env)
    assert (code, result) == (0, expected(str(lib)))
    assert list(result) == list(expected(str(lib)))  # the documented order


@pytest.mark.parametrize(
    ("defines", "step", "error"),
    [
        (("CU_INIT_RESULT=3",), "cuInit", "cuInit returned 3"),
        (("OMIT_DRIVER_VERSION",), "dlsym cuDriverGetVersion", "undefined symbol"),
    ],
)
def test_the_probe_names_the_step_that_failed(
    probe: Path, tmp_path: Path, defines: tuple[str, ...], step: str, error: str
) -> None:
    lib = fake_driver(tmp_path / "lib", *defines)
    env = {"PATH": node_images.DEFAULT_PATH, "LD_LIBRARY_PATH": str(lib)}
    code, result = run_probe([str(probe)], env)
    assert code == 1
    assert result["step"] == step
    assert error in result["error"]
    assert result["libcuda"] == f"{lib}/libcuda.so.1"
    assert "libnvml" not in result


# -- in the image's root filesystem ---------------------------------------------------


def test_the_image_is_cached(image: node_images.Image) -> None:
    assert image.name == versions.PROBE_IMAGE
    assert image.archive.parent == node_images.images_dir()
    again = node_images.ensure_probe_image()
    assert again == image


def test_the_image_has_glibc_an_ld_cache_and_the_probe(rootfs: Path) -> None:
    assert (rootfs / "etc/ld.so.conf").read_text() == "include /etc/ld.so.conf.d/*.conf\n"
    assert list((rootfs / "etc/ld.so.conf.d").iterdir()) == []
    assert (rootfs / "etc/ld.so.cache").is_file()
    assert os.access(rootfs / node_images.PROBE_IN_IMAGE.lstrip("/"), os.X_OK)
    cache = subprocess.run(
        ["chroot", str(rootfs), "/sbin/ldconfig", "-p"],
        env={"PATH": node_images.DEFAULT_PATH},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    libc = [line for line in cache.splitlines() if line.strip().startswith("libc.so.6 ")]
    assert len(libc) == 1, cache
    assert "=> /lib/" in libc[0], cache
    shell = subprocess.run(
        ["chroot", str(rootfs), "sh", "-c", "echo $((6 * 7))"],
        env={"PATH": node_images.DEFAULT_PATH},
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert shell.stdout == "42\n", shell.stderr


def test_the_image_loads_the_driver_through_its_ld_cache(rootfs: Path) -> None:
    """The image's loader finds the driver only once ldconfig put it in the cache (a
    directory outside the default search path, as a driver root mounted by CDI)."""
    chroot = ["chroot", str(rootfs)]
    code, result = run_probe([*chroot, node_images.PROBE_IN_IMAGE])
    assert code == 1
    assert result["step"] == "dlopen libcuda.so.1"  # the image's glibc runs the probe
    fake_driver(rootfs / "opt/fake-driver/lib", soname_links=False)
    (rootfs / "etc/ld.so.conf.d/00-fake.conf").write_text("/opt/fake-driver/lib\n")
    subprocess.run([*chroot, "/sbin/ldconfig"], check=True, capture_output=True, timeout=60)
    code, result = run_probe([*chroot, node_images.PROBE_IN_IMAGE])
    assert (code, result) == (0, expected("/opt/fake-driver/lib"))


# -- after NVIDIA's hooks --------------------------------------------------------------


def hook_script(hook: Path, bundle: Path, *hook_args: list[str]) -> str:
    """A shell script for a private mount namespace: the root filesystem made a mount
    point (as runc makes it), the container's state on each hook's stdin."""
    state = json.dumps(
        {
            "ociVersion": "1.2.0",
            "id": "probe",
            "status": "creating",
            "pid": 1,
            "bundle": str(bundle),
        }
    )
    root = bundle / "rootfs"
    lines = ["set -e", f"mount --bind '{root}' '{root}'"]
    for args in hook_args:
        lines.append(f"echo '{state}' | '{hook}' {' '.join(args)}")
    return "\n".join(lines) + "\n"


def run_hooks(hook: Path, bundle: Path, *hook_args: list[str]) -> None:
    (bundle / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}}))
    script = hook_script(hook, bundle, *hook_args)
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def check_after_nvidia_hooks(hook: Path, rootfs: Path) -> None:
    """create-symlinks, enable-cuda-compat (a no-op: no compat libraries) and
    update-ldcache as nvidia-ctk's CDI specs order them, twice; then the probe."""
    lib_dir = "/usr/local/nvidia/lib64"
    fake_driver(rootfs / lib_dir.lstrip("/"), soname_links=False)
    hooks = [
        ["create-symlinks", "--link", f"libcuda.so.1::{lib_dir}/libcuda.so"],
        ["enable-cuda-compat", f"--host-driver-version={DRIVER_VERSION}"],
        ["update-ldcache", "--folder", lib_dir],
    ]
    for _ in range(2):  # a second run changes nothing that matters
        run_hooks(hook, rootfs.parent, *hooks)
        code, result = run_probe(["chroot", str(rootfs), node_images.PROBE_IN_IMAGE])
        assert (code, result) == (0, expected(lib_dir))
    confs = {p.name: p.read_text() for p in (rootfs / "etc/ld.so.conf.d").iterdir()}
    ours = [text for name, text in confs.items() if name.startswith("00-nvcr-")]
    assert ours == [f"{lib_dir}\n"]  # written once: the second run finds it listed
    assert not any(name.startswith("00-compat-") for name in confs)
    assert os.readlink(rootfs / lib_dir.lstrip("/") / "libcuda.so") == "libcuda.so.1"
    assert os.readlink(rootfs / lib_dir.lstrip("/") / "libcuda.so.1") == (
        f"libcuda.so.{DRIVER_VERSION}"  # made by ldconfig, run by update-ldcache
    )


def test_the_image_loads_the_driver_after_nvidia_cdi_hook(rootfs: Path) -> None:
    hook = paths.bin_dir() / "nvidia-cdi-hook"
    if not hook.is_file():
        pytest.skip(f"no {hook} (python -m e2e.harness.build nvidia-cdi-hook builds it)")
    if shutil.which("unshare") is None:
        pytest.skip("no unshare (util-linux) here")
    check_after_nvidia_hooks(hook, rootfs)

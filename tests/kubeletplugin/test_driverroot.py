"""The plugin's driver-root flags, the hook it puts on the host, its readiness checks,
and ``drasil doctor``."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from drasil.driver.cli import main as drasil
from drasil.driver.simulated.nvml import simulated_library
from drasil.kubeletplugin.options import OptionsError, PluginOptions, parse_options
from drasil.kubeletplugin.vendors.nvidia.driverroot import (
    cdi_hook_path,
    driver_root,
    install_hook,
    node_edits,
    readiness,
)

VERSION = "580.95.05"
LIBS = "usr/lib/x86_64-linux-gnu"


def _opts(*argv: str, **env: str) -> PluginOptions:
    return parse_options(list(argv), {"NODE_NAME": "n", **env})


def test_defaults_name_no_root_and_enable_hooks() -> None:
    opts = _opts()
    assert opts.nvidia_driver_root is None
    assert opts.driver_root_host == "/"
    assert opts.driver_root_local == Path("/")
    assert opts.nvidia_cdi_hook_path is None
    assert opts.cdi_hooks == "enabled"


def test_env_names_are_nvidias() -> None:
    opts = _opts(
        NVIDIA_DRIVER_ROOT="/run/nvidia/driver",
        CONTAINER_DRIVER_ROOT="/driver-root",
        NVIDIA_CDI_HOOK_PATH="/usr/bin/nvidia-cdi-hook",
        CDI_HOOKS="disabled",
    )
    assert opts.driver_root_host == "/run/nvidia/driver"
    assert opts.driver_root_local == Path("/driver-root")
    assert opts.nvidia_cdi_hook_path == "/usr/bin/nvidia-cdi-hook"
    assert opts.cdi_hooks == "disabled"


@pytest.mark.parametrize(
    "flag", ["--nvidia-driver-root", "--container-driver-root", "--nvidia-cdi-hook-path"]
)
def test_relative_paths_are_refused_naming_the_flag(flag: str) -> None:
    with pytest.raises(OptionsError, match=f"{flag}: 'run/nvidia' is not an absolute path"):
        _opts(flag, "run/nvidia")


def test_a_bad_hooks_value_names_the_allowed_ones() -> None:
    with pytest.raises(OptionsError, match=r"--cdi-hooks: .*'maybe'.*enabled"):
        _opts(CDI_HOOKS="maybe")


def test_simulated_gpus_get_driver_files_only_from_a_given_root() -> None:
    assert driver_root(_opts("--backend", "simulated")) is None
    assert driver_root(_opts("--backend", "nvml")) is not None
    # Given, but holding no driver (the chart's default on a machine without one): none.
    assert driver_root(_opts("--backend", "simulated", "--nvidia-driver-root", "/x")) is None


def test_the_images_hook_is_copied_once_and_named_by_its_host_path(tmp_path: Path) -> None:
    bundled = tmp_path / "bundled"
    bundled.write_bytes(b"#!/bin/sh\necho 1.20.2\n")
    opts = _opts("--plugins-dir", str(tmp_path / "plugins"), DRASIL_BUNDLED_CDI_HOOK=str(bundled))
    path = cdi_hook_path(opts)
    assert path == str(tmp_path / "plugins/gpu.drasil.dev/nvidia-cdi-hook")
    assert os.access(path, os.X_OK)
    assert Path(path).read_bytes() == bundled.read_bytes()
    before = Path(path).stat().st_ino
    install_hook(bundled, opts.state_dir)  # the same bytes: left alone
    assert Path(path).stat().st_ino == before
    bundled.write_bytes(b"#!/bin/sh\necho 1.20.3\n")
    install_hook(bundled, opts.state_dir)  # a new image: replaced
    assert Path(path).read_bytes().endswith(b"1.20.3\n")


def test_a_given_hook_path_or_disabled_hooks_copy_nothing(tmp_path: Path) -> None:
    plugins = str(tmp_path / "plugins")
    given = _opts("--plugins-dir", plugins, "--nvidia-cdi-hook-path", "/usr/bin/nvidia-cdi-hook")
    assert cdi_hook_path(given) == "/usr/bin/nvidia-cdi-hook"
    assert cdi_hook_path(_opts("--plugins-dir", plugins, "--cdi-hooks", "disabled")) is None
    missing = _opts("--plugins-dir", plugins, DRASIL_BUNDLED_CDI_HOOK=str(tmp_path / "none"))
    assert cdi_hook_path(missing) is None
    assert not (tmp_path / "plugins").exists()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A minimal driver root: libcuda and libnvidia-ml of VERSION."""
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler")
    folder = tmp_path / "root" / LIBS
    folder.mkdir(parents=True)
    src = tmp_path / "s.c"
    src.write_text("int drasil_stub(void) { return 0; }\n")
    for name in ("libcuda", "libnvidia-ml"):
        out = folder / f"{name}.so.{VERSION}"
        subprocess.run(
            ["cc", "-shared", "-fPIC", f"-Wl,-soname,{name}.so.1", "-o", out, src], check=True
        )
        (folder / f"{name}.so.1").symlink_to(out.name)
    return tmp_path / "root"


def test_a_given_root_with_a_driver_counts_for_simulated_gpus(root: Path) -> None:
    given = driver_root(_opts("--backend", "simulated", "--nvidia-driver-root", str(root)))
    assert given is not None
    assert given.host == str(root)


def test_readiness_names_the_missing_hook_and_passes_the_driver(root: Path, tmp_path: Path) -> None:
    opts = _opts(
        "--backend",
        "simulated",
        "--nvidia-driver-root",
        str(root),
        "--plugins-dir",
        str(tmp_path / "plugins"),
        DRASIL_BUNDLED_CDI_HOOK=str(tmp_path / "none"),
    )
    lib = simulated_library("h100-80gb:1", node_name="n")
    edits = node_edits(opts, lib)
    checks = {c.name: c for c in readiness(opts, lib, edits)}
    assert checks["driver files"].ok
    assert VERSION in checks["driver files"].detail
    assert not checks["cdi hook"].ok
    assert "no nvidia-cdi-hook" in checks["cdi hook"].detail
    assert f"libcuda.so.{VERSION}" in str(edits.current().mounts)


def test_doctor_reports_each_check_and_exits_non_zero_on_a_failure(
    root: Path, tmp_path: Path
) -> None:
    hook = tmp_path / "hook"
    hook.write_text("#!/bin/sh\necho 'NVIDIA CDI Hook 1.20.2'\n")
    hook.chmod(0o755)
    out = io.StringIO()
    args = ["doctor", "--backend", "simulated", "--nvidia-driver-root", str(root)]
    assert drasil([*args, "--nvidia-cdi-hook-path", str(hook)], out=out) == 0
    text = out.getvalue()
    assert f"ok    driver files: {root}: driver {VERSION}" in text
    assert "ok    cdi hook: " in text
    assert "1.20.2" in text

    out = io.StringIO()
    assert drasil([*args, "--nvidia-cdi-hook-path", str(tmp_path / "gone")], out=out) == 1
    assert out.getvalue().startswith("FAIL  cdi hook:")

    out = io.StringIO()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (
        drasil(["doctor", "--backend", "simulated", "--nvidia-driver-root", str(empty)], out=out)
        == 1
    )
    assert "holds no libcuda.so.*" in out.getvalue()

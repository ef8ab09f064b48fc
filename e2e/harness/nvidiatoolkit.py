"""NVIDIA's own CDI generator as the oracle of the driver files drasil puts in its specs.

`nvidia-ctk` and `nvidia-cdi-hook` are built from the NVIDIA Container Toolkit's Go module
at `versions.NVIDIA_CONTAINER_TOOLKIT` by the harness's build machinery
(`e2e.harness.recipes.nvidia_toolkit_binaries`, `python -m e2e.harness.build`) into the
cache's bin dir,
`<cache>/e2e/<kubernetes version>/bin/`; `ctk_path()` and `cdi_hook_path()` build them
when missing or stale.

`reference_spec(root, hook_path=...)` runs `nvidia-ctk cdi generate --mode=management` on
a driver root (a fake one from `e2e.harness.driverroot`, usually) and returns the CDI spec it
wrote, as parsed JSON; `reference_run(root, mode="nvml", ...)` runs the mode NVIDIA's DRA
driver uses. The run is hermetic: a clean environment (no NVIDIA_CTK_* variable
of ours reaches it, PATH is the default one, whose folders it also searches inside the
root), an empty config file instead of /etc/nvidia-container-runtime/config.toml, and no
LD_LIBRARY_PATH: nvidia-ctk finds `libnvidia-ml.so.1` in the root itself (the standard
library folders under the root, else the root's ld.so.cache) and dlopens it by its full
path. The fake NVML traces its calls (FAKE_NVML_TRACE), so the run can prove that it was
the root's NVML that answered, and every mount's host path is checked to lie in the root:
nothing of this machine's own driver (if it has one) can slip into the oracle.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e.harness.binaries import Writer, ensure_binaries

# nvidia-ctk's own default PATH (pkg/lookup/path.go); it also looks for executables in
# <driver root>/<each PATH folder>, so the oracle's PATH is fixed, not this process's.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The one host path a management spec mounts that is not in the driver root: the
# `NVIDIA_VISIBLE_DEVICES=void` marker (/dev/null on /var/run/nvidia-container-devices/void).
VOID_MOUNT_HOST_PATH = "/dev/null"
TIMEOUT_S = 120


class OracleError(RuntimeError):
    """nvidia-ctk failed, or its spec used something outside the given roots."""


def ctk_path(*, out: Writer | None = None) -> Path:
    """The pinned `nvidia-ctk`, built first if missing or stale (e2e.harness.binaries)."""
    return ensure_binaries(["nvidia-ctk"], out=out)["nvidia-ctk"]


def cdi_hook_path(*, out: Writer | None = None) -> Path:
    """The pinned `nvidia-cdi-hook`, built first if missing or stale (e2e.harness.binaries)."""
    return ensure_binaries(["nvidia-cdi-hook"], out=out)["nvidia-cdi-hook"]


@dataclass(frozen=True)
class OracleRun:
    """One `nvidia-ctk cdi generate` run."""

    command: tuple[str, ...]
    spec: dict[str, Any]
    # nvidia-ctk's log (stderr): which files it selected, what it could not find.
    log: str
    # The fake NVML's functions in the order it was called (empty with a real or no NVML).
    nvml_calls: tuple[str, ...]


def _under(path: str, root: Path) -> bool:
    return Path(path) == root or root in Path(path).parents


def _check(spec: dict[str, Any], *, root: Path, dev_root: Path, hook: Path) -> None:
    edits = [spec.get("containerEdits") or {}]
    edits += [d.get("containerEdits") or {} for d in spec.get("devices") or []]
    wrong: list[str] = []
    for edit in edits:
        for m in edit.get("mounts") or []:
            host = m["hostPath"]
            if host != VOID_MOUNT_HOST_PATH and not _under(host, root):
                wrong.append(f"mount {host}")
        for d in edit.get("deviceNodes") or []:
            host = d.get("hostPath") or d["path"]
            if not _under(host, dev_root):
                wrong.append(f"device node {host}")
        for h in edit.get("hooks") or []:
            if h["path"] != str(hook):
                wrong.append(f"hook {h['path']}")
    if wrong:
        raise OracleError(
            f"nvidia-ctk's spec uses paths outside {root} (dev root {dev_root}): "
            + ", ".join(wrong)
        )


def reference_run(
    driver_root: Path,
    *,
    dev_root: Path | None = None,
    hook_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    require_fake_nvml: bool = True,
    mode: str = "management",
) -> OracleRun:
    """Run `nvidia-ctk cdi generate --mode=<mode>` on `driver_root` (and `dev_root`
    for /dev, default the driver root) with `hook_path` as the hooks' binary (default
    `cdi_hook_path()`; the path is only written into the spec, never run). `mode`
    "nvml" (NVIDIA's DRA driver's) lists the GPUs through the root's NVML: give the
    root the mock NVML (`mocknvml.install_mock`) and `require_fake_nvml=False`.

    `env` is added to the clean environment (e.g. FakeRoot.env(): FAKE_NVML_GPU_COUNT);
    `extra_args` go after the standard flags (e.g. `--ldconfig-path=/sbin/ldconfig`).
    Management mode needs device nodes: a root without /dev/nvidia* fails ("no NVIDIA
    device nodes found").

    Raises OracleError when nvidia-ctk fails, when a mount, device node or hook of its
    spec lies outside the given roots, or (with `require_fake_nvml`) when the fake NVML
    of the root was not the one asked for the driver version."""
    root = driver_root.resolve()
    devs = (dev_root or driver_root).resolve()
    hook = hook_path if hook_path is not None else cdi_hook_path()
    ctk = ctk_path()
    with tempfile.TemporaryDirectory(prefix="drasil-nvidia-ctk-") as tmp:
        work = Path(tmp)
        config = work / "config.toml"
        config.write_text("")
        trace = work / "nvml.trace"
        output = work / "spec.json"
        command = [
            str(ctk),
            f"--config={config}",
            "cdi",
            "generate",
            f"--mode={mode}",
            f"--driver-root={root}",
            *([f"--dev-root={devs}"] if dev_root is not None else []),
            f"--nvidia-cdi-hook-path={hook}",
            "--format=json",
            f"--output={output}",
            *extra_args,
        ]
        run_env = {
            "PATH": DEFAULT_PATH,
            "HOME": str(work),
            "LANG": "C",
            **(env or {}),
            "FAKE_NVML_TRACE": str(trace),
        }
        try:
            done = subprocess.run(
                command,
                env=run_env,
                cwd=work,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise OracleError(f"{shlex.join(command)}: {e}") from e
        if done.returncode != 0 or not output.is_file():
            raise OracleError(
                f"{shlex.join(command)} exited {done.returncode}:\n{done.stderr[-4000:]}"
            )
        spec = json.loads(output.read_text())
        calls = tuple(trace.read_text().split()) if trace.is_file() else ()
    if require_fake_nvml and "nvmlSystemGetDriverVersion" not in calls:
        raise OracleError(
            f"the fake NVML of {root} was not asked for the driver version (calls: "
            f"{list(calls)}); nvidia-ctk's log:\n{done.stderr[-4000:]}"
        )
    _check(spec, root=root, dev_root=devs, hook=hook)
    return OracleRun(tuple(command), spec, done.stderr, calls)


def reference_spec(
    driver_root: Path,
    *,
    dev_root: Path | None = None,
    hook_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> dict[str, Any]:
    """The CDI spec (parsed JSON) that NVIDIA's generator makes of `driver_root` in
    management mode; see `reference_run`."""
    return reference_run(
        driver_root, dev_root=dev_root, hook_path=hook_path, env=env, extra_args=extra_args
    ).spec


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m e2e.harness.nvidiatoolkit <driver root> [<dev root>]`: print the spec."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 2:
        print("usage: python -m e2e.harness.nvidiatoolkit DRIVER_ROOT [DEV_ROOT]", file=sys.stderr)
        return 2
    run = reference_run(
        Path(args[0]),
        dev_root=Path(args[1]) if len(args) > 1 else None,
        env={k: v for k, v in os.environ.items() if k.startswith("FAKE_")},
        require_fake_nvml=False,
    )
    print(json.dumps(run.spec, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The container step: the claim's CDI devices run under a private containerd and runc.

The sandbox step applies the spec itself; a user's node does not. Here the spec is read
by containerd's own CDI code (``ctr run --device <CDI name>``, the same
``pkg/cdi.WithCDIDevices`` the CRI plugin uses), runc starts the container and runs the
spec's hooks (NVIDIA's ``nvidia-cdi-hook`` for real: links, ld cache, CUDA compat), and
the program in the container, ``gpu-kernel`` of the probe image, runs a PTX kernel
through the driver API and checks its values (e2e/harness/probe/gpu_kernel.c).

What it needs comes in a *kit* (``--container-kit``; the bundle carries one): ``bin/``
with containerd, its runc shim, runc and ctr (those of the e2e harness, pinned) and
NVIDIA's ``nvidia-cdi-hook`` (the specs name it where the machine has none), ``lib/``
with what runc links beyond glibc (libseccomp), ``image.oci.tar`` (the probe image) and
``kit.json`` naming the image and the probe. The containerd is the check's own: its
root, state, socket and runc root under the work dir, stopped and removed after. It
runs, with ctr, in a private mount namespace (``unshare``), where the Preparer's CDI
folder is bound over ``/var/run/cdi`` and an empty one over ``/etc/cdi`` (ctr reads the
default CDI folders only): nothing of the host's CDI specs, mounts or containerd is
touched. Where containerd cannot run (no cgroup file system, v2 or v1; no overlay file
system; no ``unshare``) the step is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drasil.kubeletplugin.gpucheck.report import Step, judged, skipped, with_details

STEP = "container"
NAMESPACE = "drasil-gpucheck"
BINARIES = ("containerd", "containerd-shim-runc-v2", "runc", "ctr")
TIMEOUT_S = 240
VALUES = 4096  # what gpu-kernel checks


class KitError(RuntimeError):
    """The container kit is missing a part (the message names it)."""


@dataclass(frozen=True)
class Kit:
    root: Path
    image: str
    probe: str
    machine: str = ""  # what its binaries run on (platform.machine()); "" unknown

    def bin(self, name: str) -> Path:
        return self.root / "bin" / name


def load_kit(root: Path) -> Kit:
    """The kit at ``root``; raises KitError naming what is missing."""
    meta = root / "kit.json"
    if not meta.is_file():
        raise KitError(f"{meta} missing")
    facts = json.loads(meta.read_text())
    kit = Kit(
        root=root,
        image=str(facts["image"]),
        probe=str(facts["probe"]),
        machine=str(facts.get("machine", "")),
    )
    missing = [n for n in BINARIES if not os.access(kit.bin(n), os.X_OK)]
    if not (root / "image.oci.tar").is_file():
        missing.append("image.oci.tar")
    if missing:
        raise KitError(f"the container kit {root} lacks {', '.join(missing)}")
    return kit


def kit_hook(root: Path | None) -> str | None:
    """The kit's ``nvidia-cdi-hook`` (for a machine without NVIDIA's toolkit), or None."""
    hook = root / "bin" / "nvidia-cdi-hook" if root is not None else None
    return str(hook) if hook is not None and os.access(hook, os.X_OK) else None


def cgroup_mounts(mounts: str) -> list[Path]:
    """The cgroup hierarchies (v2 or v1) in a /proc/mounts text."""
    found = []
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] in ("cgroup", "cgroup2"):
            found.append(Path(parts[1]))
    return found


def why_not(*, proc_root: Path = Path("/proc")) -> str | None:
    """Why a containerd cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    try:
        mounts = (proc_root / "mounts").read_text()
        filesystems = (proc_root / "filesystems").read_text()
    except OSError as e:
        return f"cannot read {proc_root}: {e}"
    if not cgroup_mounts(mounts):
        return "no cgroup file system mounted (runc needs cgroup v2, or v1 hierarchies)"
    if not any(line.split()[-1:] == ["overlay"] for line in filesystems.splitlines()):
        return "no overlay file system (containerd's overlayfs snapshotter)"
    for tool in ("unshare", "mount"):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH (util-linux)"
    return None


def containerd_toml(work: Path) -> str:
    """A containerd of its own: nothing of the CRI (no kubelet here), no host paths."""

    def q(value: Path | str) -> str:
        return json.dumps(str(value))  # a TOML basic string is a JSON string

    return f"""\
version = 3
root = {q(work / "root")}
state = {q(work / "state")}
temp = {q(work / "tmp")}
disabled_plugins = [
  "io.containerd.grpc.v1.cri",
  "io.containerd.cri.v1.images",
  "io.containerd.cri.v1.runtime",
  "io.containerd.podsandbox.controller.v1.podsandbox",
  "io.containerd.nri.v1.nri",
  "io.containerd.internal.v1.opt",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = {q(work / "containerd.sock")}

[ttrpc]
  address = {q(work / "containerd.sock.ttrpc")}
"""


SCRIPT = """\
set -u
mount --bind "$CDI_DIR" /var/run/cdi
if [ -d /etc/cdi ]; then mount --bind "$EMPTY_DIR" /etc/cdi; fi
"$KIT/bin/containerd" --config "$WORK/containerd.toml" >"$WORK/containerd.log" 2>&1 &
daemon=$!
ctr() { "$KIT/bin/ctr" -a "$WORK/containerd.sock" -n "$NAMESPACE" "$@"; }
i=0
until ctr version >/dev/null 2>&1; do
  i=$((i + 1))
  if [ "$i" -gt 300 ] || ! kill -0 "$daemon" 2>/dev/null; then
    echo "containerd did not answer" >"$WORK/step"; kill "$daemon" 2>/dev/null; exit 3
  fi
  sleep 0.1
done
if ! ctr images import --snapshotter overlayfs "$KIT/image.oci.tar" >"$WORK/import.log" 2>&1
then
  echo "ctr images import" >"$WORK/step"; kill "$daemon"; wait "$daemon"; exit 4
fi
# shellcheck disable=SC2086
ctr run --rm --snapshotter overlayfs --runc-binary "$KIT/bin/runc" --runc-root "$WORK/runc" \\
  $DEVICES "$IMAGE" "$ID" "$PROBE" $ARGS >"$WORK/probe.out" 2>"$WORK/probe.err"
echo $? >"$WORK/probe.rc"
kill "$daemon"
wait "$daemon"
exit 0
"""


@dataclass(frozen=True)
class Run:
    """What one container run left: the probe's JSON (or None), the exit code, and the
    logs that say why where it failed."""

    seen: dict[str, Any] | None
    returncode: int | None
    failed_step: str
    log: str


def run_probe(
    kit: Kit, *, cdi_dir: Path, devices: Sequence[str], work: Path, args: Sequence[str] = ()
) -> Run:
    """Start the check's containerd, run ``kit.probe`` of ``kit.image`` with the CDI
    ``devices`` (qualified names) of the specs in ``cdi_dir``, stop everything."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "empty").mkdir(exist_ok=True)
    (work / "containerd.toml").write_text(containerd_toml(work))
    made_run_cdi = not os.path.isdir("/var/run/cdi")
    os.makedirs("/var/run/cdi", exist_ok=True)  # the mount point; the bind is private
    env = {
        "PATH": f"{kit.root / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin",
        "LD_LIBRARY_PATH": str(kit.root / "lib"),  # runc's libseccomp, where it needs one
        "KIT": str(kit.root),
        "WORK": str(work),
        "CDI_DIR": str(cdi_dir),
        "EMPTY_DIR": str(work / "empty"),
        "NAMESPACE": NAMESPACE,
        "DEVICES": " ".join(f"--device {d}" for d in devices),
        "IMAGE": kit.image,
        "ID": f"gpu-check-{os.getpid()}",
        "PROBE": kit.probe,
        "ARGS": " ".join(args),
    }
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", SCRIPT]
    try:
        _run_bounded(command, env, work)
    finally:
        _stop_leftovers(work)
        _remove_cgroup(NAMESPACE)
        if made_run_cdi:
            _rmdir_quietly(Path("/var/run/cdi"))
    return _outcome(work)


def _run_bounded(command: list[str], env: Mapping[str, str], work: Path) -> None:
    proc = subprocess.Popen(
        command, env=dict(env), cwd=work, start_new_session=True, stdin=subprocess.DEVNULL
    )
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        (work / "step").write_text(f"the container step ran past {TIMEOUT_S} s\n")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _stop_leftovers(work: Path) -> None:
    """Kill what the run may have left (a shim outlives its containerd): every process
    whose command line names this run's socket or config."""
    marks = (str(work / "containerd.sock"), str(work / "containerd.toml"))
    for pid in _pids_naming(marks):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    time.sleep(0.1)


def _pids_naming(marks: Sequence[str]) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(m in cmdline for m in marks):
            found.append(int(entry.name))
    return found


def _remove_cgroup(namespace: str) -> None:
    """runc's cgroups go with their containers; the folder of ctr's namespace stays, in
    each hierarchy: remove it (left where something still uses it)."""
    try:
        mounts = Path("/proc/mounts").read_text()
    except OSError:
        return
    for hierarchy in cgroup_mounts(mounts):
        _rmdir_quietly(hierarchy / namespace)


def _rmdir_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _outcome(work: Path) -> Run:
    rc_text = _read(work / "probe.rc").strip()
    out = _read(work / "probe.out")
    line = next((x for x in reversed(out.splitlines()) if x.startswith("{")), None)
    seen = json.loads(line) if line else None
    logs = [
        f"{name}: {text.strip()[-1500:]}"
        for name in ("step", "probe.err", "import.log", "containerd.log")
        if (text := _read(work / name)).strip()
    ]
    return Run(
        seen=seen,
        returncode=int(rc_text) if rc_text.isdigit() else None,
        failed_step=_read(work / "step").strip(),
        log="\n".join(logs),
    )


# ---- judging -------------------------------------------------------------------------


def kernel_problems(
    run: Run, expected: Sequence[str], *, limit_mib: int | None = None
) -> list[str]:
    """What a container of exactly the ``expected`` GPUs must not show: a failed run, a
    GPU too many or too few, a kernel whose values are wrong; under an MPS share of
    ``limit_mib``, more memory free than the share or an over-limit allocation granted."""
    seen = run.seen
    if run.returncode is None or seen is None:
        said = f"the container did not run: {run.failed_step or 'no output'}"
        return [said, run.log] if run.log else [said]
    problems = []
    if "error" in seen:
        problems.append(f"gpu-kernel failed at {seen.get('step')}: {seen['error']}")
    uuids = [u for u in str(seen.get("uuids", "")).split(",") if u]
    if "uuids" in seen and uuids != list(expected):
        problems.append(f"NVML in the container sees {uuids}, expected {list(expected)}")
    if "cudaDevices" in seen and seen["cudaDevices"] != len(expected):
        problems.append(f"CUDA sees {seen['cudaDevices']} device(s), expected {len(expected)}")
    if "error" not in seen and (seen.get("values") != VALUES or seen.get("wrong") != 0):
        problems.append(f"kernel: {seen.get('wrong')} of {seen.get('values')} values wrong")
    if limit_mib is not None and "freeMiB" in seen:
        if seen["freeMiB"] > limit_mib:
            problems.append(f"{seen['freeMiB']} MiB free, over the share's {limit_mib} MiB")
        if seen.get("allocResult") == 0:
            problems.append(f"an allocation of {seen.get('allocMiB')} MiB was granted")
    if run.returncode != 0 and not problems:
        problems.append(f"ctr run exited {run.returncode}: {run.log}")
    return problems


def ready_kit(kit_dir: Path | None) -> Kit | str:
    """The kit, where it can run here; else why not (a step's skip reason). Raises
    KitError for a kit that lacks a part."""
    if kit_dir is None:
        return "no container kit (the bundle brings one; or --container-kit)"
    kit = load_kit(kit_dir)
    here = platform.machine()
    if kit.machine not in ("", here):
        return f"the container kit is for {kit.machine}, this is {here}"
    reason = why_not()
    return kit if reason is None else f"containerd cannot run here: {reason}"


def container_step(
    kit_dir: Path | None,
    *,
    cdi_dir: Path,
    cdi_ids: Sequence[str],
    expected: Sequence[str],
    hooks: Sequence[str],
    work: Path,
) -> Step:
    """The step for a prepared claim: its CDI devices ``cdi_ids`` in ``cdi_dir``, the
    UUIDs the container must see, the hooks its spec names (run by runc)."""
    kit = ready_kit(kit_dir)
    if isinstance(kit, str):
        return skipped(STEP, kit)
    run = run_probe(kit, cdi_dir=cdi_dir, devices=cdi_ids, work=work)
    problems = kernel_problems(run, expected)
    seen = run.seen or {}
    summary = (
        f"ctr run --device {' '.join(cdi_ids)}: {seen.get('values')} values of a PTX kernel "
        f"checked on {seen.get('uuids')}"
        if not problems
        else f"the claim's container under containerd and runc ({kit.image})"
    )
    notes = [
        f"hooks run by runc: {', '.join(hooks) or 'none'}",
        f"memory: {seen.get('freeMiB')} MiB free of {seen.get('totalMiB')} MiB",
    ]
    return with_details(judged(STEP, summary, problems, container=seen), *notes)

"""The MPS step: one share of a GPU through the driver's own MPS control daemon, its
limits read back from inside a CUDA client.

The GPU is discovered as ``--gpu-sharing consumable`` publishes it; a share of
``SHARE_MEMORY_GIB`` and ``SHARE_PERCENT`` of it is prepared by the plugin's own
``Preparer`` and ``GpuEffects`` (compute mode EXCLUSIVE_PROCESS, the daemon started
with the share's limits); the share's CDI devices make the sandbox (``sandbox``), in
which the probe (``probe --client``) creates a CUDA context and reports the free
memory, the multiprocessors and whether it can allocate past the share. It runs twice:
with the spec's environment, and with the limit variables removed, because the limits
must hold in the daemon, not in the client's environment. Unprepare must stop the
daemon and put the compute mode back.

Facts it rests on (seen on an H100, driver 580.159.04): under a daemon's pinned-memory
limit ``cuMemGetInfo`` reports the limit, less the context's own, as free and the full
memory as total; an allocation past it fails with CUDA_ERROR_OUT_OF_MEMORY; under an
active thread percentage ``cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)`` reports the SMs
left (32 of 132 at 25%).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from drasil.driver.cdi.claimspecs import read_claim_spec
from drasil.driver.devices import Device, DeviceType
from drasil.driver.nvidia.driverfiles import find_binary
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.nvidia.nvml import (
    COMPUTE_MODE_EXCLUSIVE_PROCESS,
    COMPUTE_MODE_NAMES,
    nvml_session,
)
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.gpucheck import claim, container, probe, runtime, sandbox
from drasil.kubeletplugin.gpucheck.node import DRIVER, NodeUnderCheck, make_preparer
from drasil.kubeletplugin.gpucheck.report import Step, judged, skipped, with_details
from drasil.kubeletplugin.vendors.nvidia.mps.daemons import CONTROL_PROGRAM, DaemonProgram
from drasil.kubeletplugin.vendors.nvidia.mps.shares import GpuEffects

STEP: Final = "MPS share"
WHOLE_STEP: Final = "MPS whole GPU"
SHARE_MEMORY_GIB: Final = 4
SHARE_PERCENT: Final = 25
LIMIT_ENV: Final = ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
CUDA_ERROR_OUT_OF_MEMORY: Final = 2


def control_program(node: NodeUnderCheck) -> str | None:
    """``nvidia-cuda-mps-control`` in the driver root (run chrooted into it), or, with
    the driver at ``/``, on PATH (e.g. ``/usr/local/nvidia/bin``); None if neither."""
    found = find_binary(node.root, CONTROL_PROGRAM)
    if found is None and node.root.host == "/":
        found = shutil.which(CONTROL_PROGRAM)
    return found


def shareable_gpu(node: NodeUnderCheck) -> Device | None:
    """``gpu-0`` as consumable sharing publishes it, else the first shareable GPU."""
    found = discover(node.lib, node_name=node.name, gpu_sharing="consumable")
    shared = [d for d in found.devices if d.type == DeviceType.GPU and d.allow_multiple_allocations]
    return next((d for d in shared if d.name == "gpu-0"), shared[0] if shared else None)


@dataclass
class _Run:
    """What one MPS share's check saw; the step's verdict is made from it."""

    device: Device
    before: int | None = None
    during: int | None = None
    after: int | None = None
    clients: dict[str, Any] | None = None
    container: container.Run | None = None  # the kit's gpu-kernel under containerd
    container_note: str = ""  # why it did not run
    error: str | None = None
    left: tuple[str, ...] = ()


def whole_gpu(node: NodeUnderCheck) -> Device | None:
    """``gpu-0`` as exclusive sharing publishes it (allocated whole), else the first GPU."""
    found = discover(node.lib, node_name=node.name)
    gpus = [d for d in found.devices if d.type == DeviceType.GPU]
    return next((d for d in gpus if d.name == "gpu-0"), gpus[0] if gpus else None)


def mps_config() -> dict[str, Any]:
    """The whole GPU's config: NVIDIA's kind, as its users write it for gpu-test-mps."""
    parameters = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": {
            "strategy": "MPS",
            "mpsConfig": {
                "defaultActiveThreadPercentage": SHARE_PERCENT,
                "defaultPinnedDeviceMemoryLimit": f"{SHARE_MEMORY_GIB}Gi",
            },
        },
    }
    return {
        "source": "FromClaim",
        "requests": [],
        "opaque": {"driver": DRIVER, "parameters": parameters},
    }


def mps_step(
    node: NodeUnderCheck,
    *,
    work: Path,
    python: str,
    full_sms: int | None,
    program: str,
    kit: Path | None = None,
) -> Step:
    """Prepare a share, look at it from a client twice, unprepare; judge."""
    device = shareable_gpu(node)
    if device is None:
        return skipped(STEP, "no GPU published as shareable (a whole Volta+ GPU, MIG off)")
    share = claim.make_claim(
        driver=DRIVER,
        pool=node.name,
        device=device.name,
        consumed={"memory": f"{SHARE_MEMORY_GIB}Gi", "computePercent": str(SHARE_PERCENT)},
    )
    return _check(
        STEP,
        node,
        device,
        share,
        work=work,
        python=python,
        full_sms=full_sms,
        program=program,
        kit=kit,
    )


def whole_mps_step(
    node: NodeUnderCheck,
    *,
    work: Path,
    python: str,
    full_sms: int | None,
    program: str,
    kit: Path | None = None,
) -> Step:
    """The same on a GPU allocated whole whose claim's config says MPS with the share's
    limits (``mpsConfig``): its own daemon must hold them exactly."""
    device = whole_gpu(node)
    if device is None:
        return skipped(WHOLE_STEP, "no whole GPU (all in MIG mode?)")
    whole = claim.make_claim(
        driver=DRIVER, pool=node.name, device=device.name, config=[mps_config()]
    )
    return _check(
        WHOLE_STEP,
        node,
        device,
        whole,
        work=work,
        python=python,
        full_sms=full_sms,
        program=program,
        kit=kit,
    )


def _check(
    step: str,
    node: NodeUnderCheck,
    device: Device,
    made: dict[str, Any],
    *,
    work: Path,
    python: str,
    full_sms: int | None,
    program: str,
    kit: Path | None,
) -> Step:
    run = _Run(device=device, before=_compute_mode(node, device.uuid))
    daemon = DaemonProgram.for_backend("nvml", control=program, driver_root=node.root.local)
    preparer = make_preparer(node, {device.name: device}, made, work, mps=daemon)
    try:
        _prepare_and_look(run, node, preparer, made, work=work, python=python, kit=kit)
    finally:
        run.left = _unprepare(preparer, made)
        run.after = _compute_mode(node, device.uuid)
    return _verdict(step, run, full_sms=full_sms, program=program)


def _prepare_and_look(
    run: _Run,
    node: NodeUnderCheck,
    preparer: Preparer,
    share: Mapping[str, Any],
    *,
    work: Path,
    python: str,
    kit: Path | None,
) -> None:
    result = preparer.prepare(claim.claim_ref(share))
    if result.error:
        run.error = f"prepare: {result.error}"
        return
    run.during = _compute_mode(node, run.device.uuid)
    spec = read_claim_spec(preparer.cdi_root, driver=DRIVER, claim_uid=share["metadata"]["uid"])
    if spec is None:
        run.error = "prepare wrote no CDI spec"
        return
    names = [i.split("=", 1)[1] for d in result.devices for i in d.cdi_device_ids]
    found = runtime.probe_runtime(python)
    plan = sandbox.build_plan(
        spec,
        names,
        found,
        probe_source=str(Path(probe.__file__).resolve()),
        probe_args=("--client", str(SHARE_MEMORY_GIB * 1024)),
    )
    bare = replace(plan, env={k: v for k, v in plan.env.items() if k not in LIMIT_ENV})
    run.clients = {
        "with its env": _client(plan, work / "client", found.executable),
        "env unset": _client(bare, work / "client-bare", found.executable),
    }
    ids = [i for d in result.devices for i in d.cdi_device_ids]
    _in_a_container(run, kit, cdi_dir=preparer.cdi_root, ids=ids, work=work / "container")


def _in_a_container(
    run: _Run, kit: Path | None, *, cdi_dir: Path, ids: list[str], work: Path
) -> None:
    """The share's CDI devices under the kit's containerd: gpu-kernel's kernel runs
    through the daemon, and its allocation past the share must be refused."""
    ready = container.ready_kit(kit)
    if isinstance(ready, str):
        run.container_note = f"container: skipped: {ready}"
        return
    over = SHARE_MEMORY_GIB * 1024 + probe.OVER_MIB
    run.container = container.run_probe(
        ready,
        cdi_dir=cdi_dir,
        devices=ids,
        work=work,
        args=("--alloc", str(over)),
    )


def _client(plan: sandbox.Plan, work: Path, python: str) -> dict[str, Any]:
    outcome = sandbox.run_plan(plan, work_dir=work, python=python)
    lines = outcome.stdout.strip().splitlines()
    if outcome.returncode != 0 or not lines:
        tail = " | ".join(outcome.stderr.strip().splitlines()[-3:])
        return {"error": f"the client exited {outcome.returncode}: {tail}"}
    seen: dict[str, Any] = json.loads(lines[-1])["client"]
    return seen


def _unprepare(preparer: Preparer, share: Mapping[str, Any]) -> tuple[str, ...]:
    """Unprepare the share; what was left behind (the daemon, the spec, the record)."""
    left = []
    error = preparer.unprepare(claim.claim_ref(share))
    if error:
        left.append(f"unprepare: {error}")
    if preparer.store.get(share["metadata"]["uid"]) is not None:
        left.append("the checkpoint still records the share")
    effects = preparer.effects
    if isinstance(effects, GpuEffects):
        left += [f"a daemon left running: GPU {g}" for g in effects.daemons.sweep(keep=())]
    return tuple(left)


def _compute_mode(node: NodeUnderCheck, uuid: str) -> int | None:
    lib = node.lib
    with nvml_session(lib):
        for index in range(lib.device_count()):
            handle = lib.device_handle_by_index(index)
            if lib.device_uuid(handle) == uuid:
                return lib.device_compute_mode(handle)
    return None


def _mode(mode: int | None) -> str:
    return COMPUTE_MODE_NAMES.get(mode, str(mode)) if mode is not None else "unknown"


def client_problems(seen: Mapping[str, Any], *, full_sms: int | None, what: str) -> list[str]:
    """What a client of a ``SHARE_MEMORY_GIB`` / ``SHARE_PERCENT`` share must not see."""
    limit = SHARE_MEMORY_GIB * 1024
    if "error" in seen:
        return [f"{what}: {seen['error']}"]
    if seen.get("cuCtxCreate") != 0:
        return [
            f"{what}: no CUDA context (cuInit {seen.get('cuInit')}, "
            f"cuCtxCreate {seen.get('cuCtxCreate')})"
        ]
    problems = []
    if seen.get("freeMiB", 0) > limit:
        problems.append(f"{what}: {seen['freeMiB']} MiB free, over the share's {limit} MiB")
    if seen.get("allocSmall") != 0:
        problems.append(f"{what}: {probe.OVER_MIB} MiB not allocated ({seen.get('allocSmall')})")
    if seen.get("allocOverLimit") != CUDA_ERROR_OUT_OF_MEMORY:
        problems.append(
            f"{what}: allocating {limit + probe.OVER_MIB} MiB returned "
            f"{seen.get('allocOverLimit')}, not out of memory ({CUDA_ERROR_OUT_OF_MEMORY})"
        )
    sms = seen.get("multiprocessors")
    if full_sms and sms is not None and sms > math.ceil(full_sms * SHARE_PERCENT / 100):
        problems.append(f"{what}: {sms} of {full_sms} multiprocessors, over {SHARE_PERCENT}%")
    return problems


def _verdict(name: str, run: _Run, *, full_sms: int | None, program: str) -> Step:
    problems = [run.error] if run.error else []
    if run.error is None and run.during != COMPUTE_MODE_EXCLUSIVE_PROCESS:
        problems.append(f"compute mode {_mode(run.during)} while the daemon ran")
    for what, seen in (run.clients or {}).items():
        problems += client_problems(seen, full_sms=full_sms, what=f"client ({what})")
    if run.container is not None:
        limit = SHARE_MEMORY_GIB * 1024
        found = container.kernel_problems(run.container, [run.device.uuid], limit_mib=limit)
        problems += [f"container: {p}" for p in found]
    problems += list(run.left)
    if run.after != run.before:
        problems.append(f"compute mode {_mode(run.after)} after, was {_mode(run.before)}")
    summary = (
        f"{SHARE_MEMORY_GIB}Gi / {SHARE_PERCENT}% of {run.device.name} ({run.device.uuid}) "
        f"through {program}"
    )
    facts = [
        f"{what}: {seen.get('freeMiB')} MiB free of {seen.get('totalMiB')}, "
        f"{seen.get('multiprocessors')} of {full_sms} SMs"
        for what, seen in (run.clients or {}).items()
        if "error" not in seen
    ]
    facts.append(f"compute mode {_mode(run.before)} -> {_mode(run.during)} -> {_mode(run.after)}")
    seen = run.container.seen if run.container is not None else None
    if seen is not None:
        facts.append(
            f"container: {seen.get('values')} kernel values checked, {seen.get('freeMiB')} MiB "
            f"free, {seen.get('allocMiB')} MiB refused ({seen.get('allocResult')})"
        )
    elif run.container_note:
        facts.append(run.container_note)
    step = judged(name, summary, problems, clients=run.clients or {}, container=seen or {})
    return with_details(step, *facts)

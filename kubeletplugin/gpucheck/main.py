"""The check's steps in order, and its command line (``python -m drasil.kubeletplugin.gpucheck``).

Every step is one line of the report; a step that raises is that step's FAIL and the
steps that need its result are skipped, so one broken part never hides the others.
Nothing here changes a GPU setting: the whole-GPU claim is prepared with static MIG
devices and without sharing effects, and dynamic MIG runs only where MIG mode is
already on (creating and destroying an instance there needs no reset).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drasil.driver.cdi.claimspecs import read_claim_spec
from drasil.driver.devices import Device, DeviceType
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.slices.build import build_slices
from drasil.driver.slices.validate import validate_slice
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.gpucheck import (
    cdicheck,
    claim,
    compare,
    container,
    mig,
    mpsshare,
    probe,
    runtime,
    sandbox,
)
from drasil.kubeletplugin.gpucheck.node import DRIVER, NodeUnderCheck, make_preparer, open_node
from drasil.kubeletplugin.gpucheck.report import Report, fail, judged, ok, skipped, with_details
from drasil.kubeletplugin.vendors.nvidia.mps.daemons import CONTROL_PROGRAM


@dataclass
class State:
    """What the steps hand on to the ones after them."""

    args: argparse.Namespace
    work: Path
    report: Report = field(default_factory=Report)
    node: NodeUnderCheck | None = None
    smi: compare.NodeFacts | None = None
    devices: dict[str, Device] = field(default_factory=dict)
    claim: dict[str, Any] | None = None
    cdi_devices: tuple[str, ...] = ()
    cdi_ids: tuple[str, ...] = ()  # qualified: vendor/class=device
    spec: Mapping[str, Any] | None = None
    preparer: Preparer | None = None
    full_sms: int | None = None  # the claimed GPU's multiprocessors, as CUDA saw them


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpu-check", description="check drasil on this node's real NVIDIA GPUs"
    )
    p.add_argument("--nvidia-driver-root", default="/", help="where the driver is installed")
    p.add_argument("--nvidia-smi", help="default: nvidia-smi on PATH, else <root>/usr/bin/")
    p.add_argument("--json", default="gpu-check.json", help="the report as JSON")
    p.add_argument("--work-dir", help="state, CDI specs, sandbox (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    p.add_argument("--claim", type=Path, help="a ResourceClaim file with status.allocation")
    p.add_argument("--node-name", help="the node and pool name (default: the host name)")
    p.add_argument("--nvidia-cdi-hook-path", help="the hook the specs name")
    p.add_argument("--dev-root", default="/dev", help="where the GPUs' device nodes are")
    p.add_argument("--python", default=sys.executable, help="the probe's interpreter")
    p.add_argument(
        "--no-mps",
        action="store_true",
        help="skip the MPS step (it sets compute mode EXCLUSIVE_PROCESS while it runs)",
    )
    p.add_argument(
        "--proc-root", default="/proc", help="where the driver's /proc entries are (MIG)"
    )
    p.add_argument(
        "--container-kit",
        type=Path,
        help="containerd, runc, ctr and the probe image for the container step (the "
        "bundle's, by default)",
    )
    return p


def _node_name(given: str | None) -> str:
    name = given or socket.gethostname().split(".")[0].lower()
    return re.sub(r"[^a-z0-9-]", "-", name).strip("-") or "gpu-check"


def _nvidia_smi(given: str | None, root: str) -> str:
    if given:
        return given
    return shutil.which("nvidia-smi") or str(Path(root) / "usr/bin/nvidia-smi")


# ---- the steps ---------------------------------------------------------------------------


def step_nvml(s: State) -> None:
    a = s.args
    s.node = open_node(
        name=_node_name(a.node_name),
        driver_root=a.nvidia_driver_root,
        dev_root=a.dev_root,
        hook=a.nvidia_cdi_hook_path,
        nvidia_smi=_nvidia_smi(a.nvidia_smi, a.nvidia_driver_root),
        proc_root=Path(a.proc_root),
        kit_hook=container.kit_hook(a.container_kit),
    )
    where = str(s.node.nvml_path or "the loader's search path")
    s.report.add(ok("NVML", f"driver {s.node.lib.system_driver_version()} from {where}"))


def step_smi(s: State) -> None:
    assert s.node is not None
    smi = _nvidia_smi(s.args.nvidia_smi, s.args.nvidia_driver_root)
    done = subprocess.run(
        [smi, "-q", "-x"], capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        s.report.add(fail("nvidia-smi vs NVML", f"{smi} -q -x exited {done.returncode}"))
        return
    s.smi = compare.parse_smi_xml(done.stdout)
    nvml = compare.nvml_facts(s.node.lib)
    problems = compare.compare_facts(s.smi, nvml)
    summary = f"{len(nvml.gpus)} GPU(s), driver {nvml.driver_version}"
    s.report.add(judged("nvidia-smi vs NVML", summary, problems, gpus=[g.uuid for g in nvml.gpus]))


def step_discovery(s: State) -> None:
    assert s.node is not None
    found = discover(s.node.lib, node_name=s.node.name)
    s.devices = {d.name: d for d in found.devices}
    # Skipped GPUs are drasil's design (never fail discovery for one device): noted.
    notes = [f"not published: GPU {k.index}: {k.reason}" for k in found.skipped]
    problems = compare.compare_devices(s.smi, found.devices) if s.smi is not None else []
    summary = f"{len(found.devices)} device(s): {', '.join(s.devices) or 'none'}"
    s.report.add(with_details(judged("discovery vs nvidia-smi", summary, problems), *notes))
    slices = build_slices(
        driver=DRIVER,
        pool=s.node.name,
        devices=found.devices,
        node_name=s.node.name,
        counter_sets=found.counter_sets,
        generation=1,
        owner=None,
    )
    for obj in slices:
        validate_slice(obj)
    names = [o["metadata"]["name"] for o in slices]
    s.report.add(ok("ResourceSlices", f"{len(slices)} valid: {', '.join(names)}"))


def _default_device(devices: Mapping[str, Device]) -> str | None:
    whole = [n for n, d in devices.items() if d.type == DeviceType.GPU]
    return "gpu-0" if "gpu-0" in whole else (whole[0] if whole else None)


def step_prepare(s: State) -> None:
    assert s.node is not None
    if s.args.claim is not None:
        s.claim = claim.read_claim(s.args.claim)
    else:
        device = _default_device(s.devices)
        if device is None:
            s.report.add(skipped("prepare", "no whole GPU to claim (all in MIG mode?)"))
            return
        s.claim = claim.make_claim(driver=DRIVER, pool=s.node.name, device=device)
        claim.write_claim(s.claim, s.work / "claim.json")
    preparer = s.preparer = make_preparer(s.node, s.devices, s.claim, s.work / "whole")
    result = preparer.prepare(claim.claim_ref(s.claim))
    names = claim.allocated_devices(s.claim, driver=DRIVER)
    if result.error:
        s.report.add(fail("prepare", f"{', '.join(names)}: {result.error}"))
        return
    ids = [i for d in result.devices for i in d.cdi_device_ids]
    s.cdi_ids = tuple(ids)
    s.cdi_devices = tuple(i.split("=", 1)[1] for i in ids)
    uid = s.claim["metadata"]["uid"]
    s.spec = read_claim_spec(preparer.cdi_root, driver=DRIVER, claim_uid=uid)
    s.report.add(ok("prepare", f"{', '.join(names)} of pool {s.node.name}", *ids))


def step_schema(s: State) -> None:
    assert s.spec is not None
    problems = cdicheck.spec_problems(s.spec)
    s.report.add(judged("CDI spec", "official CDI schema and drasil's rules", problems))


def _claimed(s: State) -> Device:
    assert s.claim is not None
    names = claim.allocated_devices(s.claim, driver=DRIVER)
    return s.devices[names[0]]


def step_ctk(s: State) -> None:
    assert s.spec is not None
    assert s.node is not None
    ctk = cdicheck.find_ctk()
    if ctk is None:
        s.report.add(skipped("nvidia-ctk", "nvidia-ctk not installed"))
        return
    theirs = cdicheck.ctk_spec(
        ctk,
        driver_root=s.node.root.host,
        dev_root=str(Path(s.node.dev_root).parent),
        hook=s.node.hook_path,
    )
    device = _claimed(s)
    gpu_node = f"{s.node.dev_root}/nvidia{device.attributes.get('minor', '')}"
    found = cdicheck.compare_with_ctk(s.spec, s.cdi_devices, theirs, gpu_node=gpu_node)
    summary = "mounts and device nodes against nvidia-ctk cdi generate"
    step = judged("nvidia-ctk", summary, list(found.problems))
    s.report.add(with_details(step, *found.notes))


def step_sandbox(s: State) -> None:
    assert s.spec is not None
    expected = _claimed(s).uuid
    found = runtime.probe_runtime(s.args.python)
    plan = sandbox.build_plan(
        s.spec, s.cdi_devices, found, probe_source=str(Path(probe.__file__).resolve())
    )
    outcome = sandbox.run_plan(plan, work_dir=s.work / "sandbox", python=found.executable)
    if outcome.returncode != 0:
        tail = outcome.stderr.strip().splitlines()[-5:]
        s.report.add(fail("sandbox probe", f"exited {outcome.returncode}", *tail))
        return
    seen = json.loads(outcome.stdout.strip().splitlines()[-1])
    problems = probe_problems(seen, expected)
    devices = (seen.get("cuda") or {}).get("devices") or [{}]
    s.full_sms = devices[0].get("multiprocessors")
    hooks = f"hooks applied: {', '.join(plan.hooks_applied) or 'none'}; not applied: " + (
        ", ".join(plan.hooks_not_applied) or "none"
    )
    summary = f"sees exactly {expected}" if not problems else f"expected only {expected}"
    step = judged("sandbox probe", summary, problems, probe=seen)
    s.report.add(with_details(step, hooks))


def step_container(s: State) -> None:
    assert s.spec is not None
    assert s.preparer is not None
    step = container.container_step(
        s.args.container_kit,
        cdi_dir=s.preparer.cdi_root,
        cdi_ids=s.cdi_ids,
        expected=[_claimed(s).uuid],
        hooks=cdicheck.hook_names(s.spec, s.cdi_devices),
        work=s.work / "container",
    )
    s.report.add(step)


def probe_problems(seen: Mapping[str, Any], expected: str) -> list[str]:
    """What the probe saw that a container of the one claimed GPU must not."""
    problems = []
    nvml, cuda = seen.get("nvml") or {}, seen.get("cuda") or {}
    for what, part in (("NVML", nvml), ("CUDA", cuda)):
        if "error" in part:
            problems.append(f"{what}: {part['error']}")
    if nvml.get("nvmlInit_v2", 0) != 0:
        problems.append(f"NVML: nvmlInit_v2 returned {nvml['nvmlInit_v2']}")
    elif "uuids" in nvml and nvml["uuids"] != [expected]:
        problems.append(f"NVML sees {nvml['uuids']}, expected [{expected!r}]")
    if cuda.get("cuInit", 0) != 0:
        problems.append(f"CUDA: cuInit returned {cuda['cuInit']}")
    elif "count" in cuda and cuda["count"] != 1:
        problems.append(f"CUDA sees {cuda['count']} device(s), expected 1")
    uuids = [d["uuid"] for d in cuda.get("devices") or [] if "uuid" in d]
    if uuids and uuids != [expected]:
        problems.append(f"CUDA device UUIDs {uuids}, expected [{expected!r}]")
    return problems


def step_mps(s: State) -> None:
    assert s.node is not None
    if s.args.no_mps:
        s.report.add(skipped(mpsshare.STEP, "--no-mps"))
        return
    program = mpsshare.control_program(s.node)
    if program is None:
        where = f"in driver root {s.node.root.host}" + (
            " or on PATH" if s.node.root.host == "/" else ""
        )
        s.report.add(skipped(mpsshare.STEP, f"{CONTROL_PROGRAM} not found {where}"))
        return
    for run, folder in ((mpsshare.mps_step, "mps"), (mpsshare.whole_mps_step, "mps-whole")):
        step = run(
            s.node,
            work=s.work / folder,
            python=s.args.python,
            full_sms=s.full_sms,
            program=program,
            kit=s.args.container_kit,
        )
        s.report.add(step)


def step_unprepare(s: State) -> None:
    preparer, done = s.preparer, s.claim
    assert preparer is not None
    assert done is not None
    uid = done["metadata"]["uid"]
    error = preparer.unprepare(claim.claim_ref(done))
    problems = [error] if error else []
    if read_claim_spec(preparer.cdi_root, driver=DRIVER, claim_uid=uid) is not None:
        problems.append("the claim's CDI spec is still there")
    if preparer.store.get(uid) is not None:
        problems.append("the checkpoint still records the claim")
    s.report.add(judged("unprepare", "spec and checkpoint entry removed", problems))


def step_mig(s: State) -> None:
    assert s.node is not None
    s.report.add(mig.dynamic_mig_step(s.node, s.work / "mig"))


STEPS = (
    ("NVML", step_nvml, ()),
    ("nvidia-smi vs NVML", step_smi, ("node",)),
    ("discovery vs nvidia-smi", step_discovery, ("node",)),
    ("prepare", step_prepare, ("node", "devices")),
    ("CDI spec", step_schema, ("spec",)),
    ("nvidia-ctk", step_ctk, ("spec",)),
    ("sandbox probe", step_sandbox, ("spec",)),
    (container.STEP, step_container, ("spec",)),
    # After any prepare that got as far as the checkpoint: it cleans up a failed one too.
    ("unprepare", step_unprepare, ("preparer",)),
    # Its own claim, after the whole GPU's is gone (a share and the whole GPU never
    # stand together on one GPU).
    (mpsshare.STEP, step_mps, ("node",)),
    ("dynamic MIG", step_mig, ("node",)),
)


def run_steps(s: State) -> None:
    for name, step, needs in STEPS:
        missing = [n for n in needs if not getattr(s, n)]
        if missing:
            s.report.add(skipped(name, f"needs the {' and '.join(missing)} of an earlier step"))
            continue
        with s.report.guard(name):
            step(s)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # drasil's own warnings (a failed prepare, a skipped device) are in the report
    # already; only errors beyond it reach the terminal.
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    state = State(args=args, work=work)
    try:
        run_steps(state)
    finally:
        if state.node is not None:
            state.node.lib.shutdown()
        if not args.keep and args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    sys.stdout.write(state.report.text())
    state.report.write_json(Path(args.json))
    print(f"report written to {os.path.abspath(args.json)}")
    return state.report.exit_code()

"""Dynamic MIG on a GPU whose MIG mode is already on: one placement prepared through
the plugin's ``Preparer`` (``--mig-mode dynamic``), so a MIG instance is cut, then
unprepared, so it is destroyed. Only there: switching MIG mode needs a GPU reset, and
the check changes no GPU setting."""

from __future__ import annotations

import json
from pathlib import Path

from drasil.driver.cdi.claimspecs import read_claim_spec
from drasil.driver.devices import Device
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.nvidia.nvml import NvmlLibrary, NvmlNotSupported
from drasil.kubeletplugin.gpucheck import claim
from drasil.kubeletplugin.gpucheck.node import DRIVER, NodeUnderCheck, make_preparer
from drasil.kubeletplugin.gpucheck.report import Step, fail, judged, skipped

NAME = "dynamic MIG"
MAX_TRIES = 4  # placements tried before giving up (others may be held by instances)


def mig_on_gpus(lib: NvmlLibrary) -> list[str]:
    """UUIDs of the GPUs whose MIG mode is on now."""
    found = []
    for index in range(lib.device_count()):
        handle = lib.device_handle_by_index(index)
        try:
            if lib.device_mig_mode(handle).current:
                found.append(lib.device_uuid(handle))
        except NvmlNotSupported:
            continue
    return found


def _instances(lib: NvmlLibrary, uuid: str) -> set[tuple[int, int, int]]:
    """(profile id, start, size) of the GPU's instances."""
    for index in range(lib.device_count()):
        handle = lib.device_handle_by_index(index)
        if lib.device_uuid(handle) == uuid:
            return {
                (g.profile_id, g.placement.start, g.placement.size)
                for g in lib.gpu_instances(handle)
            }
    return set()


def _free(lib: NvmlLibrary, device: Device) -> bool:
    """No existing instance on any of the placement's slices: the check must never
    adopt (and so, at unprepare, destroy) an instance someone else made."""
    placement = device.mig_placement
    assert placement is not None
    wanted = set(range(placement.start, placement.start + placement.size))
    held = _instances(lib, placement.parent_uuid)
    return not any(wanted & set(range(start, start + size)) for _, start, size in held)


def _candidates(devices: tuple[Device, ...], gpus: list[str]) -> list[Device]:
    """Placements of the MIG-mode GPUs, smallest first (the likeliest to be free)."""
    found = [
        d for d in devices if d.mig_placement is not None and d.mig_placement.parent_uuid in gpus
    ]
    return sorted(found, key=lambda d: (d.mig_placement.size if d.mig_placement else 0, d.name))


def dynamic_mig_step(node: NodeUnderCheck, work: Path) -> Step:
    gpus = mig_on_gpus(node.lib)
    if not gpus:
        return skipped(NAME, "MIG mode off")
    found = discover(node.lib, node_name=node.name, mig_mode="dynamic")
    devices = {d.name: d for d in found.devices}
    candidates = [d for d in _candidates(found.devices, gpus) if _free(node.lib, d)]
    if not candidates:
        return skipped(NAME, "no free MIG placement (existing instances hold every slice)")
    errors = []
    for device in candidates[:MAX_TRIES]:
        step = _one_placement(node, devices, device, work / device.name)
        if step is not None:
            return step
        errors.append(device.name)
    return fail(NAME, f"no placement could be prepared (tried {', '.join(errors) or 'none'})")


def _one_placement(
    node: NodeUnderCheck, devices: dict[str, Device], device: Device, work: Path
) -> Step | None:
    """Prepare and unprepare ``device``; ``None`` when its placement is taken."""
    assert device.mig_placement is not None
    parent = device.mig_placement.parent_uuid
    before = _instances(node.lib, parent)
    made = claim.make_claim(driver=DRIVER, pool=node.name, device=device.name)
    preparer = make_preparer(node, devices, made, work, migs=True)
    ref = claim.claim_ref(made)
    result = preparer.prepare(ref)
    if result.error:
        preparer.unprepare(ref)
        return None if "taken" in result.error else fail(NAME, f"{device.name}: {result.error}")
    spec = read_claim_spec(preparer.cdi_root, driver=DRIVER, claim_uid=ref.uid)
    text = json.dumps(spec or {})
    problems = [] if "MIG-" in text else ["the spec names no MIG device UUID"]
    created = _instances(node.lib, parent) - before
    if not created:
        problems.append("no new GPU instance while prepared")
    error = preparer.unprepare(ref)
    problems += [error] if error else []
    left = _instances(node.lib, parent) - before
    if left:
        problems.append(f"instances left after unprepare: {sorted(left)}")
    return judged(NAME, f"{device.name} cut and destroyed on {parent}", problems)

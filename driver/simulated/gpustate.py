"""The simulated GPUs' changing state: MIG mode and instances, time slice, compute
mode; the MIG rules NVML enforces on it; and the JSON state file it persists in.

``MigState`` is what survives the plugin on real hardware, one per GPU; ``FakeNvml``
(``drasil.driver.simulated.nvml``) changes it only through the rules here
(``check_room``, ``mig_profile``) and writes it with ``state_json``.

State file. With ``state_file``, MIG mode, instances, time slices and compute modes live
in a JSON file that outlives the process, as a real GPU's state outlives the plugin:
every change is written (``write_atomic``) under a ``FileLock`` on ``<file>.lock`` after
re-reading the file, and every query re-reads it when it changed, so the plugin and
``drasil discover`` share one GPU (and so does the mock NVML of ``e2e/harness/mocknvml``). The
file::

    {"version": 1, "bootId": "<boot id>",
     "gpus": {"GPU-<uuid>": {"migEnabled": true,
                             "gpuInstances": [{"id": 2, "profileId": 9, "start": 4,
                                               "size": 4, "computeInstances": [0]}],
                             "timeSlice": 2, "computeMode": 3}}}

MIG-capable GPUs always have an entry; other GPUs only while their time slice or compute
mode is not the default, and ``timeSlice`` and ``computeMode`` are left out when they
are 0 (files of earlier versions read the same). A file from another boot (the node
rebooted) keeps MIG mode and loses the instances, time slices and compute modes, as a
GPU loses its compute policy and compute mode at a reboot.
A damaged file is logged and ignored: the GPUs start as if there were none (the
profile's own MIG mode and layout).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from drasil.driver.nvidia.nvml import (
    COMPUTE_MODE_DEFAULT,
    COMPUTE_MODE_NAMES,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INVALID_ARGUMENT,
    TIME_SLICE_DEFAULT,
    TIME_SLICE_NAMES,
    GpuInstanceProfile,
    MigMode,
    NvmlQueryError,
    Placement,
    error_for_code,
)
from drasil.driver.simulated.gpucatalog import MigProfile, gpu_instance_id_at
from drasil.driver.simulated.gpus import FakeGpu

STATE_VERSION = 1

# NVML's compute instance profile id of the profile spanning a GPU instance of this
# many compute slices (NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE; -cci prints it).
COMPUTE_PROFILE_IDS = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}


@dataclass
class SimGpuInstance:
    profile_id: int
    placement: Placement
    compute_instances: set[int] = field(default_factory=set)


@dataclass
class MigState:
    """One GPU's MIG mode, instances, time slice and compute mode: what survives the
    plugin on real hardware."""

    enabled: bool
    instances: dict[int, SimGpuInstance] = field(default_factory=dict)  # by GI id
    time_slice: int = TIME_SLICE_DEFAULT
    compute_mode: int = COMPUTE_MODE_DEFAULT
    # An Ampere GPU's MIG mode after the next reset, when it differs from ``enabled``.
    pending: bool | None = None

    @property
    def mode(self) -> MigMode:
        pending = self.enabled if self.pending is None else self.pending
        return MigMode(current=self.enabled, pending=pending)


class StateFileError(ValueError):
    """A state file that is not what ``FakeNvml`` writes."""


# -- MIG rules: what NVML allows, from the profile tables alone --------------------------


def nvml_fail(call: str, message: str, code: int) -> NvmlQueryError:
    return error_for_code(f"{call}: {message}", code)


def initial_state(gpu: FakeGpu) -> MigState:
    instances = {
        m.instance.gpu_instance_id: SimGpuInstance(
            m.instance.profile.profile_id,
            m.instance.placement,
            {m.instance.compute_instance_id},
        )
        for m in gpu.migs
    }
    return MigState(enabled=gpu.model.mig_enabled, instances=instances)


def mig_profile(gpu: FakeGpu, profile_id: int, call: str) -> MigProfile:
    profile = gpu.model.mig_profile(profile_id)
    if profile is None:
        raise nvml_fail(call, f"no GPU instance profile {profile_id}", NVML_ERROR_INVALID_ARGUMENT)
    return profile


def check_room(
    gpu: FakeGpu, state: MigState, profile: MigProfile, placement: Placement, call: str
) -> None:
    """INSUFFICIENT_RESOURCES unless an instance of ``profile`` fits at ``placement``."""
    mine = [gi for gi in state.instances.values() if gi.profile_id == profile.profile_id]
    if len(mine) >= profile.instance_count:
        message = f"all {profile.instance_count} {profile.name} instances exist"
        raise nvml_fail(call, message, NVML_ERROR_INSUFFICIENT_RESOURCES)
    used = {s for gi in state.instances.values() for s in gi.placement.slices}
    if used & set(placement.slices):
        message = f"memory slices {placement.start}:{placement.size} overlap an instance"
        raise nvml_fail(call, message, NVML_ERROR_INSUFFICIENT_RESOURCES)
    compute = sum(
        mig_profile(gpu, gi.profile_id, call).gpu_slices for gi in state.instances.values()
    )
    full = gpu.model.full_profile
    if full is not None and compute + profile.gpu_slices > full.gpu_slices:
        raise nvml_fail(call, "no compute slices left", NVML_ERROR_INSUFFICIENT_RESOURCES)


def gpu_instance_profile(profile: MigProfile) -> GpuInstanceProfile:
    return GpuInstanceProfile(
        profile_id=profile.profile_id,
        name=profile.name,
        slice_count=profile.gpu_slices,
        instance_count=profile.instance_count,
        multiprocessors=profile.multiprocessors,
        copy_engines=profile.copy_engines,
        decoders=profile.decoders,
        encoders=profile.encoders,
        jpeg_engines=profile.jpeg_engines,
        ofa_engines=profile.ofa_engines,
        memory_mib=profile.memory_mib,
    )


# -- the state file -------------------------------------------------------------------------


def state_json(boot_id: str, gpus: Sequence[FakeGpu], states: Mapping[int, MigState]) -> bytes:
    doc = {
        "version": STATE_VERSION,
        "bootId": boot_id,
        "gpus": {
            gpu.uuid: _gpu_json(states[gpu.index])
            for gpu in gpus
            if gpu.model.mig_capable or _has_policy(states[gpu.index])
        },
    }
    return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"


def _has_policy(state: MigState) -> bool:
    """Whether a GPU's time slice or compute mode is not the default (what a GPU
    without MIG needs a state file entry for)."""
    return state.time_slice != TIME_SLICE_DEFAULT or state.compute_mode != COMPUTE_MODE_DEFAULT


def _gpu_json(state: MigState) -> dict[str, Any]:
    entry = _mig_json(state)
    if state.time_slice != TIME_SLICE_DEFAULT:
        entry["timeSlice"] = state.time_slice
    if state.compute_mode != COMPUTE_MODE_DEFAULT:
        entry["computeMode"] = state.compute_mode
    return entry


def _mig_json(state: MigState) -> dict[str, Any]:
    pending = {} if state.pending is None else {"migPending": state.pending}
    return {
        **pending,
        "migEnabled": state.enabled,
        "gpuInstances": [
            {
                "id": gi_id,
                "profileId": gi.profile_id,
                "start": gi.placement.start,
                "size": gi.placement.size,
                "computeInstances": sorted(gi.compute_instances),
            }
            for gi_id, gi in sorted(state.instances.items())
        ],
    }


def parse_state(raw: bytes, gpus: Sequence[FakeGpu]) -> tuple[str, dict[int, MigState]]:
    """The boot id and MIG state of a state file; StateFileError if it is not ours."""
    try:
        doc = json.loads(raw)
        if doc["version"] != STATE_VERSION or not isinstance(doc["bootId"], str):
            raise StateFileError(f"unknown version {doc['version']!r} or boot id")
        entries = doc["gpus"]
        states = {
            gpu.index: _parse_gpu(entries[gpu.uuid], gpu) if gpu.uuid in entries else None
            for gpu in gpus
        }
    except (ValueError, KeyError, TypeError) as err:
        raise StateFileError(str(err) or type(err).__name__) from err
    return doc["bootId"], {i: s if s else initial_state(gpus[i]) for i, s in states.items()}


def _parse_gpu(entry: Mapping[str, Any], gpu: FakeGpu) -> MigState:
    time_slice = entry.get("timeSlice", TIME_SLICE_DEFAULT)
    if type(time_slice) is not int or time_slice not in TIME_SLICE_NAMES.values():
        raise StateFileError(f"time slice {time_slice!r}: not 0 to 3")
    compute_mode = entry.get("computeMode", COMPUTE_MODE_DEFAULT)
    if type(compute_mode) is not int or compute_mode not in COMPUTE_MODE_NAMES:
        raise StateFileError(
            f"compute mode {compute_mode!r}: not one of {sorted(COMPUTE_MODE_NAMES)}"
        )
    pending = entry.get("migPending")
    state = MigState(
        enabled=bool(entry["migEnabled"]),
        time_slice=time_slice,
        compute_mode=compute_mode,
        pending=None if pending is None else bool(pending),
    )
    for item in entry["gpuInstances"]:
        placement = Placement(int(item["start"]), int(item["size"]))
        profile = mig_profile(gpu, int(item["profileId"]), "state file")
        if placement not in profile.placements or item["id"] != gpu_instance_id_at(placement):
            raise StateFileError(f"GPU instance {item['id']}: not a placement of {profile.name}")
        cis = {int(ci) for ci in item["computeInstances"]}
        state.instances[int(item["id"])] = SimGpuInstance(profile.profile_id, placement, cis)
    return state

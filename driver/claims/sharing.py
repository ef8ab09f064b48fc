"""What a device's sharing config means for the container that gets it.

Each setting is one ``<SETTING>: value`` pair that the device's own CDI edits carry as
``DRASIL_DEVICE_<NAME>_<SETTING>`` (``drasil.driver.cdi.claimspecs``), so that a
container holding devices with different settings reads each device's own. They say
what was applied: the strategy, and a time-sliced device's interval. What a strategy
does on the GPU (an MPS daemon per shared GPU, a time slice) is
``drasil.kubeletplugin.vendors.nvidia.mps.shares``. A strategy drasil would not apply to a device is
refused (``not_applied``), never passed on as a variable that nothing enforces.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from drasil.api.config import OpaqueConfig, SharingStrategy, TimeSlicingInterval
from drasil.api.documents import ConfigIssue
from drasil.driver.devices import Device

ADMIN_ACCESS = "ADMIN_ACCESS"
SHARING_STRATEGY = "SHARING_STRATEGY"
TIMESLICE_INTERVAL = "TIMESLICE_INTERVAL"
MPS = "MPS"


def not_applied(config: OpaqueConfig, *, admin_access: bool) -> ConfigIssue | None:
    """Why drasil would not apply the config's strategy to a device; None when it would.

    MPS is applied to every device it can be: a share of a consumable GPU or of a MIG
    placement (its GPU or instance runs one daemon for all its shares), and a GPU or
    MIG device allocated whole (a daemon of its own, for the claim's containers). An
    admin-access device is not the claim's to configure: it sits beside the claim that
    holds it, whose daemon (if any) it must not change, so MPS on it is refused rather
    than silently dropped. Used at prepare (``deviceconfigs.resolve_configs``) and by
    the controller (``configcheck``), which say the same thing.
    """
    if config.sharing.strategy != SharingStrategy.MPS or not admin_access:
        return None
    return ConfigIssue(
        path="sharing.strategy",
        value=MPS,
        message=(
            f'unsupported value "{MPS}" for a device of an admin-access request: '
            "such a request sits beside the claim that holds the device and takes no "
            f"sharing of its own; allowed values are {_quoted(ADMIN_STRATEGIES)} "
            "(or no config for that request)"
        ),
        allowed=ADMIN_STRATEGIES,
    )


ADMIN_STRATEGIES: Final = (
    SharingStrategy.EXCLUSIVE.value,
    SharingStrategy.TIME_SLICING.value,
)
"""What an admin-access request's config may say: nothing it says changes the device."""


def _quoted(values: tuple[str, ...]) -> str:
    return ", ".join(f'"{value}"' for value in values)


def sharing_settings(config: OpaqueConfig, *, mode: str | None = None) -> dict[str, str]:
    """The settings describing the sharing a device was prepared with.

    ``mode`` is the device's ``sharing_mode``: a share of a consumable GPU is MPS
    whatever its config says, unless that says TimeSlicing (a share without a config
    has the default config, Exclusive, and still runs as an MPS client).
    """
    sharing = config.sharing
    strategy = MPS if mode == MPS else str(sharing.strategy)
    settings = {SHARING_STRATEGY: strategy}
    time_slicing = getattr(sharing, "time_slicing", None)
    if sharing.strategy == SharingStrategy.TIME_SLICING and time_slicing is not None:
        settings[TIMESLICE_INTERVAL] = str(time_slicing.interval)
    return settings


def admin_settings() -> dict[str, str]:
    """An admin-access device: it says so, and carries no sharing settings of its own
    (it sits beside whichever claim holds the device; that claim's settings apply)."""
    return {ADMIN_ACCESS: "true"}


# --- shares of a consumable GPU and time slices (--gpu-sharing consumable) -----------

MEMORY = "memory"
COMPUTE_PERCENT = "computePercent"
TIME_SLICES: Final = {
    TimeSlicingInterval.DEFAULT: 0,
    TimeSlicingInterval.SHORT: 1,
    TimeSlicingInterval.MEDIUM: 2,
    TimeSlicingInterval.LONG: 3,
}
"""``nvidia-smi compute-policy --set-timeslice`` values of the config's intervals."""


class SharingConflict(ValueError):
    """A sharing config that cannot apply to the device it was allocated."""


@dataclass(frozen=True)
class ShareLimits:
    """What an MPS share may use of its GPU: pinned memory and active threads."""

    memory_bytes: int
    thread_percentage: int


def sharing_mode(
    config: OpaqueConfig, *, share: bool, defaulted: bool, mig: bool = False
) -> str | None:
    """How the GPU is used, as the checkpoint records it; None when nothing on the GPU
    changes (an exclusive device). Claims on one GPU must agree on it.

    A share (a result with a shareID) is MPS unless its config says TimeSlicing; a
    share cannot be Exclusive, but the default config (``defaulted``) of a share means
    MPS. A GPU or MIG device allocated whole is MPS when its config says so (its own
    daemon), and a whole GPU changes for TimeSlicing too (its interval). A share of
    a MIG placement (``mig``) is MPS only: a time slice is the parent GPU's setting,
    which other claims' instances live under, so TimeSlicing would leave the shares of
    the instance unbounded.
    """
    sharing = config.sharing
    strategy = sharing.strategy
    if not share and (mig or strategy != SharingStrategy.TIME_SLICING):
        # A device allocated whole: MPS runs a daemon of its own; a MIG device's
        # TimeSlicing changes nothing on its parent GPU, which others' instances share.
        return MPS if strategy == SharingStrategy.MPS else None
    if mig:
        if strategy == SharingStrategy.MPS or defaulted:
            return MPS
        raise SharingConflict(
            f"sharing.strategy: {strategy} cannot apply to a share of a MIG device; "
            "the allowed value is MPS (its instance runs an MPS daemon holding each "
            "share to its memory and compute)"
        )
    if strategy == SharingStrategy.TIME_SLICING:
        time_slicing = getattr(sharing, "time_slicing", None)
        interval = (
            time_slicing.interval if time_slicing is not None else TimeSlicingInterval.DEFAULT
        )
        return f"{SharingStrategy.TIME_SLICING}/{interval}"
    if strategy == SharingStrategy.EXCLUSIVE and not defaulted:
        raise SharingConflict(
            "sharing.strategy: Exclusive cannot apply to a share of a shared GPU; "
            "allowed values are MPS and TimeSlicing"
        )
    return MPS


def time_slice_of(mode: str | None) -> int | None:
    """The time slice a mode applies to its GPU, or None."""
    if mode is None or not mode.startswith(f"{SharingStrategy.TIME_SLICING}/"):
        return None
    return TIME_SLICES[TimeSlicingInterval(mode.partition("/")[2])]


def share_limits(device: Device, consumed: Mapping[str, int], config: OpaqueConfig) -> ShareLimits:
    """The MPS limits of one share, from what the scheduler counted it as taking.

    ``device`` is the shared GPU, or the MIG instance of a shared placement: a MIG
    share's memory and threads are parts of its instance, which is all its daemon sees.

    Memory: the consumed ``memory`` (else the config's pinned limit, else the GPU's).
    Threads: the consumed ``computePercent`` when the claim asked for one; otherwise
    the config's default percentage; otherwise the share's fraction of the GPU's
    memory, rounded up, so four 20Gi shares of an 80Gi GPU get 25% each.
    """
    total = device.capacity.get(MEMORY, 0)
    mps = config.sharing.mps
    memory = consumed.get(MEMORY) or (
        mps.default_pinned_device_memory_limit if mps is not None else None
    )
    memory_bytes = min(memory or total, total) if total else (memory or 0)
    percent = consumed.get(COMPUTE_PERCENT, 0)
    if not percent and mps is not None and mps.default_active_thread_percentage is not None:
        percent = mps.default_active_thread_percentage
    if not percent:
        percent = math.ceil(100 * memory_bytes / total) if total else 100
    return ShareLimits(memory_bytes=memory_bytes, thread_percentage=max(1, min(100, percent)))


def whole_device_limits(device: Device, config: OpaqueConfig) -> ShareLimits:
    """The MPS limits of a GPU or MIG device allocated whole with strategy MPS.

    The daemon is the claim's alone, so its limits are the config's: the device's own
    entry of ``defaultPerDevicePinnedMemoryLimit`` (by index ``"0"``, the one MPS
    device of its claim, or by UUID; ``check_whole_device_keys`` refused any other
    key), else ``defaultPinnedDeviceMemoryLimit``, else the device's memory (no limit);
    threads ``defaultActiveThreadPercentage``, else 100. A limit above the device's
    memory is the device's memory: MPS cannot give more.
    """
    total = device.capacity.get(MEMORY, 0)
    mps = config.sharing.mps
    per_device = (mps.default_per_device_pinned_memory_limit or {}) if mps else {}
    memory = per_device.get(WHOLE_DEVICE_INDEX) or per_device.get(device.uuid or "")
    if memory is None and mps is not None:
        memory = mps.default_pinned_device_memory_limit
    memory_bytes = min(memory or total, total) if total else (memory or 0)
    percent = 100
    if mps is not None and mps.default_active_thread_percentage is not None:
        percent = mps.default_active_thread_percentage
    # MPS takes 1 to 100: a 0 (which NVIDIA's kind allows) is the least it can give.
    return ShareLimits(memory_bytes=memory_bytes, thread_percentage=max(1, min(100, percent)))


WHOLE_DEVICE_INDEX: Final = "0"
"""The key of the one MPS device of a claim in ``defaultPerDevicePinnedMemoryLimit``."""


def whole_device_key_problem(device: Device, config: OpaqueConfig) -> str | None:
    """A ``defaultPerDevicePinnedMemoryLimit`` key that names no device of the daemon
    (NVIDIA's driver refuses those too); None when every key names this device."""
    mps = config.sharing.mps
    keys = (mps.default_per_device_pinned_memory_limit or {}) if mps else {}
    allowed = [WHOLE_DEVICE_INDEX, *([device.uuid] if device.uuid else [])]
    for key in keys:
        if key not in allowed:
            return (
                f"defaultPerDevicePinnedMemoryLimit: unknown device {key!r}: "
                f"the claim's MPS daemon serves one device, {device.name}; allowed keys "
                f"are {_quoted(tuple(allowed))}"
            )
    return None

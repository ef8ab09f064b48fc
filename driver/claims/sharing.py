"""What a device's sharing config means for the container that gets it.

Each setting is one ``<SETTING>: value`` pair that the device's own CDI edits carry as
``DRASIL_DEVICE_<NAME>_<SETTING>`` (``drasil.driver.cdi.claimspecs``), so that a
container holding devices with different settings reads each device's own. On the
simulated backend these variables are all there is of sharing; on real GPUs they tell
the workload what was set up for that device.
"""

from __future__ import annotations

from drasil.api.config import OpaqueConfig, SharingStrategy
from drasil.api.quantity import format_bytes

ADMIN_ACCESS = "ADMIN_ACCESS"
SHARING_STRATEGY = "SHARING_STRATEGY"
TIMESLICE_INTERVAL = "TIMESLICE_INTERVAL"
MPS_ACTIVE_THREAD_PERCENTAGE = "MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_PINNED_DEVICE_MEMORY_LIMIT = "MPS_PINNED_DEVICE_MEMORY_LIMIT"


def sharing_settings(config: OpaqueConfig) -> dict[str, str]:
    """The settings describing the sharing a device was prepared with."""
    sharing = config.sharing
    settings = {SHARING_STRATEGY: str(sharing.strategy)}
    time_slicing = getattr(sharing, "time_slicing", None)
    if sharing.strategy == SharingStrategy.TIME_SLICING and time_slicing is not None:
        settings[TIMESLICE_INTERVAL] = str(time_slicing.interval)
    mps = sharing.mps
    if sharing.strategy == SharingStrategy.MPS and mps is not None:
        if mps.default_active_thread_percentage is not None:
            settings[MPS_ACTIVE_THREAD_PERCENTAGE] = str(mps.default_active_thread_percentage)
        if mps.default_pinned_device_memory_limit is not None:
            settings[MPS_PINNED_DEVICE_MEMORY_LIMIT] = format_bytes(
                mps.default_pinned_device_memory_limit
            )
    return settings


def admin_settings() -> dict[str, str]:
    """An admin-access device: it says so, and carries no sharing settings of its own
    (it sits beside whichever claim holds the device; that claim's settings apply)."""
    return {ADMIN_ACCESS: "true"}

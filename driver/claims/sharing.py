"""What a device's sharing config means for the container that gets it.

The simulated backend records sharing only as environment in the claim's CDI spec;
on real GPUs the same variables tell CUDA (MPS limits) and the user what was set up.
"""

from __future__ import annotations

from drasil.api.config import OpaqueConfig, SharingStrategy
from drasil.api.quantity import format_bytes


def sharing_env(config: OpaqueConfig) -> dict[str, str]:
    """Environment variables describing the sharing a device was prepared with."""
    sharing = config.sharing
    env = {"DRASIL_SHARING_STRATEGY": str(sharing.strategy)}
    time_slicing = getattr(sharing, "time_slicing", None)
    if sharing.strategy == SharingStrategy.TIME_SLICING and time_slicing is not None:
        env["DRASIL_TIMESLICE_INTERVAL"] = str(time_slicing.interval)
    mps = sharing.mps
    if sharing.strategy == SharingStrategy.MPS and mps is not None:
        if mps.default_active_thread_percentage is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(mps.default_active_thread_percentage)
        if mps.default_pinned_device_memory_limit is not None:
            # CUDA reads the limit as <n>M or <n>G; MiB is exact for our >= 1Mi values.
            mib = mps.default_pinned_device_memory_limit // 2**20
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={mib}M"
            env["DRASIL_MPS_PINNED_DEVICE_MEMORY_LIMIT"] = format_bytes(
                mps.default_pinned_device_memory_limit
            )
    return env

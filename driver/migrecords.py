"""What the checkpoint says about MIG instances, for the vendor-neutral prepare path.

A dynamic MIG device's record is written before NVML is asked for its instance
(``creating_record``), so that a crash at any step is finished by the next call; the
instances recorded claims hold (``mig_holders``) are what the start-up reconcile keeps
and what slices do not offer again (``held_by_dynamic_claims``). The instances
themselves are cut by NVIDIA's node code (``drasil.kubeletplugin.vendors.nvidia.migs``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from drasil.api.checkpoint import ClaimRecord, MigRecord, MigState
from drasil.driver.devices import Device, MigPlacement


def creating_record(placement: MigPlacement) -> MigRecord:
    """The record written before NVML is asked to create anything."""
    return MigRecord(
        parent_uuid=placement.parent_uuid,
        profile=placement.profile,
        profile_id=placement.profile_id,
        placement_start=placement.start,
        placement_size=placement.size,
        state=MigState.CREATING,
    )


def mig_holders(records: Mapping[str, ClaimRecord]) -> dict[tuple[str, int, int], str]:
    """(GPU, profile id, start) of every recorded instance → the claim holding it.

    Claims still being prepared (``Creating``) hold their placement too, but their
    instance may legitimately not exist yet, so they map to "" (never "missing").
    """
    held: dict[tuple[str, int, int], str] = {}
    for uid, record in records.items():
        for device in record.devices:
            mig = device.mig
            if mig is None:
                continue
            created = mig.state == MigState.CREATED
            held[(mig.parent_uuid, mig.profile_id, mig.placement_start)] = uid if created else ""
    return held


def held_by_dynamic_claims(
    devices: Iterable[Device], records: Mapping[str, ClaimRecord]
) -> set[str]:
    """Names of static MIG devices that are instances claims cut in dynamic MIG mode
    still hold: not published after a change to static mode, so the scheduler does
    not hand them to a second claim (prepare refuses them too, naming the holder);
    the instance goes with its claim's unprepare."""
    cut = set(mig_holders(records))
    return {
        d.name
        for d in devices
        if (site := d.mig_site) is not None
        and (site.parent_uuid, site.profile_id, site.start) in cut
    }

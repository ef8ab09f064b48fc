"""Cleaning up what crashes and deleted claims leave behind.

At start and periodically: checkpoint entries (PrepareStarted or PrepareCompleted)
whose claim no longer exists, or exists with another UID, are unprepared; CDI specs
and KEP-5304 metadata directories of ours that no checkpoint entry accounts for are
deleted. kubelet would never call
unprepare for a claim deleted while the plugin was down, so nobody else will.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from drasil.api.checkpoint import PreparedDevice
from drasil.driver.apierrors import InvalidName
from drasil.driver.cdi.claimspecs import (
    SHARE_MARK,
    ClaimIdentity,
    cdi_device_id,
    claim_identity,
    delete_claim_spec,
    device_of_cdi_name,
    list_claim_specs,
    read_claim_spec,
    sweep_claim_spec_temps,
)
from drasil.driver.cdi.metadata import (
    delete_claim_metadata,
    is_metadata_cdi_name,
    list_claim_metadata,
)
from drasil.driver.cdi.spec import CdiSpecError, device_env_name
from drasil.driver.claims.plan import POOL_SETTING
from drasil.driver.claims.sharing import MPS
from drasil.driver.migrecords import creating_record
from drasil.kubeletplugin.dra.prepare import ClaimReader, Preparer

log = logging.getLogger(__name__)

TEMP_MAX_AGE = 60.0  # seconds; a live atomic write takes milliseconds


def stale_claims(preparer: Preparer, claims: ClaimReader) -> list[str]:
    """UIDs of recorded claims the API server no longer has (raises if unreachable)."""
    with preparer.state_lock():
        records = dict(preparer.store.claims())
    stale = []
    for uid, record in records.items():
        try:
            claim = claims.get_claim(record.namespace, record.name)
        except InvalidName:  # a record no claim can match (a damaged checkpoint)
            claim = None
        if claim is None or claim.get("metadata", {}).get("uid") != uid:
            stale.append(uid)
    return stale


def reconcile(preparer: Preparer, claims: ClaimReader) -> int:
    """One pass; returns how many claims or specs were cleaned up."""
    cleaned = 0
    for uid in stale_claims(preparer, claims):
        log.info("unpreparing stale claim", extra={"claimUID": uid})
        try:
            preparer.unprepare_uid(uid)
        except CdiSpecError:  # a UID no spec file can carry: only the record to drop
            with preparer.claim_lock(uid), preparer.state_lock():
                preparer.store.remove(uid)
        cleaned += 1
    cleaned += _leaked_specs(preparer)
    cleaned += _leaked_metadata(preparer)
    # Temp files of writes that crashed for claims nobody asks about again.
    old = sweep_claim_spec_temps(preparer.cdi_root, preparer.driver, older_than=TEMP_MAX_AGE)
    return cleaned + len(old)


def _leaked_specs(preparer: Preparer) -> int:
    # Prepare records PrepareStarted before it writes a spec and unprepare deletes the
    # spec before the entry, so a spec without an entry belongs to no live prepare.
    # The check runs under each claim's lock, so an in-flight prepare cannot race it.
    cleaned = 0
    for uid in list_claim_specs(preparer.cdi_root, preparer.driver):
        with preparer.claim_lock(uid), preparer.state_lock():
            if preparer.store.get(uid) is not None:
                continue
            delete_claim_spec(preparer.cdi_root, driver=preparer.driver, claim_uid=uid)
        log.info("deleted leaked CDI spec", extra={"claimUID": uid})
        cleaned += 1
    return cleaned


def _leaked_metadata(preparer: Preparer) -> int:
    # Written after PrepareStarted and deleted before the entry, so metadata without an
    # entry belongs to no live prepare (a lost checkpoint rebuilt from the specs, say).
    cleaned = 0
    for uid in list_claim_metadata(preparer.metadata_root):
        with preparer.claim_lock(uid), preparer.state_lock():
            if preparer.store.get(uid) is not None:
                continue
            delete_claim_metadata(preparer.metadata_root, uid)
        log.info("deleted leaked device metadata", extra={"claimUID": uid})
        cleaned += 1
    return cleaned


def run_periodically(
    preparer: Preparer, claims: ClaimReader, stop: threading.Event, *, interval: float = 60.0
) -> None:
    while not stop.is_set():
        try:
            reconcile(preparer, claims)
        except Exception as err:  # API server away: try again next period
            log.warning("stale-claim reconcile failed", extra={"error": str(err)})
        stop.wait(interval)


def _rebuilt_device(
    preparer: Preparer, uid: str, cdi_name: str, pool: str | None
) -> PreparedDevice:
    name = device_of_cdi_name(uid, cdi_name)
    share = cdi_name.partition(SHARE_MARK)[2] or None
    device = PreparedDevice(
        pool_name=pool or preparer.pool,
        device_name=name,
        cdi_device_ids=(
            cdi_device_id(driver=preparer.driver, claim_uid=uid, device_name=name, share_id=share),
        ),
        share_id=share,
        # A share's spec only exists for an MPS share in practice; keeping it MPS keeps
        # its GPU's daemon running for the containers that use it.
        sharing=MPS if share else None,
    )
    known = preparer.devices.get(name)
    if known is None or known.mig_placement is None:
        return device
    # A dynamic MIG device: its placement is held again (its instance is in use, not
    # an orphan), and the next prepare adopts the instance it finds there.
    return device.model_copy(update={"mig": creating_record(known.mig_placement)})


def rebuild_from_specs(preparer: Preparer) -> int:
    """Re-record the claims whose CDI specs exist after the checkpoint was lost.

    The spec names the claim (annotations) and its devices, which is enough to keep those
    devices reserved. Entries come back as PrepareStarted, so kubelet's next prepare
    redoes the full path against the API server (request names included), and the
    stale-claim pass removes those whose claim is gone.
    """
    rebuilt = 0
    for uid in list_claim_specs(preparer.cdi_root, preparer.driver):
        found = _spec_device_names(preparer, uid)
        if found is None:
            continue
        identity, names = found
        devices = [_rebuilt_device(preparer, uid, name, pool) for name, pool in names]
        with preparer.claim_lock(uid), preparer.state_lock():
            if preparer.store.get(uid) is None:
                preparer.store.mark_started(
                    uid,
                    namespace=identity.namespace,
                    name=identity.name,
                    devices=devices,
                )
                rebuilt += 1
    return rebuilt


def _spec_device_names(
    preparer: Preparer, uid: str
) -> tuple[ClaimIdentity, list[tuple[str, str | None]]] | None:
    """Whose the claim's spec is and the devices it names, each with the DevicePool it
    came from (None: the node's), or ``None`` when it names no claim of this UID or
    cannot be read.

    One damaged spec (not JSON, not a regular file) must not keep the plugin from
    starting: it is skipped with a warning, and the stale-claim pass deletes it as a
    spec no checkpoint entry accounts for.
    """
    try:
        spec = read_claim_spec(preparer.cdi_root, driver=preparer.driver, claim_uid=uid)
    except CdiSpecError as err:
        log.warning("skipped an unreadable CDI spec", extra={"claimUID": uid, "error": str(err)})
        return None
    identity = claim_identity(spec) if spec is not None else None
    if spec is None or identity is None or identity.uid != uid:
        return None
    entries = spec.get("devices")
    if not isinstance(entries, list) or not all(isinstance(d, dict) for d in entries):
        log.warning("skipped a CDI spec without a device list", extra={"claimUID": uid})
        return None
    # A request's metadata mount is not a device: nothing to reserve.
    return identity, [
        (str(d.get("name", "")), _pool_of(uid, d))
        for d in entries
        if not is_metadata_cdi_name(str(d.get("name", "")))
    ]


def _pool_of(uid: str, entry: Mapping[str, Any]) -> str | None:
    """The DevicePool a spec's device came from (its ``DRASIL_DEVICE_<NAME>_POOL``)."""
    name = device_of_cdi_name(uid, str(entry.get("name", "")))
    wanted = f"{device_env_name(name)}_{POOL_SETTING}="
    edits = entry.get("containerEdits")
    env = edits.get("env") if isinstance(edits, Mapping) else None
    for item in env if isinstance(env, list) else []:
        if isinstance(item, str) and item.startswith(wanted):
            return item.removeprefix(wanted) or None
    return None

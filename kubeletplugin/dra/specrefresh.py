"""Prepared claims' CDI specs kept naming the driver files the node has now.

kubelet prepares a claim once per Pod; a container that restarts later (a crash, a
liveness probe, ``restartPolicy: Always``) is created from the spec written then. When
the NVIDIA driver is upgraded under a running node, the files that spec mounts are
gone, and the restart fails with a mount error until the Pod is deleted. So at start,
and whenever the node's driver files change (``NodeEdits`` notices it with a few
``stat`` calls), the spec of every recorded claim gets the node's spec-wide edits of
now. Its devices are not touched: running containers keep what they have, and only
the next container created from the spec sees the new files.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from drasil.api.checkpoint import ClaimState
from drasil.driver.cdi.claimspecs import list_claim_specs, rewrite_common_edits
from drasil.driver.cdi.spec import CdiSpecError, ContainerEdits
from drasil.driver.devices import HardwareError
from drasil.kubeletplugin.dra.prepare import Preparer

log = logging.getLogger(__name__)

INTERVAL = 5.0
"""Seconds between two looks at the driver's folders (a handful of ``stat`` calls)."""


def refresh_specs(preparer: Preparer, edits: ContainerEdits) -> int:
    """Give every recorded claim's spec ``edits``; how many specs changed.

    Each spec is rewritten under its claim's lock and the state lock, and only while
    the claim is recorded, so an unprepare (which deletes the spec before the record)
    is never undone by a late rewrite.
    """
    changed = 0
    for uid in list_claim_specs(preparer.cdi_root, preparer.driver):
        with preparer.claim_lock(uid), preparer.state_lock():
            if preparer.store.get(uid) is None:
                continue
            try:
                if rewrite_common_edits(
                    preparer.cdi_root, driver=preparer.driver, claim_uid=uid, edits=edits
                ):
                    changed += 1
            except CdiSpecError as err:  # a damaged spec: the reconcile deals with it
                log.warning("claim spec not rewritten", extra={"claimUID": uid, "error": str(err)})
    return changed


class SpecRefresher:
    """Rewrites the claims' specs once after each change of the node's driver files."""

    def __init__(self, preparer: Preparer, *, on_change: Callable[[str, int], None]) -> None:
        self.preparer = preparer
        self.on_change = on_change  # (driver version, specs rewritten)
        self._done: ContainerEdits | None = None
        self._failed = ""

    def check(self) -> int:
        """One look; the number of specs rewritten (0 when nothing changed)."""
        node_edits = self.preparer.node_edits
        if node_edits is None:
            return 0
        try:
            edits = node_edits.current()  # the same object until the files change
        except HardwareError as err:  # mid-upgrade, or no driver: the prepares say so too
            if str(err) != self._failed:
                log.warning("driver files not usable", extra={"error": str(err)})
            self._failed = str(err)
            return 0
        self._failed = ""
        if edits is self._done:
            return 0
        with self.preparer.state_lock():
            in_flight = any(
                r.state is ClaimState.PREPARE_STARTED for r in self.preparer.store.claims().values()
            )
        changed = refresh_specs(self.preparer, edits)
        # A prepare in flight may have planned with the edits of before and write its
        # spec after this pass: the next look passes again, until one finds nothing
        # to change while no prepare was in flight.
        if not changed and not in_flight:
            self._done = edits
        if changed:
            version = node_edits.files_version()
            log.info(
                "claim specs given the driver's files", extra={"version": version, "specs": changed}
            )
            self.on_change(version, changed)
        return changed

    def run(self, stop: threading.Event, *, interval: float = INTERVAL) -> None:
        while not stop.is_set():
            try:
                self.check()
            except Exception as err:  # never let one bad look end the loop
                log.error("claim spec refresh failed", extra={"error": str(err)})
            stop.wait(interval)

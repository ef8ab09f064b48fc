"""NodePrepareResources / NodeUnprepareResources: the claim's devices made ready.

What a prepare does is decided first, without side effects, by
``drasil.driver.claims.plan`` (devices, configs, sharing env, CDI IDs, the devices the
checkpoint records). This module only carries the plan out, in an order of effects
chosen so that a crash (kill -9) at any point leaves a state the next call repairs:

prepare:   checkpoint PrepareStarted (with the planned devices)
           [-> MIG instances created -> checkpoint PrepareStarted with their ids]
           -> metadata files written atomically -> CDI spec written atomically
           -> checkpoint PrepareCompleted
unprepare: CDI spec deleted -> metadata files deleted [-> MIG instances destroyed]
           -> checkpoint entry removed

A MIG instance that shares of one placement hold together (``--gpu-sharing
consumable``) is cut by the first share's prepare (the others adopt it) and destroyed
by the last share's unprepare, after its MPS daemon is stopped.

The metadata files (KEP-5304, ``drasil.driver.cdi.metadata``) are written before the
spec that mounts them and deleted after it, so a spec never names a missing file.

The bracketed steps are those of dynamic MIG devices (NVIDIA's ``migs``, reached
through the vendor seam, ``drasil.kubeletplugin.vendors.seam``): the checkpoint
names the placement before NVML is asked and the instance ids after,
so a crash at any step is finished by the next call instead of leaking an instance.
AMD dynamic partitions have their GPU's mode switched at the same point
(AMD's ``modes``), the mode before recorded first, and put
back by the settle after the last claim's unprepare.

A PrepareStarted entry reserves its devices, so a crash never lets a second claim
take a device whose CDI spec may still exist; a repeated prepare simply redoes the
same steps and produces identical output. Different claims prepare concurrently;
the same claim is serialized by a per-claim lock, and every checkpoint
read-modify-write runs under one lock shared with other plugin instances on the node
(a ``FileLock`` in the state dir) after re-reading what they may have written.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from drasil.api.checkpoint import ClaimRecord, ClaimState, MigRecord, PreparedDevice
from drasil.api.config import IommuBackendPolicy, VfioDeviceConfig
from drasil.driver.apierrors import ApiUnavailable, InvalidName, http_answer
from drasil.driver.cdi.claimspecs import (
    delete_claim_spec,
    read_claim_spec,
    sweep_claim_spec_temps,
    write_claim_spec,
)
from drasil.driver.cdi.metadata import METADATA_DIR, delete_claim_metadata, write_claim_metadata
from drasil.driver.cdi.spec import CdiSpecError, ContainerEdits
from drasil.driver.checkpoint import CheckpointStore
from drasil.driver.claims.deviceconfigs import AllocationError, ConfigResolutionError
from drasil.driver.claims.plan import (
    ClaimRef,
    DevicePlan,
    NodePool,
    PlanError,
    PreparePlan,
    check_not_held,
    plan_prepare,
)
from drasil.driver.claims.pooldevices import foreign_pools, pool_devices
from drasil.driver.claims.sharing import MPS
from drasil.driver.devices import Device, HardwareError, MigPlacement, Vendor
from drasil.driver.files import FileLock, LockTimeoutError, crash_point
from drasil.driver.migrecords import creating_record
from drasil.driver.objects import ResourceClaim
from drasil.driver.vfio.devices import PASSTHROUGH_COUNTER, VfioRequest
from drasil.kubeletplugin.vendors.seam import (
    EditsSource,
    InstanceMaker,
    ModeSwitcher,
    PassthroughBinder,
    SharingStep,
)

log = logging.getLogger(__name__)

# Shorter than kubelet's 45 s call timeout, so a stuck peer yields a claim error
# that kubelet retries instead of a dead call.
STATE_LOCK_TIMEOUT = 30.0


class ClaimReader(Protocol):
    """Reads a ResourceClaim from the API server as its JSON object.

    ``cached=True`` may answer from the API server's watch cache (a moment old);
    the Preparer falls back to a fresh read when that copy cannot be used.
    """

    def get_claim(
        self, namespace: str, name: str, *, cached: bool = False
    ) -> Mapping[str, Any] | None: ...


class PoolReader(Protocol):
    """Reads a DevicePool (``drasil.dev/v1alpha1``) as its JSON object, or None."""

    def get_device_pool(self, name: str) -> Mapping[str, Any] | None: ...


class PrepareError(Exception):
    """A claim that cannot be prepared; the message goes to kubelet and the user."""


# Errors that are the claim's (or a peer's lock), answered to kubelet as the claim's
# error; anything else is a bug and fails the call.
_CLAIM_ERRORS = (
    PrepareError,
    PlanError,
    AllocationError,
    CdiSpecError,
    LockTimeoutError,
    HardwareError,  # the GPU, its driver or its tool refused (each vendor's errors)
)

# Faults that are not the claim's but expected, each told whole by its message: the API
# server away or refusing the read (``http_answer``), a namespace or name kubelet sent
# that no claim can have. Logged like the claim errors, as one warning line (kubelet
# gets the error, shows it in the Pod's events and retries; nothing in the plugin is
# broken); anything else is a bug and is logged with its traceback.
_EXPECTED_FAULTS = (*_CLAIM_ERRORS, ApiUnavailable, InvalidName)


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class StateLock:
    """The checkpoint's lock: one per node daemon, taken around every read-modify-write
    of the checkpoint by prepare, unprepare and the vendors' steps, across threads (a
    lock) and plugin instances (a ``FileLock`` in the state dir, so that a second
    instance during a rolling update waits). Each hold re-reads what another instance
    may have written. Reentrant in one thread: a vendor step that takes it may be
    called by one that holds it (a GPU's MPS lock is always taken before it)."""

    def __init__(self, store: CheckpointStore, state_dir: Path) -> None:
        self.store = store
        self._thread_lock = threading.Lock()
        self._file_lock = FileLock(
            state_dir / "checkpoint.lock", timeout=STATE_LOCK_TIMEOUT, keep_open=True
        )
        self._owner: int | None = None

    @contextmanager
    def __call__(self) -> Iterator[None]:
        if self._owner == threading.get_ident():
            yield
            return
        with self._thread_lock, self._file_lock:
            self._owner = threading.get_ident()
            try:
                self.store.reload_if_changed()
                yield
            finally:
                self._owner = None


class _KeyedLocks:
    """One lock per key (claim UID), created on demand and dropped when unused."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._locks[key]
                if users == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)


API_READERS = 16
"""Prepares that may wait for the API server at once: half of the DRA socket's 32
gRPC threads (``drasil.kubeletplugin.sockets``)."""
API_SLOT_WAIT = 1.0
"""Seconds a prepare waits for one of the ``API_READERS`` slots before it fails."""


@dataclass
class Preparer:
    """Prepares and unprepares claims for one node's pool of one driver."""

    driver: str
    pool: str
    devices: Mapping[str, Device]
    claims: ClaimReader
    store: CheckpointStore
    cdi_root: Path
    state_dir: Path
    common_edits: ContainerEdits = field(default_factory=ContainerEdits)
    # The node's driver files and control nodes, kept current; wins over common_edits.
    node_edits: EditsSource | None = None
    # Whose devices get the spec-wide edits (None: NodePool's default, NVIDIA's).
    edits_vendor: Vendor | None = None
    api_readers: int = API_READERS
    # The vendors' prepare steps (kubeletplugin.vendors.seam.PrepareSteps):
    migs: InstanceMaker | None = None  # None: no vendor cuts instances (MIG) here
    effects: SharingStep | None = None  # None: sharing reaches containers as env only
    partitions: ModeSwitcher | None = None  # None: no vendor switches GPU modes here
    # None: no GPU is passed through to VMs here (--passthrough off).
    passthrough: PassthroughBinder | None = None
    # Why a device may not be prepared now (None: it may), e.g. another device plugin
    # on the node hands it out (doublebooking.py); None: every device may.
    withheld: Callable[[str], str | None] | None = None
    # Where the DevicePools of claims holding pool devices are read; None: such claims
    # are refused as not this node's.
    pools: PoolReader | None = None
    # The checkpoint's lock, shared with the vendors' steps; None: the Preparer's own.
    lock: StateLock | None = None

    def __post_init__(self) -> None:
        self._api_slots = threading.BoundedSemaphore(self.api_readers)
        self._claim_locks = _KeyedLocks()
        if self.lock is None:
            self.lock = StateLock(self.store, self.state_dir)
        # Whose devices the spec-wide edits go to: the vendor given, else NodePool's own.
        self._edits_vendor = self.edits_vendor or NodePool.common_edits_vendor
        self.store.index_devices(self._gpu_key)

    @property
    def node(self) -> NodePool:
        """The devices claims are prepared with, as the prepare plan sees them."""
        return NodePool(
            driver=self.driver,
            pool=self.pool,
            devices=self.devices,
            common_edits=self.common_edits
            if self.node_edits is None
            else self.node_edits.current(),
            common_edits_vendor=self._edits_vendor,
            metadata_root=self.metadata_root,
        )

    @property
    def metadata_root(self) -> Path:
        """Where the claims' KEP-5304 metadata files are kept on the host."""
        return self.state_dir / METADATA_DIR

    def state_lock(self) -> AbstractContextManager[None]:
        """Exclusive access to the checkpoint, across threads and plugin instances."""
        assert self.lock is not None
        return self.lock()

    # ---- prepare -------------------------------------------------------------------

    def prepare(self, ref: ClaimRef) -> PrepareResult:
        with self._claim_locks.hold(ref.uid):
            try:
                devices = self._prepare_locked(ref)
            except _CLAIM_ERRORS as err:
                log.warning("prepare failed", extra={**ref.log_fields(), "error": str(err)})
                return PrepareResult(error=str(err))
            except ConfigResolutionError as err:
                message = "; ".join(err.problems)
                log.warning("prepare failed", extra={**ref.log_fields(), "error": message})
                return PrepareResult(error=f"invalid device config: {message}")
            except Exception as err:  # a fault, not the claim's: still only this claim's answer
                error = fault_text(err, ref, action="prepare")
                _log_fault("prepare failed", ref, err, error)
                return PrepareResult(error=error)
        # Debug, not info: at default verbosity the hot path formats no log record.
        log.debug("prepared", extra={**ref.log_fields(), "devices": _names(devices)})
        return PrepareResult(devices=devices)

    def _prepare_locked(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        with self.state_lock():
            record = self.store.get(ref.uid)
        if self._still_prepared(ref, record):
            assert record is not None
            return record.devices
        claim = self._read_claim(ref)
        node = self._claim_node(claim)
        plan = plan_prepare(claim, ref=ref, node=node)
        self._check_not_withheld(plan)
        if self.effects is not None:
            self.effects.check(plan, claim)
        return self._carry_out(plan, claim, node, resumed=record is not None)

    def _claim_node(self, claim: Mapping[str, Any]) -> NodePool:
        """The node as the claim's plan sees it: with the DevicePool devices it holds."""
        names = foreign_pools(claim, driver=self.driver, node_pool=self.pool)
        if not names or self.pools is None:
            return self.node
        pools = {name: self._read_pool(name) for name in names}
        found = pool_devices(claim, pools, driver=self.driver, node=self.pool)
        return replace(self.node, pool_devices=found)

    def _read_pool(self, name: str) -> Mapping[str, Any] | None:
        assert self.pools is not None
        # The same slots as claim reads: a hung API server holds no more gRPC threads.
        if not self._api_slots.acquire(timeout=API_SLOT_WAIT):
            raise PrepareError(
                f"{self.api_readers} prepares are already waiting for the API server; "
                "kubelet retries this claim"
            )
        try:
            return self.pools.get_device_pool(name)
        except Exception as err:
            if (answer := http_answer(err)) is not None and answer[0] == 403:
                raise PrepareError(
                    f"DevicePool {name}: the plugin may not read it (403 {answer[1]}); its "
                    "ClusterRole needs get on devicepools.drasil.dev (upgrade the chart)"
                ) from None
            raise
        finally:
            self._api_slots.release()

    def _check_not_withheld(self, plan: PreparePlan) -> None:
        """A claim allocated a withheld device before kube-scheduler saw it go from the
        slices is refused (kubelet retries it); claims prepared before stay."""
        if self.withheld is None:
            return
        for device in plan.prepared:
            if device.pool_name != self.pool:
                continue  # a DevicePool device: no device plugin of this node has it
            why = self.withheld(device.device_name)
            if why is not None:
                raise PrepareError(f"device {device.device_name!r} is withheld: {why}")

    def _carry_out(
        self, plan: PreparePlan, claim: Mapping[str, Any], node: NodePool, *, resumed: bool
    ) -> tuple[PreparedDevice, ...]:
        ref = plan.claim
        placements = _placements(plan)
        with self.state_lock():
            check_not_held(plan, self._possible_holders(plan), devices=self.devices)
            self.store.mark_started(
                ref.uid,
                namespace=ref.namespace,
                name=ref.name,
                devices=_with_migs(plan.prepared, {n: creating_record(p) for n, p in placements}),
            )
        crash_point("prepare-after-started")
        switched = {**self._switch_partitions(plan), **self._pass_through(plan)}
        plan, prepared = self._cut_migs(plan, claim, node, placements, switched)
        if self.effects is not None:
            plan = self.effects.apply(plan, claim)
        if resumed:
            # A crash mid-write left a temp file; this claim's lock makes it ours to
            # remove. Only a prepare that got past PrepareStarted writes one, so a claim
            # without a record has none (and the CDI dir is not listed on every call).
            sweep_claim_spec_temps(self.cdi_root, self.driver, claim_uid=ref.uid)
        if plan.metadata is not None:
            write_claim_metadata(plan.metadata, driver=self.driver, root=self.metadata_root)
        write_claim_spec(plan.spec, cdi_root=self.cdi_root, driver=self.driver)
        crash_point("prepare-after-cdi")
        with self.state_lock():
            self.store.mark_completed(ref.uid, prepared)
        crash_point("prepare-after-completed")
        return prepared

    def _possible_holders(self, plan: PreparePlan) -> Mapping[str, ClaimRecord]:
        """The recorded claims with a device on a GPU the plan uses: the only ones
        ``check_not_held`` can find in the way (same device, or a part of the same
        partitionable GPU), looked up without visiting every claim of the node."""
        return self.store.holding(
            {self._name_key(d.result.device, pool=d.result.pool) for d in plan.devices}
        )

    def _gpu_key(self, device: PreparedDevice) -> str:
        """The physical GPU a recorded device is on (what the store indexes by)."""
        if (mig := device.mig or device.static_mig) is not None:
            return mig.parent_uuid  # the node may not publish the device any more
        return self._name_key(device.device_name, pool=device.pool_name)

    def _name_key(self, name: str, *, pool: str) -> str:
        if pool != self.pool:  # a DevicePool device: on no GPU of this node
            return f"pool:{pool}/{name}"
        device = self.devices.get(name)
        if device is None:  # not a device of this node: only its own name can clash
            return f"name:{name}"
        if device.mig_placement is not None:
            return device.mig_placement.parent_uuid
        return device.parent_uuid or device.uuid or f"name:{name}"

    def _switch_partitions(self, plan: PreparePlan) -> dict[str, Device]:
        """Put the GPUs of the claim's AMD dynamic partitions in their modes; the
        partitions as they exist then (with UUIDs and device nodes)."""
        wanted = [
            d.cdi.device
            for d in plan.devices
            if d.cdi.device.compute_partition is not None and not d.result.admin_access
        ]
        if not wanted:
            return {}
        if self.partitions is None:
            raise PrepareError("this plugin serves no AMD GPUs to switch partition modes of")
        return self.partitions.switch(wanted)

    def _pass_through(self, plan: PreparePlan) -> dict[str, Device]:
        """Bind the GPUs of the claim's passthrough devices to vfio-pci; the devices
        with their VFIO nodes."""
        wanted = [
            _vfio_request(d)
            for d in plan.devices
            if d.cdi.device.passthrough is not None and not d.result.admin_access
        ]
        if not wanted:
            return {}
        if self.passthrough is None:
            raise PrepareError("this plugin passes no GPU through to virtual machines")
        return self.passthrough.bind(wanted)

    def _cut_migs(
        self,
        plan: PreparePlan,
        claim: Mapping[str, Any],
        node: NodePool,
        placements: Sequence[tuple[str, MigPlacement]],
        switched: Mapping[str, Device],
    ) -> tuple[PreparePlan, tuple[PreparedDevice, ...]]:
        """Create the claim's MIG instances at ``placements`` (the plan's, found once);
        the plan again, with their UUIDs and nodes and those of the ``switched`` AMD
        partitions.

        Whole partitionable GPUs get MIG mode switched off (if no instance is left),
        so that they work as whole GPUs. Plans without any come back unchanged.
        """
        wholes = _whole_partitionable(plan)
        if not placements and not wholes and not switched:
            return plan, plan.prepared
        if (placements or wholes) and self.migs is None:
            raise PrepareError("this plugin has no NVML to create MIG instances with")
        for gpu in wholes:
            assert self.migs is not None
            self.migs.whole_gpu(gpu.uuid)
        created = {}
        for name, placement in placements:
            assert self.migs is not None
            created[name] = self.migs.ensure(placement)
        realized = {**self.devices, **switched}
        for name, instance in created.items():
            realized[name] = instance.device(self.devices[name])
        plan = plan_prepare(claim, ref=plan.claim, node=replace(node, devices=realized))
        if not created:
            return plan, plan.prepared
        prepared = _with_migs(plan.prepared, {n: i.record() for n, i in created.items()})
        ref = plan.claim
        with self.state_lock():
            self.store.mark_started(
                ref.uid, namespace=ref.namespace, name=ref.name, devices=prepared
            )
        crash_point("prepare-after-mig")
        return plan, prepared

    def _still_prepared(self, ref: ClaimRef, record: ClaimRecord | None) -> bool:
        """A completed claim whose CDI spec still exists needs no API call.

        A claim's allocation never changes while its UID stays, so the checkpoint
        answer is the API answer. A missing spec (tmpfs wiped) or one that cannot be read
        means: do it again.
        """
        if record is None or record.state != ClaimState.PREPARE_COMPLETED:
            return False
        try:
            spec = read_claim_spec(self.cdi_root, driver=self.driver, claim_uid=ref.uid)
        except CdiSpecError as err:  # not JSON, not a regular file: written again below
            log.warning(
                "claim spec unreadable; preparing again",
                extra={**ref.log_fields(), "error": str(err)},
            )
            return False
        return spec is not None

    def _read_claim(self, ref: ClaimRef) -> Mapping[str, Any]:
        # A hung API server holds each reader for a whole request timeout; past
        # api_readers of them a prepare fails after API_SLOT_WAIT, so that gRPC threads
        # stay free for unprepare, health and prepares answered from the checkpoint. A
        # server that answers frees a slot within milliseconds: a burst of prepares
        # (many Pods starting at once) waits for one instead of failing.
        if not self._api_slots.acquire(timeout=API_SLOT_WAIT):
            raise PrepareError(
                f"{self.api_readers} prepares are already waiting for the API server; "
                "kubelet retries this claim"
            )
        try:
            return self._read_claim_from_api(ref)
        finally:
            self._api_slots.release()

    def _read_claim_from_api(self, ref: ClaimRef) -> Mapping[str, Any]:
        # The claim was allocated and reserved long before kubelet calls us, so the
        # cache almost always has it; anything unexpected is read again, fresh.
        claim = self.claims.get_claim(ref.namespace, ref.name, cached=True)
        if not _usable(claim, ref.uid):
            claim = self.claims.get_claim(ref.namespace, ref.name)
        if claim is None:
            raise PrepareError(f"ResourceClaim {ref.namespace}/{ref.name} not found")
        uid = claim.get("metadata", {}).get("uid")
        if uid != ref.uid:
            raise PrepareError(
                f"ResourceClaim {ref.namespace}/{ref.name} has UID {uid}, kubelet asked for "
                f"{ref.uid}: the claim was deleted and re-created"
            )
        return claim

    # ---- unprepare -----------------------------------------------------------------

    def unprepare(self, ref: ClaimRef) -> str:
        """Undo a prepare; idempotent, needs no API server. Returns an error or ""."""
        with self._claim_locks.hold(ref.uid):
            try:
                self._unprepare_locked(ref.uid)
            except Exception as err:  # every claim of kubelet's call gets its own answer
                error = fault_text(err, ref, action="unprepare")
                _log_fault("unprepare failed", ref, err, error)
                return error
        log.debug("unprepared", extra=ref.log_fields())
        return ""

    def _unprepare_locked(self, uid: str) -> None:
        with self.state_lock():
            record = self.store.get(uid)
        if record is not None and record.state != ClaimState.PREPARE_COMPLETED:
            # Only a prepare that stopped between PrepareStarted and PrepareCompleted
            # can have left a temp file (a completed one swept before it wrote), so a
            # normal unprepare does not list the CDI directory.
            sweep_claim_spec_temps(self.cdi_root, self.driver, claim_uid=uid)
        delete_claim_spec(self.cdi_root, driver=self.driver, claim_uid=uid)
        crash_point("unprepare-after-cdi")
        delete_claim_metadata(self.metadata_root, uid)
        # The record stays until its instances are gone: it is what names them.
        migs = [d.mig for d in record.devices if d.mig is not None] if record else []
        if migs and self.migs is None:
            raise HardwareError("this plugin has no NVML to destroy the claim's MIG instances with")
        for held in record.devices if record else ():
            if held.mig is not None and held.share_id is not None:
                self._release_shared_mig(uid, held.mig)
            elif held.mig is not None:
                assert self.migs is not None
                if held.sharing == MPS and self.effects is not None and held.mig.uuid:
                    # Its own daemon's server holds the instance: stopped first.
                    self.effects.stop_daemon(held.mig.uuid)
                    crash_point("unprepare-after-mps-stop")
                self.migs.destroy(held.mig)
        crash_point("unprepare-after-mig")
        with self.state_lock():
            self.store.remove(uid)
        crash_point("unprepare-after-removed")
        if self._may_need_settling(record):
            self._settle(record.devices if record is not None else ())

    def _release_shared_mig(self, uid: str, mig: MigRecord) -> None:
        """The MIG instance of a share: destroyed by the last share's unprepare, its MPS
        daemon stopped first (the daemon's server holds the instance).

        The check and the destroy run under the checkpoint lock: a prepare records its
        claim before it asks for the instance, so no share can adopt the instance
        between the two (it either is seen here, or finds the instance gone and cuts
        a new one). The MIG lock is taken inside it, in the order the start-up
        reconcile takes them.
        """
        assert self.migs is not None
        daemon = self.effects.holding(mig.uuid) if self.effects and mig.uuid else nullcontext()
        with daemon, self.state_lock():
            others = [
                other
                for other_uid, other in self.store.holding({mig.parent_uuid}).items()
                if other_uid != uid and any(_same_instance(d.mig, mig) for d in other.devices)
            ]
            if others:
                log.debug(
                    "MIG instance kept for its other shares",
                    extra={"claimUID": uid, "mig": mig.uuid, "shares": len(others)},
                )
                return
            if self.effects is not None and mig.uuid:
                self.effects.stop_daemon(mig.uuid)
            crash_point("unprepare-after-mps-stop")
            self.migs.destroy(mig)

    def _may_need_settling(self, record: ClaimRecord | None) -> bool:
        """Whether GPU state may be left to undo: the claim shared a GPU or held an
        AMD GPU in a partition mode, or a GPU record is still there (a settle that
        failed). A claim of whole, unshared GPUs changed nothing on them, and skipping
        the settle keeps its unprepare from visiting every prepared claim. Daemons a
        crash left unrecorded are swept at start (``GpuEffects.resume``) and by the
        next shared claim's unprepare."""
        if record is not None and any(
            d.sharing is not None or d.partition is not None or d.vfio is not None
            for d in record.devices
        ):
            return True
        return bool(self.store.gpus())

    def _settle(self, released: Sequence[PreparedDevice]) -> None:
        # The claim is gone from the checkpoint: what is left to undo on its GPUs is
        # node state, settled again by the next unprepare and at start if this fails.
        settles: list[Callable[[], list[str]]] = []
        if self.effects is not None:
            settles.append(partial(self.effects.settle, released))
        if self.partitions is not None:
            settles.append(self.partitions.settle)
        if self.passthrough is not None:
            settles.append(self.passthrough.settle)
        for settle in settles:
            try:
                settle()
            except Exception as err:
                log.error("settling GPU state failed", extra={"error": str(err)})

    def unprepare_uid(self, uid: str) -> None:
        """Unprepare by UID alone (stale entries and leaked specs)."""
        with self._claim_locks.hold(uid):
            self._unprepare_locked(uid)

    def claim_lock(self, uid: str) -> AbstractContextManager[None]:
        """The lock every prepare and unprepare of this claim holds."""
        return self._claim_locks.hold(uid)


def _placements(plan: PreparePlan) -> list[tuple[str, MigPlacement]]:
    """The plan's dynamic MIG devices (admin access never cuts an instance)."""
    return [
        (d.result.device, d.cdi.device.mig_placement)
        for d in plan.devices
        if d.cdi.device.mig_placement is not None and not d.result.admin_access
    ]


def _vfio_request(plan: DevicePlan) -> VfioRequest:
    """A passthrough device and the VFIO nodes its config asks for."""
    config = plan.config.config
    if not isinstance(config, VfioDeviceConfig):  # the plan resolved its fitting kind
        return VfioRequest(plan.cdi.device)
    return VfioRequest(
        plan.cdi.device,
        prefer_iommufd=config.iommu.backend_policy == IommuBackendPolicy.PREFER_IOMMUFD,
        api_device=config.iommu.enable_api_device,
    )


def _whole_partitionable(plan: PreparePlan) -> list[Device]:
    """Whole GPUs that dynamic MIG partitions (they consume their counter set)."""
    return [
        d.cdi.device
        for d in plan.devices
        if any(PASSTHROUGH_COUNTER not in c.counters for c in d.cdi.device.consumes_counters)
        and d.cdi.device.mig_placement is None
        and d.cdi.device.compute_partition is None  # AMD's: a mode switch, not MIG
        and d.cdi.device.passthrough is None  # vfio-pci's, whatever MIG mode it has
        and not d.result.admin_access
    ]


def _same_instance(a: MigRecord | None, b: MigRecord) -> bool:
    """Whether a recorded MIG device is the instance of ``b``: the same profile at the
    same placement of the same GPU (instance ids are reused, the placement is not)."""
    return (
        a is not None
        and a.parent_uuid == b.parent_uuid
        and a.profile_id == b.profile_id
        and a.placement_start == b.placement_start
    )


def _with_migs(
    devices: Sequence[PreparedDevice], migs: Mapping[str, MigRecord]
) -> tuple[PreparedDevice, ...]:
    return tuple(
        d.model_copy(update={"mig": migs[d.device_name]}) if d.device_name in migs else d
        for d in devices
    )


def _usable(claim: Mapping[str, Any] | None, uid: str) -> bool:
    if claim is None:
        return False
    view = ResourceClaim(claim)
    return view.meta.uid == uid and view.allocated


def _names(devices: Sequence[PreparedDevice]) -> str:
    return ",".join(d.device_name for d in devices)


def _log_fault(message: str, ref: ClaimRef, err: Exception, error: str) -> None:
    """An expected fault as one line naming the claim; an unexpected one with its
    traceback (an operator reads a traceback as a crash, so only a bug gets one)."""
    if isinstance(err, _EXPECTED_FAULTS) or http_answer(err) is not None:
        log.warning(message, extra={**ref.log_fields(), "error": error})
    else:
        log.error(message, exc_info=err, extra=ref.log_fields())


def fault_text(err: Exception, ref: ClaimRef, *, action: str) -> str:
    """A fault worded for the operator who reads it in the Pod's events."""
    what = f"{action} of ResourceClaim {ref.namespace}/{ref.name}"
    if isinstance(err, ApiUnavailable | InvalidName):
        return f"{what}: {err}"
    if (answer := http_answer(err)) is not None:
        return f"{what}: the API server answered {answer[0]} {answer[1]}"
    if isinstance(err, CdiSpecError | HardwareError):  # a UID that names no file; a GPU refused
        return f"{what}: {err}"
    if isinstance(err, OSError):
        where = f" ({err.filename})" if err.filename else ""
        return f"{what}: {err.strerror or err}{where}; kubelet retries the claim"
    if isinstance(err, RecursionError):
        return f"{what}: the ResourceClaim is nested too deeply to read"
    return f"{what} failed unexpectedly ({type(err).__name__}: {err}); see the plugin's log"

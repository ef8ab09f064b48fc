"""What prepared claims change on GPUs: MPS daemons of shared GPUs and MIG instances, time slices.

A share of a consumable GPU (``--gpu-sharing consumable``) is enforced by MPS: the GPU
gets one MPS control daemon (``daemons``), started with its first share, holding
limits that cover every share on it; each share's CDI device carries its own,
narrower limits (pinned memory, active threads), the daemon's pipe directory
and its ``/dev/shm``. While the daemon runs the GPU is in compute mode
EXCLUSIVE_PROCESS, so that only the MPS server can use it: a client that fails to
reach MPS then fails ("all CUDA-capable devices are busy") instead of running without
MPS and without limits. A claim whose config asks for time-slicing has its interval
applied to the GPU.

A share of a MIG placement (``--mig-mode dynamic`` with consumable sharing) is served
the same way by a daemon of its MIG instance (``CUDA_VISIBLE_DEVICES=MIG-<uuid>``: MPS
runs on top of MIG, one daemon per instance), keyed by the instance's UUID where a whole
GPU's is keyed by the GPU's. No compute mode is set for it: NVML sets compute modes
on whole GPUs only, and the instance's other tenants are its shares alone. Its daemon
holds the instance, so the last share's unprepare stops it (``stop_daemon``) before
the instance is destroyed.

All of it is node state that outlives a claim, so the checkpoint records it per GPU
(``gpus`` in ``api/checkpoint.py``), and ``settle`` undoes whatever no prepared claim
needs any more: it stops a daemon after the last share and puts back the compute mode
the GPU had, puts back the time slice the GPU had before the first time-sliced claim.
It runs after every unprepare and at start, so a crash anywhere in between is settled
by the next call or start.

Order in prepare (after the claim is recorded ``PrepareStarted``, so its devices
are held): a GPU setting is recorded as it was, then set, then recorded as set (the
time slice; the compute mode before the daemon's start); the daemon is started (or
found running), given its limits, then recorded.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Protocol, TypeVar

from drasil.api.checkpoint import ClaimState, GpuRecord, MpsDaemonRecord, PreparedDevice
from drasil.driver.cdi.spec import ContainerEdits
from drasil.driver.checkpoint import CheckpointStore
from drasil.driver.claims.plan import DevicePlan, PreparePlan
from drasil.driver.claims.sharing import MPS, time_slice_of
from drasil.driver.devices import Device, DeviceType, HardwareError
from drasil.driver.files import crash_point
from drasil.driver.nvidia.nvml import (
    COMPUTE_MODE_EXCLUSIVE_PROCESS,
    DeviceHandle,
    NvmlError,
    NvmlLibrary,
    nvml_session,
)
from drasil.driver.objects import ResourceClaim
from drasil.kubeletplugin.vendors.nvidia.mps.daemons import (
    CLIENT_LIMIT,
    CONTAINER_SHM_DIR,
    DaemonLimits,
    MpsDaemon,
    MpsDaemons,
    MpsError,
    share_edits,
    share_limits_of,
)

log = logging.getLogger(__name__)

MIG_UUID_PREFIX = "MIG-"  # NVML's MIG device UUIDs; a whole GPU's start with GPU-
_T = TypeVar("_T")


class ShareError(HardwareError):
    """A GPU change a claim needs that could not be made; the claim's error."""


@dataclass(frozen=True)
class MpsClient:
    """A prepared claim's device served by an MPS daemon."""

    claim_uid: str
    namespace: str
    name: str
    device: str
    # When its claim's record was written: a claim prepared again since (by another
    # Pod) is another client.
    since: datetime


class DaemonNotReady(ShareError):
    """The MPS daemon of ``gpu`` did not start or answer within its bound (retriable)."""

    def __init__(self, gpu: str, message: str) -> None:
        super().__init__(message)
        self.gpu = gpu


NOT_READY_REASON = "MpsDaemonNotReady"


class EventPoster(Protocol):
    """Posts an Event (the KubeApi's ``post_event``)."""

    def post_event(
        self,
        *,
        involved: Mapping[str, str],
        reason: str,
        message: str,
        event_type: str = "Warning",
        component: str = "drasil",
        name: str | None = None,
    ) -> bool: ...


class PodReader(EventPoster, Protocol):
    """Reads a Pod by name (None when there is none) and tells it (the KubeApi)."""

    def get_pod(self, namespace: str, name: str) -> Mapping[str, Any] | None: ...


def tell_pods(
    api: EventPoster, claim: Mapping[str, Any], *, reason: str, message: str, name: str
) -> None:
    """A Warning Event on each Pod the claim is reserved for, named ``<pod>.<name>`` so
    that one is posted once; best effort (the claim's error and the log say it too)."""
    view = ResourceClaim(claim)
    namespace = view.meta.namespace
    for pod in (c for c in view.reserved_for if c.is_pod):
        involved = {"kind": "Pod", "name": pod.name, "namespace": namespace}
        if pod.uid:
            involved["uid"] = pod.uid
        try:
            api.post_event(
                involved=involved, reason=reason, message=message, name=f"{pod.name}.{name}"
            )
        except Exception as err:
            log.warning(
                "Event not posted", extra={"pod": f"{namespace}/{pod.name}", "error": str(err)}
            )


def shm_conflict(pod: Mapping[str, Any]) -> str | None:
    """What in a Pod mounts its own ``/dev/shm``, or None. An MPS share's containers get
    the daemon's ``/dev/shm`` through CDI, which would silently take the place of the
    Pod's volume there; so such a Pod is refused, by name."""
    spec = pod.get("spec") or {}
    for kind in ("initContainers", "containers"):
        for container in spec.get(kind) or []:
            for mount in container.get("volumeMounts") or []:
                if str(mount.get("mountPath", "")).rstrip("/") == CONTAINER_SHM_DIR:
                    return (
                        f'container "{container.get("name")}" mounts volume '
                        f'"{mount.get("name")}" at {CONTAINER_SHM_DIR}'
                    )
    return None


class GpuEffects:
    """Applies and settles the per-GPU state of prepared claims."""

    def __init__(
        self,
        lib: NvmlLibrary,
        daemons: MpsDaemons,
        *,
        store: CheckpointStore,
        state_lock: Callable[[], AbstractContextManager[None]],
        devices: Mapping[str, Device],
        pods: PodReader | None = None,
        whole_devices: bool = True,
    ) -> None:
        self.pods = pods
        # Whether MPS runs for devices allocated whole (not only for shares).
        self.whole_devices = whole_devices
        self.lib = lib
        self.daemons = daemons
        self.store = store
        self.state_lock = state_lock
        self.devices = devices
        self._handles: dict[str, DeviceHandle] = {}

    # ---- prepare ----------------------------------------------------------------------

    def check(self, plan: PreparePlan, claim: Mapping[str, Any]) -> None:
        """Before anything is recorded: this plugin runs the MPS daemons the claim needs,
        and the claim's Pods can use them (none brings its own ``/dev/shm``)."""
        for device in plan.devices:
            if device.share_limits is None or device.result.share_id is not None:
                continue
            if not self.whole_devices:
                raise ShareError(
                    f'device "{device.result.device}": sharing.strategy: MPS on a device '
                    "allocated whole needs MPS daemons, which this node's plugin does not "
                    "run (--no-mps-whole-devices; the chart runs them with mps.enabled=true, "
                    "gpuSharing=consumable or compatibility=nvidia-dra); allowed values here "
                    'are "Exclusive", "TimeSlicing"'
                )
        if self.pods is None or not any(d.share_limits is not None for d in plan.devices):
            return
        view = ResourceClaim(claim)
        namespace = view.meta.namespace
        for consumer in view.reserved_for:
            if not consumer.is_pod:
                continue
            name = consumer.name
            try:
                pod = self.pods.get_pod(namespace, name)
            except Exception as err:  # the check is a courtesy: never a reason to fail
                log.warning("Pod not read", extra={"pod": f"{namespace}/{name}", "error": str(err)})
                continue
            conflict = shm_conflict(pod) if pod is not None else None
            if conflict:
                raise ShareError(
                    f"Pod {namespace}/{name}: {conflict}; its MPS device gives every "
                    f"container the MPS daemon's {CONTAINER_SHM_DIR}, which MPS clients "
                    "must share with the daemon: remove that volume mount, or ask for a "
                    "whole GPU"
                )

    def apply(self, plan: PreparePlan, claim: Mapping[str, Any]) -> PreparePlan:
        """Make the GPU changes the plan's devices need; the plan with share edits. A
        daemon that is not ready in time fails the claim (kubelet retries it) and is
        told to the claim's Pods in an Event."""
        try:
            return self._apply(plan)
        except DaemonNotReady as err:
            self._tell_pods(claim, str(err), err.gpu)
            raise

    def _apply(self, plan: PreparePlan) -> PreparePlan:
        devices = list(plan.devices)
        for index, device in enumerate(devices):
            gpu = device.cdi.device.uuid
            time_slice = time_slice_of(device.prepared.sharing)
            limits = device.share_limits
            if time_slice is None and limits is None:
                continue
            with self.holding(gpu):  # calls for other GPUs go on meanwhile
                if time_slice is not None:
                    self._set_time_slice(gpu, time_slice)
                if limits is not None:
                    share = share_limits_of(limits.memory_bytes, limits.thread_percentage)
                    self._check_client_limit(gpu)
                    if device.cdi.device.type != DeviceType.MIG:
                        self._set_compute_mode(gpu)
                    daemon = self._daemon(
                        gpu,
                        share,
                        multiuser=device.mps_multiuser,
                        exact=device.result.share_id is None,
                    )
                    devices[index] = _with_edits(device, share_edits(daemon, share))
        if devices == list(plan.devices):
            return plan
        crash_point("prepare-after-share")
        spec = replace(plan.spec, devices=tuple(d.cdi for d in devices))
        return replace(plan, devices=tuple(devices), spec=spec)

    @contextmanager
    def holding(self, uuid: str) -> Iterator[None]:
        """The lock of the GPU (or MIG instance) ``uuid``: every change of its daemon,
        compute mode and time slice, and every settle of it, runs under it, so a settle
        never undoes what a prepare of the same GPU is doing; other GPUs' calls do not
        wait. Taken before the state lock, never while holding it."""
        try:
            with self.daemons.hold(uuid):
                yield
        except MpsError as err:
            raise ShareError(str(err)) from err

    def _daemon(
        self, gpu: str, limits: DaemonLimits, *, multiuser: bool = False, exact: bool = False
    ) -> MpsDaemon:
        try:
            daemon = self.daemons.ensure(gpu, limits, multiuser=multiuser, exact=exact)
        except (OSError, MpsError) as err:
            raise DaemonNotReady(
                gpu,
                f"GPU {gpu}: the MPS control daemon is not ready: {err}; kubelet retries "
                "this claim, and the next try waits for the same daemon again",
            ) from err
        record = MpsDaemonRecord(
            multi_user=multiuser,
            pid=daemon.pid,
            start_time=daemon.start_time,
            pipe_dir=str(daemon.pipe_dir),
            log_dir=str(daemon.log_dir),
            shm_dir=str(daemon.shm_dir),
            memory_mib=daemon.limits.memory_mib if daemon.limits else None,
            thread_percentage=daemon.limits.thread_percentage if daemon.limits else None,
        )
        with self.state_lock():
            current = self.store.gpus().get(gpu) or GpuRecord()
            if current.mps != record:
                self.store.set_gpu(gpu, current.model_copy(update={"mps": record}))
        return daemon

    def _tell_pods(self, claim: Mapping[str, Any], message: str, gpu: str) -> None:
        """An Event on each Pod of the claim (in the background: best effort, and an API
        server that hangs must not hold the call), once per Pod and message."""
        if self.pods is None:
            return
        digest = hashlib.sha256(f"{gpu}/{message}".encode()).hexdigest()[:10]
        threading.Thread(
            target=tell_pods,
            args=(self.pods, claim),
            kwargs={"reason": NOT_READY_REASON, "message": message, "name": f"mps-{digest}"},
            name="mps-event",
            daemon=True,
        ).start()

    def _check_client_limit(self, gpu: str) -> None:
        """MPS serves at most ``CLIENT_LIMIT`` clients per GPU (fewer on a small MIG
        instance); the published memory policy keeps shares below it, this catches
        whatever got past (a policy changed under prepared claims)."""
        shares = self._shares_on(gpu)
        if shares > CLIENT_LIMIT:
            raise ShareError(
                f"GPU {gpu} has {shares} MPS shares prepared; MPS serves at most "
                f"{CLIENT_LIMIT} clients per GPU: kubelet retries this claim, which is "
                "prepared once other shares of the GPU are gone (or ask for more memory, "
                "so that fewer shares fit one GPU)"
            )

    def _set_compute_mode(self, gpu: str) -> None:
        """EXCLUSIVE_PROCESS before the GPU's daemon starts, the mode before recorded
        first (so a crash in between is put back by ``settle``)."""
        with self.state_lock():
            current = self.store.gpus().get(gpu) or GpuRecord()
            if current.compute_mode == COMPUTE_MODE_EXCLUSIVE_PROCESS:
                return
            if current.previous_compute_mode is None:
                before = self._nvml(gpu, "reading its compute mode", self.lib.device_compute_mode)
                current = current.model_copy(update={"previous_compute_mode": before})
                self.store.set_gpu(gpu, current)
        self._write_compute_mode(gpu, COMPUTE_MODE_EXCLUSIVE_PROCESS)
        with self.state_lock():
            current = self.store.gpus().get(gpu) or GpuRecord()
            update = {"compute_mode": COMPUTE_MODE_EXCLUSIVE_PROCESS}
            self.store.set_gpu(gpu, current.model_copy(update=update))
        log.info("compute mode set to EXCLUSIVE_PROCESS", extra={"gpu": gpu})

    def _set_time_slice(self, gpu: str, interval: int) -> None:
        with self.state_lock():
            current = self.store.gpus().get(gpu) or GpuRecord()
            if current.time_slice == interval:
                return
            if current.previous_time_slice is None:
                before = self._read_time_slice(gpu)
                current = current.model_copy(update={"previous_time_slice": before})
                self.store.set_gpu(gpu, current)
        self._write_time_slice(gpu, interval)
        with self.state_lock():
            current = self.store.gpus().get(gpu) or GpuRecord()
            self.store.set_gpu(gpu, current.model_copy(update={"time_slice": interval}))
        log.info("time slice set", extra={"gpu": gpu, "timeSlice": interval})

    # ---- unprepare and start ----------------------------------------------------------

    def stop_daemon(self, uuid: str) -> None:
        """Stop the MPS daemon serving ``uuid`` and forget it: a MIG instance whose last
        share is being unprepared, which cannot be destroyed while its server holds it.
        A caller that holds the state lock holds ``holding(uuid)`` first. Idempotent; a
        crash after it is finished by the repeated unprepare."""
        with self.holding(uuid):
            try:
                stopped = self.daemons.stop(uuid)
            except MpsError as err:
                raise ShareError(f"MIG instance {uuid}: its MPS daemon: {err}") from err
            if stopped:
                log.info("stopped the MPS daemon of a MIG instance", extra={"mig": uuid})
            with self.state_lock():
                current = self.store.gpus().get(uuid)
                if current is not None and current.mps is not None:
                    self.store.set_gpu(uuid, current.model_copy(update={"mps": None}))

    def resume(self) -> None:
        """At start: daemons of GPUs with prepared MPS shares run again (a node restart
        or an OOM kill may have taken them), then ``settle``."""
        with self.state_lock():
            recorded = dict(self.store.gpus())
        for gpu, limits in sorted(self._share_limits().items()):
            daemon = (recorded.get(gpu) or GpuRecord()).mps
            try:
                with self.holding(gpu):
                    if not gpu.startswith(MIG_UUID_PREFIX):
                        self._set_compute_mode(gpu)
                    multiuser = daemon is not None and daemon.multi_user
                    self._daemon(gpu, limits, multiuser=multiuser)
            except ShareError as err:
                log.error("MPS daemon not restarted", extra={"gpu": gpu, "error": str(err)})
        self.settle()

    def settle(self, released: Sequence[PreparedDevice] | None = None) -> list[str]:
        """Undo what no prepared claim needs any more; returns what was undone.

        Each GPU is settled under its lock, and whether a claim needs it is asked again
        there: a prepare records its claim before it takes the GPU's lock, so what it
        is setting up is never undone. After an unprepare (``released``: its devices)
        the settle waits for the locks of the GPUs it released; any other GPU whose lock
        is held is left to the holder (a prepare that needs it, or another settle), so
        unprepares of different GPUs never wait for each other. At start (None) every
        GPU is waited for.
        """
        mine = None if released is None else {s[0] for d in released if (s := self._served(d))}
        done: list[str] = []
        for gpu in self._to_settle():
            wait = mine is None or gpu in mine
            with self.daemons.hold(gpu, wait=wait) as held:
                if held:
                    done += self._settle_gpu(gpu)
        # A daemon started just before a crash was never recorded: nobody needs it.
        keep = self._keeps
        for gpu in self.daemons.sweep(keep=keep, wait=mine is None):
            done.append(f"stopped an unrecorded MPS daemon of GPU {gpu}")
        for what in done:
            log.info(what)
        return done

    def _keeps(self, gpu: str) -> bool:
        return gpu in self._needed()[0]

    def _to_settle(self) -> list[str]:
        """GPUs with state that no prepared claim needs now (looked at without their
        locks; each is asked again under its lock)."""
        mps_needed, slices_needed = self._needed()
        with self.state_lock():
            records = dict(self.store.gpus())
        return [
            gpu
            for gpu, record in sorted(records.items())
            if _left_over(record, mps=gpu in mps_needed, time_slice=gpu in slices_needed)
        ]

    def _settle_gpu(self, gpu: str) -> list[str]:
        """Undo one GPU's state that no claim needs; the caller holds its lock."""
        mps_needed, slices_needed = self._needed()
        with self.state_lock():
            record = self.store.gpus().get(gpu)
        if record is None:
            return []
        done: list[str] = []
        updated = record
        mps_set = record.mps is not None or record.compute_mode is not None
        if mps_set and gpu not in mps_needed:
            # The daemon first: while it runs it holds the GPU in EXCLUSIVE_PROCESS.
            self.daemons.stop(gpu)
            crash_point("settle-after-stop")
            updated = updated.model_copy(update={"mps": None})
            if record.mps is not None:
                done.append(f"stopped the MPS daemon of GPU {gpu}")
        if record.compute_mode is not None and gpu not in mps_needed:
            previous = record.previous_compute_mode or 0
            self._write_compute_mode(gpu, previous)
            updated = updated.model_copy(
                update={"compute_mode": None, "previous_compute_mode": None}
            )
            done.append(f"restored compute mode {previous} of GPU {gpu}")
        if record.time_slice is not None and gpu not in slices_needed:
            previous = record.previous_time_slice or 0
            self._write_time_slice(gpu, previous)
            updated = updated.model_copy(update={"time_slice": None, "previous_time_slice": None})
            done.append(f"restored time slice {previous} of GPU {gpu}")
        if updated != record:
            with self.state_lock():
                self.store.set_gpu(gpu, updated)
        return done

    def _served(self, held: PreparedDevice) -> tuple[str, int] | None:
        """The UUID a recorded share's daemon serves (its MIG instance's, else its
        GPU's) and that device's memory; None for a device not on this node."""
        device = self.devices.get(held.device_name)
        memory = device.capacity.get("memory", 0) if device is not None else 0
        if held.mig is not None:
            return (held.mig.uuid, memory) if held.mig.uuid else None
        return (device.uuid, memory) if device is not None and device.uuid else None

    def clients(self) -> dict[str, list[MpsClient]]:
        """Per GPU (or MIG instance) whose daemon is recorded as running, the prepared
        claims' devices it serves (the watch's view)."""
        with self.state_lock():
            records = dict(self.store.claims())
            running = {gpu for gpu, record in self.store.gpus().items() if record.mps}
        found: dict[str, list[MpsClient]] = {}
        for uid, record in sorted(records.items()):
            for held in record.devices:
                served = self._served(held) if held.sharing == MPS else None
                if served is not None and served[0] in running:
                    client = MpsClient(
                        uid, record.namespace, record.name, held.device_name, record.updated_at
                    )
                    found.setdefault(served[0], []).append(client)
        return found

    def _needed(self, *, unfinished_migs: bool = True) -> tuple[dict[str, int], set[str]]:
        """What prepared claims need: an MPS daemon on each of these GPUs and MIG
        instances (with its memory), and a time slice on these GPUs.

        Without ``unfinished_migs`` the MIG instances of claims not completely prepared
        are left out: at start, such an instance may be gone (a reboot), and the
        claim's prepare, run again, cuts a new one and starts its daemon.
        """
        mps: dict[str, int] = {}
        slices: set[str] = set()
        with self.state_lock():
            records = dict(self.store.claims())
        for record in records.values():
            done = record.state == ClaimState.PREPARE_COMPLETED
            for held in record.devices:
                if held.sharing is None or (served := self._served(held)) is None:
                    continue
                if held.mig is not None and not (done or unfinished_migs):
                    continue
                if held.sharing == MPS:
                    mps[served[0]] = served[1]
                elif time_slice_of(held.sharing) is not None:
                    slices.add(served[0])
        return mps, slices

    def _shares_on(self, gpu: str) -> int:
        """How many MPS shares prepared claims hold on the GPU (or MIG instance)."""
        with self.state_lock():
            records = dict(self.store.claims())
        return sum(
            1
            for record in records.values()
            for held in record.devices
            if held.sharing == MPS
            and (served := self._served(held)) is not None
            and served[0] == gpu
        )

    def _share_limits(self) -> dict[str, DaemonLimits]:
        """Per GPU with prepared MPS shares, the limits its daemon held (at start, for
        daemons that must run again); the whole GPU where none were recorded."""
        mps, _ = self._needed(unfinished_migs=False)
        with self.state_lock():
            gpus = dict(self.store.gpus())
        limits: dict[str, DaemonLimits] = {}
        for gpu, memory in mps.items():
            record = gpus.get(gpu, GpuRecord()).mps
            if record and record.memory_mib and record.thread_percentage:
                limits[gpu] = DaemonLimits(record.memory_mib, record.thread_percentage)
            else:
                limits[gpu] = DaemonLimits(max(1, memory // 2**20), 100)
        return limits

    def _nvml(self, gpu: str, what: str, call: Callable[[DeviceHandle], _T]) -> _T:
        """One NVML call on the GPU in a session of its own; its failure is the claim's."""
        try:
            with nvml_session(self.lib):
                return call(self._handle(gpu))
        except NvmlError as err:
            raise ShareError(f"GPU {gpu}: {what}: {err}") from err

    def _write_compute_mode(self, gpu: str, mode: int) -> None:
        self._nvml(
            gpu,
            f"setting compute mode {mode}",
            lambda handle: self.lib.device_set_compute_mode(handle, mode),
        )

    def _read_time_slice(self, gpu: str) -> int:
        return self._nvml(gpu, "reading its time slice", self.lib.device_time_slice)

    def _write_time_slice(self, gpu: str, interval: int) -> None:
        self._nvml(
            gpu,
            f"setting time slice {interval}",
            lambda handle: self.lib.device_set_time_slice(handle, interval),
        )

    def _handle(self, gpu: str) -> DeviceHandle:
        if gpu not in self._handles:
            for index in range(self.lib.device_count()):
                handle = self.lib.device_handle_by_index(index)
                self._handles[self.lib.device_uuid(handle)] = handle
        if gpu not in self._handles:
            raise ShareError(f"GPU {gpu} is not on this node any more")
        return self._handles[gpu]


def _left_over(record: GpuRecord, *, mps: bool, time_slice: bool) -> bool:
    """Whether a GPU keeps state its claims (which need MPS, a time slice) do not."""
    mps_set = record.mps is not None or record.compute_mode is not None
    return (mps_set and not mps) or (record.time_slice is not None and not time_slice)


def _with_edits(device: DevicePlan, edits: ContainerEdits) -> DevicePlan:
    cdi = replace(device.cdi, edits=edits)
    return replace(device, cdi=cdi)

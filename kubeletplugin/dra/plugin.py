"""DRA mode assembled: checkpoint recovery, the DRA and registration sockets, loops.

Discovery, health, HTTP and threads come from ``kubeletplugin.node``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from drasil.api.checkpoint import ClaimRecord
from drasil.api.kubelet.dra.v1 import dra_pb2_grpc as dra_v1_grpc
from drasil.api.kubelet.dra.v1beta1 import dra_pb2_grpc as dra_v1beta1_grpc
from drasil.api.kubelet.health.v1 import health_pb2_grpc as health_v1_grpc
from drasil.api.kubelet.health.v1alpha1 import health_pb2_grpc as health_v1alpha1_grpc
from drasil.api.kubelet.pluginregistration import registration_pb2 as reg_pb
from drasil.api.kubelet.pluginregistration import registration_pb2_grpc as reg_grpc
from drasil.driver.cdi.claimspecs import delete_claim_spec
from drasil.driver.checkpoint import CHECKPOINT_DIR, CheckpointStore
from drasil.driver.checkpointdisk import LoadOutcome, LoadResult
from drasil.driver.devices import Device
from drasil.driver.files import FileLock
from drasil.driver.hostresources import with_host_resources
from drasil.driver.kubeapi import KubeApi
from drasil.driver.nvidia.driverfiles import DriverRoot, find_binary
from drasil.driver.nvidia.nodelabels import node_labels
from drasil.driver.nvidia.nvml import NvmlLibrary
from drasil.driver.slices.publisher import PoolPublisher
from drasil.kubeletplugin.dra import doublebooking, reconcile, specrefresh
from drasil.kubeletplugin.dra.amdpartitions import PartitionModes
from drasil.kubeletplugin.dra.healthservice import HealthStreams, HealthV1, HealthV1alpha1
from drasil.kubeletplugin.dra.migs import MigInstances, held_by_dynamic_claims
from drasil.kubeletplugin.dra.mps import (
    CONTROL_PROGRAM,
    DaemonLauncher,
    DaemonProgram,
    MpsDaemons,
    ProcessLauncher,
)
from drasil.kubeletplugin.dra.mpspods import DaemonPods, KubePods, PodLauncher
from drasil.kubeletplugin.dra.nodelabels import NodeLabels
from drasil.kubeletplugin.dra.nodeslices import NodeSlices
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.dra.registration import Registration
from drasil.kubeletplugin.dra.service import ClaimWork, DRAPluginV1, DRAPluginV1beta1
from drasil.kubeletplugin.dra.shares import GpuEffects
from drasil.kubeletplugin.driverroot import (
    NOT_READY_REASON,
    log_readiness,
    node_edits,
    readiness,
)
from drasil.kubeletplugin.metrics import PluginMetrics
from drasil.kubeletplugin.node import NodeRuntime
from drasil.kubeletplugin.options import PluginOptions
from drasil.kubeletplugin.sockets import UnixSocketServer, pod_tag

log = logging.getLogger(__name__)

DRIVER_CHANGED_REASON = "DriverFilesChanged"
# Seconds a stopping plugin lets the calls kubelet already made finish (an MPS share's
# prepare waits for its daemon): within the Pod's default 30 s termination grace.
DRAIN_GRACE = 20.0
SOCKET_CHECK_INTERVAL = 0.2  # a deleted socket is back well within a second


@dataclass
class Intervals:
    """Loop periods; tests shorten them."""

    reconcile: float = 60.0
    slice_resync: float = 300.0
    health_resend: float = 30.0
    fault_poll: float = 0.25
    driver_files: float = specrefresh.INTERVAL
    device_plugins: float = doublebooking.INTERVAL
    node_labels: float = 300.0


def socket_names(opts: PluginOptions) -> tuple[str, str]:
    """(dra socket, registration socket) file names; per-Pod during rolling updates."""
    if opts.pod_uid:
        tag = pod_tag(opts.pod_uid)
        return f"dra-{tag}.sock", f"{opts.driver_name}-{tag}-reg.sock"
    return "dra.sock", f"{opts.driver_name}-reg.sock"


@dataclass
class KubeletPlugin:
    opts: PluginOptions
    lib: NvmlLibrary
    api: KubeApi
    metrics: PluginMetrics = field(default_factory=PluginMetrics)
    intervals: Intervals = field(default_factory=Intervals)
    # amdgpu's sysfs tree where AMD GPUs are served (drasil.driver.discovery.backends).
    amd_sysfs: Path | None = None

    def __post_init__(self) -> None:
        self.node = NodeRuntime(
            self.opts, lib=self.lib, devices_gauge=self.metrics.devices, amd_sysfs=self.amd_sysfs
        )
        self._servers: list[UnixSocketServer] = []
        dra_name, reg_name = socket_names(self.opts)
        self.dra_socket = self.opts.state_dir / dra_name
        self.reg_socket = self.opts.registrar_dir / reg_name

    @property
    def sockets(self) -> list[Path]:
        """The socket kubelet dials for claims (registration's socket is not named)."""
        return [self.dra_socket]

    # ---- start -------------------------------------------------------------------

    def start(self) -> None:
        found = with_host_resources(self.node.discover(), self.opts.host_resources_per_gpu)
        self.devices = {d.name: d for d in found}
        self.edits = node_edits(self.opts, self.lib)
        self._check_readiness()
        self.opts.state_dir.mkdir(parents=True, exist_ok=True)
        self.opts.cdi_root.mkdir(parents=True, exist_ok=True)
        self.store = CheckpointStore(self.opts.state_dir / CHECKPOINT_DIR)
        self.preparer = Preparer(
            driver=self.opts.driver_name,
            pool=self.opts.node_name,
            devices=self.devices,
            claims=self.api,
            store=self.store,
            cdi_root=self.opts.cdi_root,
            state_dir=self.opts.state_dir,
            node_edits=self.edits,
            migs=MigInstances(self.lib, state_dir=self.opts.state_dir),
            pools=self.api,
        )
        self.preparer.effects = GpuEffects(
            self.lib,
            MpsDaemons(
                self.opts.state_dir,
                program=mps_program(self.opts),
                launcher=mps_launcher(self.opts, self.api),
            ),
            store=self.store,
            state_lock=self.preparer.state_lock,
            devices=self.devices,
            pods=self.api,
            whole_devices=self.opts.mps_whole_devices,
        )
        if self.amd_sysfs is not None:
            self.preparer.partitions = PartitionModes(
                self.amd_sysfs,
                store=self.store,
                state_lock=self.preparer.state_lock,
                state_dir=self.opts.state_dir,
            )
        self._recover_checkpoint()
        self._reconcile_migs()
        self._resume_shares()
        self._settle_partitions()
        self.health = self.node.watch_health(
            list(self.devices.values()), fault_poll=self.intervals.fault_poll
        )
        self._make_node_slices()
        self._guard_double_booking()
        self._start_servers()
        self._start_loops()
        self.node.serve_http(registry=self.metrics.registry, check=self.check_health)

    def _recover_checkpoint(self) -> None:
        with FileLock(self.opts.state_dir / "checkpoint.lock", timeout=60):
            loaded = self.store.load_or_quarantine()
        self._report_load(loaded)
        # A lost checkpoint is rebuilt like a corrupt one: the specs still in the CDI
        # dir are claims whose devices containers may be using.
        if loaded.outcome in (LoadOutcome.QUARANTINED, LoadOutcome.MISSING):
            rebuilt = reconcile.rebuild_from_specs(self.preparer)
            if rebuilt:
                log.warning("rebuilt checkpoint entries from CDI specs", extra={"claims": rebuilt})
        for uid in loaded.discarded:  # rebooted: whatever survived is stale now
            delete_claim_spec(self.opts.cdi_root, driver=self.opts.driver_name, claim_uid=uid)
        self.metrics.prepared_claims.set_function(lambda: len(self.store.claims()))

    def _resume_shares(self) -> None:
        """MPS daemons of prepared shares run again; what no claim needs is undone."""
        assert self.preparer.effects is not None
        try:
            self.preparer.effects.resume()
        except Exception as err:  # a GPU tool failing must not keep the plugin down
            log.error("resuming GPU sharing state failed", extra={"error": str(err)})

    def _settle_partitions(self) -> None:
        """AMD GPUs no prepared claim holds go back to the mode they had before
        (a crash, or claims unprepared while the plugin was away)."""
        if self.preparer.partitions is None:
            return
        try:
            done = self.preparer.partitions.settle()
        except Exception as err:  # a refused switch must not keep the plugin down
            log.error("settling AMD partition modes failed", extra={"error": str(err)})
            return
        if done:
            self._node_event("PartitionModesRestored", "; ".join(done))

    def _reconcile_migs(self) -> None:
        """MIG instances against the checkpoint, before the sockets open (no prepare
        races it); see ``reconcile_migs``."""
        message = reconcile_migs(self.preparer, mig_mode=self.opts.mig_mode)
        if message:
            log.warning("MIG instances reconciled: %s", message)
            self._node_event("MigInstancesReconciled", message)

    def _check_readiness(self) -> None:
        """Say at start what a real GPU container would miss here (log, one Event)."""
        failed = log_readiness(readiness(self.opts, self.lib, self.edits))
        if failed:
            message = "; ".join(f"{c.name}: {c.detail}" for c in failed)
            self._node_event(NOT_READY_REASON, f"GPU containers will fail here: {message}")

    def _report_load(self, loaded: LoadResult) -> None:
        if loaded.outcome == LoadOutcome.QUARANTINED:
            message = (
                f"checkpoint unreadable ({loaded.detail}); moved to "
                f"{', '.join(str(p) for p in loaded.quarantined)}; "
                "prepared claims are being rebuilt from CDI specs"
            )
            log.error(message)
            self._node_event("CheckpointQuarantined", message)
        elif loaded.outcome == LoadOutcome.BOOT_CHANGED:
            log.info("node rebooted; prepared state discarded", extra={"detail": loaded.detail})

    def _node_event(self, reason: str, message: str, *, event_type: str = "Warning") -> None:
        # In the background: an API server that hangs must not keep the plugin from
        # serving the claims it can answer from its own state.
        def post() -> None:
            try:
                uid = self.api.get_node_uid(self.opts.node_name) or ""
                involved = {"kind": "Node", "name": self.opts.node_name, "uid": uid}
                self.api.post_event(
                    involved=involved, reason=reason, message=message, event_type=event_type
                )
            except Exception as err:  # the API may be away; the log line stays
                log.warning("could not post node event", extra={"error": str(err)})

        threading.Thread(target=post, name="node-event", daemon=True).start()

    def _start_servers(self) -> None:
        work = ClaimWork(self.preparer, self.metrics)
        streams = HealthStreams(
            self.health,
            pool=self.opts.node_name,
            stop=self.node.stop_event,
            resend=self.intervals.health_resend,
        )

        def add_dra(server: grpc.Server) -> None:
            dra_v1_grpc.add_DRAPluginServicer_to_server(DRAPluginV1(work), server)
            dra_v1beta1_grpc.add_DRAPluginServicer_to_server(DRAPluginV1beta1(work), server)
            health_v1_grpc.add_DRAResourceHealthServicer_to_server(HealthV1(streams), server)
            health_v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(
                HealthV1alpha1(streams), server
            )

        # kubelet wipes its node's slices when it starts, then registers us again.
        self.registration = Registration(
            driver_name=self.opts.driver_name,
            endpoint=str(self.dra_socket),
            on_registered=self.node_slices.poke,
        )

        def add_reg(server: grpc.Server) -> None:
            reg_grpc.add_RegistrationServicer_to_server(self.registration, server)

        # The DRA socket first: kubelet dials it as soon as registration succeeds.
        self._servers = [
            UnixSocketServer(self.dra_socket, add_dra),
            UnixSocketServer(self.reg_socket, add_reg),
        ]
        for server in self._servers:
            server.start()

    def _make_node_slices(self) -> None:
        publisher = PoolPublisher(
            self.api,
            driver=self.opts.driver_name,
            pool=self.opts.node_name,
            on_write=lambda verb, ok: self.metrics.slice_writes.labels(
                verb, "success" if ok else "error"
            ).inc(),
        )
        self.node_slices = NodeSlices(
            self.api,
            driver=self.opts.driver_name,
            node_name=self.opts.node_name,
            devices=sorted(self._published(), key=lambda d: d.name),
            counter_sets=self.node.counter_sets,
            health=self.health,
            publisher=publisher,
            resync=self.intervals.slice_resync,
        )

    def _guard_double_booking(self) -> None:
        """Withhold GPUs another device plugin advertises; the first look before the
        first publish, so that they are never offered twice even for a moment."""
        self.guard = doublebooking.DoubleBookingGuard(
            self.api,
            node_name=self.opts.node_name,
            patterns=self.opts.device_plugin_resources,
            on_change=self._device_plugin_conflict,
        )
        if not self.guard.patterns:
            return
        self.preparer.withheld = self._withheld
        try:
            self.guard.check_once()
        except Exception as err:  # the API may be away: the loop looks again
            log.warning("could not read the Node's allocatable", extra={"error": str(err)})

    def _withheld(self, name: str) -> str | None:
        found = self.guard.current
        device = self.devices.get(name)
        if not found.resources or device is None or not found.withheld(device):
            return None
        listed = ", ".join(sorted(found.resources))
        return (
            f"another device plugin on Node {self.opts.node_name} hands out the same GPUs "
            f"({listed}); see its {doublebooking.CONFLICT_REASON} Event"
        )

    def _device_plugin_conflict(self, found: doublebooking.Conflict) -> None:
        gauge = self.metrics.device_plugin_conflicts
        gauge.clear()
        for resource, count in found.resources.items():
            gauge.labels(resource).set(count)
        slices = self.node_slices
        if not found.resources:
            slices.withhold(None)
            message = (
                "no other device plugin advertises GPUs on this Node any more: drasil "
                f"publishes its {len(slices.devices)} device(s) again"
            )
            log.info(message)
            self._node_event(doublebooking.CLEARED_REASON, message, event_type="Normal")
            return
        withheld = sum(1 for d in slices.devices if found.withheld(d))
        slices.withhold(found.withheld)
        message = found.message(self.opts.node_name, withheld)
        log.warning(message)
        self._node_event(doublebooking.CONFLICT_REASON, message)

    def _published(self) -> list[Device]:
        """The devices slices offer: all but the static MIG devices that are instances
        claims prepared in dynamic MIG mode still hold (after a change to static mode).
        The Preparer keeps them, to refuse a claim allocated one, naming the holder."""
        if self.opts.mig_mode == "dynamic":
            return list(self.devices.values())
        held = held_by_dynamic_claims(self.devices.values(), self.store.claims())
        return [d for name, d in self.devices.items() if name not in held]

    def _start_loops(self) -> None:
        self.node.thread("slices", self.node_slices.run)
        self.node.thread("slice-watch", self.node_slices.watch_deletions, join=False)
        self.node.thread(
            "reconcile",
            lambda stop: reconcile.run_periodically(
                self.preparer, self.api, stop, interval=self.intervals.reconcile
            ),
        )
        self.node.thread("sockets", self._watch_sockets)
        refresher = specrefresh.SpecRefresher(self.preparer, on_change=self._driver_changed)
        self.node.thread(
            "spec-refresh", lambda stop: refresher.run(stop, interval=self.intervals.driver_files)
        )
        if self.guard.patterns:
            self.node.thread(
                "device-plugins",
                lambda stop: self.guard.run(stop, interval=self.intervals.device_plugins),
            )
        if self.opts.node_labels != "off":
            labeler = NodeLabels(
                self.api,
                node_name=self.opts.node_name,
                wanted=node_labels(
                    list(self.devices.values()),
                    mig_mode=self.opts.mig_mode,
                    gpu_sharing=self.opts.gpu_sharing,
                    gfd=self.opts.node_labels == "gfd",
                ),
                nfd_dir=self.opts.nfd_features_dir,
            )
            self.node.thread(
                "node-labels", lambda stop: labeler.run(stop, interval=self.intervals.node_labels)
            )

    def _driver_changed(self, version: str, specs: int) -> None:
        self._node_event(
            DRIVER_CHANGED_REASON,
            f"the driver's files changed (now version {version}): the CDI specs of "
            f"{specs} prepared claim(s) name the new files; running containers keep "
            "the old ones until they restart",
        )

    def _watch_sockets(self, stop: threading.Event) -> None:
        while not stop.wait(SOCKET_CHECK_INTERVAL):
            for server in self._servers:
                try:
                    server.ensure()
                except Exception as err:  # e.g. the directory vanished; try again
                    log.error("re-creating socket failed", extra={"error": str(err)})

    # ---- health and stop ---------------------------------------------------------

    def check_health(self) -> tuple[bool, str]:
        """Both sockets answer a real gRPC call."""
        try:
            with grpc.insecure_channel(f"unix://{self.reg_socket}") as channel:
                reg_grpc.RegistrationStub(channel).GetInfo(reg_pb.InfoRequest(), timeout=2)
            with grpc.insecure_channel(f"unix://{self.dra_socket}") as channel:
                grpc.channel_ready_future(channel).result(timeout=2)
        except (grpc.RpcError, grpc.FutureTimeoutError) as err:
            return False, f"plugin sockets do not answer: {err}"
        detail = "registered" if self.registration.registered.is_set() else "not yet registered"
        return True, f"ok ({detail})"

    def stop(self) -> None:
        """Stop serving; the checkpoint and the CDI specs of prepared claims stay.

        The DRA socket goes first: it refuses new calls (kubelet sends them to a newer
        instance during a rolling update's surge) and lets those in flight finish (up to
        DRAIN_GRACE); only then the registration socket, because kubelet closes its
        connection to an instance when it unregisters it, which fails every call still
        in flight (seen when the registration went first)."""
        if len(self._servers) == 2:
            dra, registration = self._servers
            self.node.stop([_Drained(dra, DRAIN_GRACE), registration])
        else:
            self.node.stop(self._servers)


@dataclass
class _Drained:
    """A gRPC server stopped after its calls in flight finish (up to `grace`)."""

    server: UnixSocketServer
    grace: float

    def stop(self) -> None:
        self.server.stop(grace=self.grace)


def reconcile_migs(preparer: Preparer, *, mig_mode: str) -> str:
    """MIG instances against the checkpoint at start; what was done, for a Node Event.

    Dynamic mode: instances no claim holds are destroyed, lost ones re-prepared, and
    those of claims prepared in static mode (before a ``migMode`` change) are kept,
    their records completed first where an earlier drasil wrote none. Static mode never
    touches MIG instances (they are the operator's); instances claims cut in dynamic
    mode stay until those claims' unprepare destroys them, and are only named here.
    """
    migs = preparer.migs
    if migs is None:
        return ""
    if mig_mode != "dynamic":
        with preparer.state_lock():
            return _cut_in_dynamic_mode(preparer.store.claims())
    gpus = [d for d in preparer.devices.values() if d.mig_placement is not None]
    store = preparer.store
    with preparer.state_lock():
        for uid, devices in migs.static_records(store.claims()).items():
            store.replace_devices(uid, devices)
        report = migs.reconcile(gpus, store.claims())
        for uid in report.missing:  # prepared again, instance and CDI spec, on the next call
            record = store.get(uid)
            if record is not None:
                store.mark_started(
                    uid, namespace=record.namespace, name=record.name, devices=record.devices
                )
    return report.message


def _cut_in_dynamic_mode(records: Mapping[str, ClaimRecord]) -> str:
    held = [
        f"{r.namespace}/{r.name}: {d.mig.profile} at {d.mig.placement_start} on {d.mig.parent_uuid}"
        for r in records.values()
        for d in r.devices
        if d.mig is not None
    ]
    if not held:
        return ""
    return (
        f"{len(held)} MIG instance(s) cut in dynamic MIG mode are held by claims prepared "
        "then; they are not offered again and are destroyed when those claims are "
        "unprepared: " + "; ".join(held)
    )


def mps_program(opts: PluginOptions) -> DaemonProgram:
    """The MPS control program of the plugin's backend: the stand-in, or the driver's
    ``nvidia-cuda-mps-control`` run chrooted into the driver root (by its path there)."""
    root = DriverRoot(host=opts.driver_root_host, local=opts.driver_root_local)
    control = find_binary(root, CONTROL_PROGRAM) if opts.backend == "nvml" else None
    return DaemonProgram.for_backend(
        opts.backend,
        control=control,
        driver_root=opts.driver_root_local,
        multiuser=opts.mps_multiuser,
    )


def mps_launcher(opts: PluginOptions, api: KubeApi) -> DaemonLauncher:
    """Daemons in Pods of their own where an image for them is given (the chart), so
    they outlive the plugin's Pod; else processes of the plugin's host."""
    if opts.mps_daemon_image is None or opts.pod_namespace is None:
        return ProcessLauncher()
    pods = DaemonPods(
        namespace=opts.pod_namespace,
        node=opts.node_name,
        driver=opts.driver_name,
        image=opts.mps_daemon_image,
        state_dir=opts.state_dir,
        driver_root_host=opts.driver_root_host,
        driver_root_local=opts.driver_root_local,
        overrides=opts.mps_daemon_pod,
    )
    return PodLauncher(KubePods(api), pods)

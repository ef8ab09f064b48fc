"""DRA mode assembled: checkpoint recovery, the DRA and registration sockets, loops.

Discovery, health, HTTP and threads come from ``kubeletplugin.node``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc

from drasil.api.kubelet.dra.v1 import dra_pb2_grpc as dra_v1_grpc
from drasil.api.kubelet.dra.v1beta1 import dra_pb2_grpc as dra_v1beta1_grpc
from drasil.api.kubelet.health.v1 import health_pb2_grpc as health_v1_grpc
from drasil.api.kubelet.health.v1alpha1 import health_pb2_grpc as health_v1alpha1_grpc
from drasil.api.kubelet.pluginregistration import registration_pb2 as reg_pb
from drasil.api.kubelet.pluginregistration import registration_pb2_grpc as reg_grpc
from drasil.driver.cdi.claimspecs import delete_claim_spec
from drasil.driver.checkpoint import CHECKPOINT_DIR, CheckpointStore
from drasil.driver.checkpointdisk import LoadOutcome, LoadResult
from drasil.driver.devices import Device, Vendor, VendorError
from drasil.driver.files import FileLock
from drasil.driver.hostresources import with_host_resources
from drasil.driver.kubeapi import KubeApi
from drasil.driver.migrecords import held_by_dynamic_claims
from drasil.driver.slices.publisher import PoolPublisher
from drasil.driver.vfio.devices import VfioRequest
from drasil.kubeletplugin.dra import doublebooking, reconcile, specrefresh
from drasil.kubeletplugin.dra.healthservice import HealthStreams, HealthV1, HealthV1alpha1
from drasil.kubeletplugin.dra.nodelabels import NodeLabels
from drasil.kubeletplugin.dra.nodeslices import NodeSlices
from drasil.kubeletplugin.dra.prepare import Preparer, StateLock
from drasil.kubeletplugin.dra.registration import Registration
from drasil.kubeletplugin.dra.service import ClaimWork, DRAPluginV1, DRAPluginV1beta1
from drasil.kubeletplugin.metrics import PluginMetrics
from drasil.kubeletplugin.node import NodeRuntime
from drasil.kubeletplugin.options import PluginOptions
from drasil.kubeletplugin.sockets import UnixSocketServer, pod_tag
from drasil.kubeletplugin.vendors.seam import (
    NodeState,
    NodeVendor,
    PassthroughBinder,
    PrepareSteps,
)

log = logging.getLogger(__name__)

_T = TypeVar("_T")

DRIVER_CHANGED_REASON = "DriverFilesChanged"
NOT_READY_REASON = "GPUDriverNotReady"
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
    api: KubeApi
    # The node's vendors (kubeletplugin.vendors.registry.open_vendors).
    vendors: tuple[NodeVendor, ...]
    metrics: PluginMetrics = field(default_factory=PluginMetrics)
    intervals: Intervals = field(default_factory=Intervals)

    def __post_init__(self) -> None:
        self.node = NodeRuntime(self.opts, vendors=self.vendors, devices_gauge=self.metrics.devices)
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
        self._check_readiness()
        self.opts.state_dir.mkdir(parents=True, exist_ok=True)
        self.opts.cdi_root.mkdir(parents=True, exist_ok=True)
        self.store = CheckpointStore(self.opts.state_dir / CHECKPOINT_DIR)
        self.guard = doublebooking.DoubleBookingGuard(
            self.api,
            node_name=self.opts.node_name,
            patterns=self.opts.device_plugin_resources,
            on_change=self._device_plugin_conflict,
        )
        self.preparer = self._make_preparer()
        self._recover_checkpoint()
        if self.steps.recover is not None:
            self.steps.recover()
        self.health = self.node.watch_health(
            list(self.devices.values()), fault_poll=self.intervals.fault_poll
        )
        self._make_node_slices()
        self._guard_double_booking()
        self._start_servers()
        self._start_loops()
        self.node.serve_http(registry=self.metrics.registry, check=self.check_health)

    def _make_preparer(self) -> Preparer:
        """The Preparer, whole: the checkpoint's one lock, the vendors' steps built
        on it, the node's spec-wide edits, and why a device may be withheld."""
        lock = StateLock(self.store, self.opts.state_dir)
        state = NodeState(
            store=self.store,
            state_lock=lock,
            devices=self.devices,
            api=self.api,
            node_event=self._node_event,
        )
        self.steps = merged_steps(
            [v.prepare_steps(state) for v in self.vendors], vendors=[v.vendor for v in self.vendors]
        )
        edits = self.node.common_edits()
        return Preparer(
            driver=self.opts.driver_name,
            pool=self.opts.node_name,
            devices=self.devices,
            claims=self.api,
            store=self.store,
            cdi_root=self.opts.cdi_root,
            state_dir=self.opts.state_dir,
            node_edits=edits[1] if edits is not None else None,
            edits_vendor=edits[0] if edits is not None else None,
            migs=self.steps.instances,
            effects=self.steps.sharing,
            partitions=self.steps.modes,
            passthrough=self.steps.passthrough,
            withheld=self._withheld if self.guard.patterns else None,
            pools=self.api,
            lock=lock,
        )

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

    def _check_readiness(self) -> None:
        """Say at start what a real GPU container would miss here (log, one Event)."""
        failed = self.node.readiness()
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
        if not self.guard.patterns:
            return
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
        self._start_labeler()

    def _start_labeler(self) -> None:
        """The vendors' Node labels kept on the Node (or in NFD's feature file)."""
        devices = list(self.devices.values())
        found = [s for v in self.vendors if (s := v.node_labels(devices)) is not None]
        if self.opts.node_labels == "off" or not found:
            return
        labeler = NodeLabels(
            self.api,
            node_name=self.opts.node_name,
            wanted={k: v for s in found for k, v in s.wanted.items()},
            owned=lambda key: any(s.owned.match(key) for s in found),
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


def merged_steps(
    steps: Sequence[PrepareSteps], *, vendors: Sequence[Vendor | None] = ()
) -> PrepareSteps:
    """The vendors' steps as one: each kind from the one vendor that has it (two
    vendors cutting instances, say, is refused: ``VendorError``), the repairs run in
    the vendors' order. Passthrough is the one kind several vendors may have: each
    binds its own devices (``vendors``: whose each of ``steps`` is)."""
    repairs = [s.recover for s in steps if s.recover is not None]

    def recover() -> None:
        for repair in repairs:
            repair()

    return PrepareSteps(
        instances=_only([s.instances for s in steps], "instances"),
        modes=_only([s.modes for s in steps], "modes"),
        sharing=_only([s.sharing for s in steps], "sharing"),
        passthrough=_passthrough(
            [
                (vendor, s.passthrough)
                for vendor, s in zip(vendors or [None] * len(steps), steps, strict=True)
                if s.passthrough is not None
            ]
        ),
        recover=recover if repairs else None,
    )


class _EachPassthrough:
    """The vendors' passthrough steps as one: each binds the devices it published (a
    passthrough device is found by its vendor's own type), and every one settles."""

    def __init__(self, steps: Sequence[tuple[Vendor | None, PassthroughBinder]]) -> None:
        self.steps = steps

    def bind(self, requests: Sequence[VfioRequest]) -> dict[str, Device]:
        out: dict[str, Device] = {}
        for vendor, step in self.steps:
            mine = [r for r in requests if r.device.vendor is vendor]
            if mine:
                out.update(step.bind(mine))
        return out

    def settle(self) -> list[str]:
        return [done for _, step in self.steps for done in step.settle()]


def _passthrough(
    steps: Sequence[tuple[Vendor | None, PassthroughBinder]],
) -> PassthroughBinder | None:
    if len(steps) <= 1:
        return steps[0][1] if steps else None
    if any(vendor is None for vendor, _ in steps):
        raise VendorError("two vendors pass GPUs through here, and merged_steps was not told whose")
    return _EachPassthrough(steps)


def _only(found: Sequence[_T | None], kind: str) -> _T | None:
    given = [f for f in found if f is not None]
    if len(given) > 1:
        raise VendorError(
            f"two vendors on this node have prepare steps of kind {kind}; serve them on "
            "different nodes (--vendors)"
        )
    return given[0] if given else None

"""Disruptions under load on the real node: Pods keep coming and going (e2e.harness.churn)
while kubelet restarts, the plugin is killed again and again, the API server restarts,
the NVIDIA driver is upgraded under the node and the node reboots, one after the other
in one churn (one warm-up, one ledger).

The node's plugin runs for this module with four H100s and four L4s in dynamic MIG with
consumable sharing and a fake driver root with the real `nvidia-cdi-hook` (put back
afterwards, its simulated GPUs reset), so the churn has all four kinds of claim: whole
GPUs, MIG placements cut on demand on the H100s, MPS shares of the L4s, a claim of two
Pods; every Pod is of the probe image and loads the driver's libraries. The test ends
with the ledger asserted (`Ledger.problems`: no Pod that did not start, no container
that saw other devices than its claim's or could not load the driver, no device held
by two claims, and nothing left on the node once the churn's claims are gone); each
disruption's own expected end state is written in its function's docstring first and
asserted where it ends.

`DRASIL_CHURN_SECONDS` (default 5) is how long the load runs after each disruption;
`make bench-churn` runs the same at length (bench/churn.py).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.harness.churn import (
    CHURN_PROFILE,
    Churn,
    Kind,
    Target,
    churning,
    claim_manifest,
    loaded_driver,
    pod_manifest,
    printed_env,
    standard_kinds,
)
from e2e.harness.cluster.control_plane import Cluster
from e2e.harness.cluster.node import Node
from e2e.harness.driverroot import FakeRoot, build_fake_root, upgrade_fake_root
from e2e.harness.kube import RESOURCE, Kube, NotYet, wait_for
from e2e.harness.nvidiatoolkit import cdi_hook_path
from e2e.harness.pluginproc import DRIVER, checkpoint_claims, checkpoint_gpus
from e2e.harness.pods import node_events, visible_uuids

GPUS = 8
CHURN_DEVICES = 4 * 26 + 4  # each H100 whole and its 25 MIG placements; the L4s whole
MIG_CLASS = f"mig-churn-e2e.{DRIVER}"
SHARED_CLASS = f"shared-churn-e2e.{DRIVER}"
SECONDS = float(os.environ.get("DRASIL_CHURN_SECONDS", "5"))
NEWER = "590.44.01"  # the driver version the upgrade installs
ATTRS = f'device.attributes["{DRIVER}"]'


def _class(name: str, extra: str) -> dict[str, Any]:
    expression = f'device.driver == "{DRIVER}" && {extra}'
    return {
        "apiVersion": RESOURCE,
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


@pytest.fixture(scope="module")
def driver_root(node: Node) -> Iterator[FakeRoot]:
    """A fake Debian driver root on the node (what the upgrade replaces)."""
    where = node.run_dir / "churn-driver-root"
    shutil.rmtree(where, ignore_errors=True)
    yield build_fake_root(where, layout="debian")
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="module")
def kinds(
    node: Node, kube: Kube, gpu_class: str, driver_root: FakeRoot
) -> Iterator[dict[str, Kind]]:
    classes = [
        _class(MIG_CLASS, f'{ATTRS}.type == "mig"'),
        _class(SHARED_CLASS, f'{ATTRS}.type == "gpu" && device.allowMultipleAllocations'),
    ]
    for c in classes:
        kube.delete(RESOURCE, "DeviceClass", c["metadata"]["name"])
        kube.create(c)
    profile = node.plugin.profile
    node.plugin.profile = CHURN_PROFILE
    env = {
        "MIG_MODE": "dynamic",
        "GPU_SHARING": "consumable",
        "NVIDIA_DRIVER_ROOT": str(driver_root.root),
        "NVIDIA_CDI_HOOK_PATH": str(cdi_hook_path()),
    }
    node.restart_plugin_with(env, published=CHURN_DEVICES, reset_gpus=True)
    yield standard_kinds(gpu_class=gpu_class, mig_class=MIG_CLASS, shared_class=SHARED_CLASS)
    node.plugin.profile = profile
    off = dict.fromkeys(env)
    node.restart_plugin_with(off, published=GPUS, reset_gpus=True)
    for c in classes:
        kube.delete(RESOURCE, "DeviceClass", c["metadata"]["name"])


@pytest.fixture
def churn(kubeconfig: Path, node: Node, ns: str, kinds: dict[str, Kind]) -> Churn:
    return Churn(kubeconfig, Target.of(node), ns, kinds.values(), probe=True)


class Witness:
    """A Pod that holds its claim through a disruption: what must happen to it."""

    def __init__(self, kube: Kube, node: Node, ns: str, kind: Kind) -> None:
        self.kube, self.node, self.ns = kube, node, ns
        self.claim = f"witness-{kind.name}"
        self.pod = f"witness-{kind.name}-pod"
        kube.create(claim_manifest(self.claim, kind), ns)
        kube.create(pod_manifest(self.pod, self.claim, node.name, probe=True), ns)
        self.container = self.running()

    def running(self, *, restarted_from: str | None = None) -> str:
        """Wait until its container runs (a new one, if `restarted_from` names the
        one before); that container's id."""

        def up() -> Any:
            pod = self.kube.get("v1", "Pod", self.pod, self.ns)
            statuses = pod["status"].get("containerStatuses") or []
            ready = statuses and statuses[0].get("ready") and statuses[0].get("containerID")
            if ready and statuses[0]["containerID"] != restarted_from:
                return statuses[0]["containerID"]
            return NotYet(pod["status"])

        found: str = wait_for(up, timeout=180, what=f"Pod {self.pod} running")
        return found

    def unchanged(self) -> None:
        """Still the same container, never restarted."""
        pod = self.kube.get("v1", "Pod", self.pod, self.ns)
        (status,) = pod["status"]["containerStatuses"]
        assert (status["containerID"], status["restartCount"]) == (self.container, 0), status

    @property
    def uid(self) -> str:
        return str(self.kube.get(RESOURCE, "ResourceClaim", self.claim, self.ns)["metadata"]["uid"])

    def record(self) -> dict[str, Any]:
        record: dict[str, Any] = checkpoint_claims(self.node.plugin.state_dir)[self.uid]
        return record

    def seen(self) -> list[str]:
        return visible_uuids(printed_env(self.kube, self.ns, self.pod))


def _assert_clean(churn: Churn, request: pytest.FixtureRequest) -> None:
    """The ledger has no problem; kept for bench/churn.py first."""
    churn.ledger.keep(request.node.name, seconds=SECONDS)
    churn.ledger.assert_clean()


def test_churn_through_every_disruption(
    kube: Kube,
    node: Node,
    node_cluster: Cluster,
    ns: str,
    churn: Churn,
    kinds: dict[str, Kind],
    driver_root: FakeRoot,
    request: pytest.FixtureRequest,
) -> None:
    """One churn, five disruptions in turn (each function below says what it must
    leave), three Pods that hold their claims throughout; then the ledger."""
    witnesses = {k: Witness(kube, node, ns, kinds[k]) for k in ("gpu", "mig", "share")}
    old_daemons = _mps_pids(node)
    assert old_daemons, "the share has an MPS daemon"
    with churning(churn):
        churn.wait_started(4)
        _kubelet_restarted(node, churn, witnesses)
        _plugin_killed_every_few_seconds(node, churn, witnesses)
        _api_server_restarted(kube, node, node_cluster, churn, witnesses)
        _driver_upgraded(node, churn, driver_root, witnesses["gpu"])
        _node_rebooted(node, churn, witnesses)
    _assert_clean(churn, request)
    _rebooted_from_scratch(node, witnesses, old_daemons)


def _settle(churn: Churn, phase: str) -> None:
    """Every Pod created during the disruption started, the load runs again (4 more
    Pods started), then `SECONDS` more of it."""
    churn.phase(phase)
    churn.wait_caught_up()
    churn.wait_started(4)
    time.sleep(SECONDS)


def _kubelet_restarted(node: Node, churn: Churn, witnesses: dict[str, Witness]) -> None:
    """Expected: kubelet registers the plugin again; a running Pod keeps its container
    (no restart); Pods whose prepare was in flight start once kubelet is back (kubelet
    asks again); the churn goes on."""
    churn.phase("kubelet restart")
    node.restart_kubelet()
    _settle(churn, "after the kubelet restart")
    for witness in witnesses.values():
        witness.unchanged()


def _plugin_killed_every_few_seconds(
    node: Node, churn: Churn, witnesses: dict[str, Witness]
) -> None:
    """Expected: while the plugin is killed (SIGKILL) every 5 s, prepares fail and
    kubelet retries them; a running Pod keeps its container; once the plugin stays up,
    every waiting Pod starts, each with exactly its devices; no device is held twice
    (each restart finishes what the killed one began)."""
    churn.phase("plugin SIGKILL every 5 s")
    deadline = time.monotonic() + max(SECONDS, 15.0)
    while time.monotonic() < deadline:
        node.restart_plugin(kill=True)
        time.sleep(5.0)
    _settle(churn, "after the kills")
    for witness in witnesses.values():
        witness.unchanged()
    mig = witnesses["mig"]
    assert mig.seen() == [mig.record()["devices"][0]["mig"]["uuid"]]


def _slice_versions(kube: Kube, node: Node) -> dict[str, str]:
    slices = kube.resource(RESOURCE, "ResourceSlice").get(
        field_selector=f"spec.nodeName={node.name},spec.driver={DRIVER}", _request_timeout=30
    )
    return {s.metadata.name: s.metadata.resourceVersion for s in slices.items}


def _api_server_restarted(
    kube: Kube, node: Node, cluster: Cluster, churn: Churn, witnesses: dict[str, Witness]
) -> None:
    """Expected: while kube-apiserver is down (5 s) and after, running Pods keep
    running; the plugin's and kubelet's watches re-list and the churn goes on. The
    restart rewrites none of the node's ResourceSlices (same resourceVersion: the
    plugin publishes only what changed, and in dynamic MIG mode claims change none)."""
    before = _slice_versions(kube, node)
    churn.phase("API server restart")
    cluster.restart_apiserver(down_seconds=5)
    _settle(churn, "after the API server restart")
    for witness in witnesses.values():
        witness.unchanged()
    assert _slice_versions(kube, node) == before


def _driver_upgraded(node: Node, churn: Churn, root: FakeRoot, witness: Witness) -> None:
    """Expected: the driver's files replaced under the running node (the old version's
    go before the new one's come, so a prepare in between fails and kubelet retries
    it): within seconds the specs of prepared claims name the new files and a Node
    Event `DriverFilesChanged` names the new version; a running container keeps the
    old ones; the witness's container, killed, is started again
    from its rewritten spec and loads the new driver (without the rewrite its mounts
    would name files that are gone); every Pod created after the upgrade loads the new
    driver."""
    before = root.version
    churn.phase("driver upgrade")
    upgrade_fake_root(root, NEWER)
    churn.phase("after the driver upgrade")
    spec = node.cdi_dir / f"k8s.{DRIVER}-claim_{witness.uid}.json"
    wait_for(
        lambda: NEWER in spec.read_text() or NotYet(spec.read_text()[:300]),
        timeout=60,
        what="the witness's spec to name the new driver's files",
    )
    assert loaded_driver(printed_env_of(witness)) == before
    node_events(witness.kube, node.name, "DriverFilesChanged", containing=NEWER)
    node.ctr("task", "kill", "-s", "SIGKILL", witness.container.split("://")[-1])
    witness.container = witness.running(restarted_from=witness.container)
    assert loaded_driver(printed_env_of(witness)) == NEWER
    _settle(churn, "after the driver upgrade")
    loaded = churn.ledger.driver_versions.get("after the driver upgrade", {})
    assert set(loaded) == {NEWER}, churn.ledger.driver_versions


def printed_env_of(witness: Witness) -> str:
    return printed_env(witness.kube, witness.ns, witness.pod).get("DRASIL_PROBE", "")


def _node_rebooted(node: Node, churn: Churn, witnesses: dict[str, Witness]) -> None:
    """Expected: after a power cut and a boot (tmpfs gone, MIG instances and MPS
    daemons gone, a new boot id), kubelet starts the Pods still bound to the node
    again and asks the plugin to prepare their claims; the plugin trusts nothing of the
    old boot: each claim is prepared from scratch (checkpoint entries of the new boot,
    CDI specs written again, the MIG placement cut again, the MPS daemon started
    again), and each new container sees exactly its claim's devices (asserted after the
    churn, in `_rebooted_from_scratch`)."""
    churn.phase("node reboot")
    node.reboot()
    for witness in witnesses.values():
        witness.container = witness.running(restarted_from=witness.container)
    _settle(churn, "after the reboot")


def _rebooted_from_scratch(
    node: Node, witnesses: dict[str, Witness], old_daemons: list[int]
) -> None:
    mig = witnesses["mig"]
    assert mig.seen() == [mig.record()["devices"][0]["mig"]["uuid"]]
    instances = _simulated_instances(node)  # the churn's are gone: the witness's alone
    assert [gi["start"] for gi in instances] == [
        mig.record()["devices"][0]["mig"]["placementStart"]
    ]
    new_daemons = _mps_pids(node)
    assert new_daemons, "the share's MPS daemon started again"
    assert not set(new_daemons) & set(old_daemons), (old_daemons, new_daemons)
    for witness in witnesses.values():
        assert (node.cdi_dir / f"k8s.{DRIVER}-claim_{witness.uid}.json").exists()


def _mps_pids(node: Node) -> list[int]:
    gpus = checkpoint_gpus(node.plugin.state_dir)
    return [g["mps"]["pid"] for g in gpus.values() if g.get("mps")]


def _simulated_instances(node: Node) -> list[dict[str, Any]]:
    state = json.loads((node.plugin.state_dir / "simulated-gpus.json").read_text())
    assert state["bootId"] == node.boot_id_file.read_text().strip(), state["bootId"]
    return [gi for gpu in state["gpus"].values() for gi in gpu.get("gpuInstances") or []]

"""Upgrade and rollback from a pinned earlier release, with claims prepared across both.

The release is the commit in e2e/upgrade-from.txt: its source tree is exported from this
checkout's history (e2e.harness.sources), its image built from that tree's Dockerfile and
its chart installed on the real node. Expected end states, step by step:

1. the earlier release installed: a workload Pod gets a GPU (the earlier plugin wrote
   its checkpoint entry, CDI spec and metadata files);
2. `helm upgrade` to this checkout's chart and image: the DaemonSet rolls; the workload
   keeps running untouched; the new plugin reads the earlier checkpoint, so a second Pod
   gets the *other* GPU (the first is still held, not double-booked);
3. `helm rollback` to the earlier release: the DaemonSet rolls back; both Pods keep
   running; the earlier plugin reads the new plugin's state: deleting the second Pod
   unprepares its claim (its CDI spec goes), and a third Pod gets the freed GPU;
4. all workloads deleted: no CDI spec and no checkpoint entry of the driver is left.

From step 1 to 3 a churn (e2e.harness.churn) runs in a namespace of its own: Pods with
whole GPUs, dynamic MIG placements, MPS shares and a claim of two Pods come and go
through the upgrade's and the rollback's plugin handover. Its ledger must be clean: every
Pod started, each saw exactly its devices, no device held twice, nothing left on the node
once its claims are gone; the longest wait of a Pod created during each handover is in
the ledger.

The chart runs as its defaults have it: its daemons on the Pod network (they reach the
API server through e2e.harness.apirelay), per-Pod socket names, so each handover is the
DaemonSet's surge: the new plugin Pod is Ready beside the old one (a watch of the Pods
sees two Ready at once), both registered with kubelet for a moment, and kubelet always
has a plugin to call (no prepare in the churn is refused for want of one).

The chart installs its own driver (gpu.upgrade.drasil.dev) beside the node's, as
e2e/test_install.py does, on GPUs of its own: four H100s and six L4s in dynamic MIG
with consumable sharing; the churn uses minors 0-7 (e2e.harness.churn.CHURN_PROFILE),
the workloads above the L4s 8 and 9.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
import yaml
from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from e2e.harness import paths
from e2e.harness.apirelay import ApiRelay, api_relay
from e2e.harness.chart import CHART, LocalNode, helm, local_node_values
from e2e.harness.churn import CHURN_PROFILE, Churn, Kind, Target, churning, standard_kinds
from e2e.harness.cluster.host import free_ports
from e2e.harness.cluster.node import Node
from e2e.harness.kube import Kube, NotYet, wait_for
from e2e.harness.sources import exported
from e2e.test_install import (
    TIMEOUT,
    _delete_pod,
    _device_class,
    _helm,
    _plugin_pods,
    _pod,
    _ready,
    _running_with_gpu,
    _workload,
)
from tools.image import LocalImage, build_image, import_image

DRIVER = "gpu.upgrade.drasil.dev"
CLASS = "upgrade.drasil.dev"
PROFILE = f"{CHURN_PROFILE},l4:2"  # minors 8 and 9 are the workloads'
CHURN_CLASSES = {
    "gpu": ("gpu-churn.upgrade.drasil.dev", 'type == "gpu"'),
    "mig": ("mig-churn.upgrade.drasil.dev", 'type == "mig"'),
    "share": (
        "shared-churn.upgrade.drasil.dev",
        'type == "gpu" && device.allowMultipleAllocations',
    ),
}
PINNED = paths.CHECKOUT / "e2e" / "upgrade-from.txt"
PLUGIN_COMPONENT = "app.kubernetes.io/component=kubelet-plugin"


def pinned_commit() -> str:
    """The commit e2e/upgrade-from.txt names (its one line that is not a comment)."""
    lines = [ln.strip() for ln in PINNED.read_text().splitlines()]
    (commit,) = [ln for ln in lines if ln and not ln.startswith("#")]
    return commit


@pytest.fixture(scope="module")
def earlier(node: Node) -> tuple[Path, LocalImage]:
    """The pinned release: its source tree and its image, imported into the node."""
    commit = pinned_commit()
    tree = exported(commit)
    image = build_image(root=tree, rev=commit)
    import_image(image, ctr=node.bin("ctr"), address=node.containerd_socket)
    return tree, image


@pytest.fixture(scope="module")
def current(node: Node) -> LocalImage:
    image = build_image()
    import_image(image, ctr=node.bin("ctr"), address=node.containerd_socket)
    return image


@pytest.fixture
def device_class(kube: Kube) -> Iterator[str]:
    attrs = f'device.attributes["{DRIVER}"]'
    selector = f'device.driver == "{DRIVER}" && {attrs}.type == "gpu" && {attrs}.minor >= 8'
    yield from _device_class(kube, CLASS, selector)


@pytest.fixture
def churn_kinds(kube: Kube) -> Iterator[dict[str, Kind]]:
    """The churn's DeviceClasses for this driver."""
    with contextlib.ExitStack() as made:
        for name, condition in CHURN_CLASSES.values():
            attrs = f'device.attributes["{DRIVER}"]'
            expression = f'device.driver == "{DRIVER}" && {attrs}.{condition}'
            made.enter_context(contextlib.contextmanager(_device_class)(kube, name, expression))
        yield standard_kinds(
            gpu_class=CHURN_CLASSES["gpu"][0],
            mig_class=CHURN_CLASSES["mig"][0],
            shared_class=CHURN_CLASSES["share"][0],
            driver=DRIVER,
        )


@pytest.fixture
def churn_namespace(kube: Kube) -> Iterator[str]:
    name = f"churn-{secrets.token_hex(3)}"
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    wait_for(
        lambda: kube.core.read_namespaced_service_account("default", name),
        timeout=30,
        what=f"ServiceAccount default in namespace {name}",
    )
    yield name
    kube.delete("v1", "Namespace", name)


@pytest.fixture(scope="module")
def relay(node: Node, kubeconfig: Path) -> Iterator[ApiRelay]:
    """The API server on the node IP, for the chart's daemons on the Pod network."""
    server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    with api_relay(node.config.node_ip, int(server.rsplit(":", 1)[1])) as r:
        yield r


def _values_file(
    node: Node, image: LocalImage, kubeconfig: Path, folder: Path, relay: ApiRelay
) -> Path:
    here = LocalNode(node.name, node.registrar_dir, node.plugins_dir, node.cdi_dir)
    values = local_node_values(
        here, kubeconfig=kubeconfig, repository=image.repository, tag=image.tag,
        ports=free_ports(4), relay=(relay.listen_host, relay.port),
    )  # fmt: skip
    values.update(
        driverName=DRIVER,
        simulatedProfile=PROFILE,
        logFormat="text",
        migMode="dynamic",
        gpuSharing="consumable",
    )
    values["deviceClasses"] = {"create": False}
    values["controller"]["enabled"] = False  # the node side is what carries state
    path = folder / f"values-{image.tag}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _rolled_to(kube: Kube, namespace: str, release: str, image: LocalImage) -> Any:
    """Wait until the release's one plugin Pod runs ``image`` and is ready."""

    def rolled() -> Any:
        pods = _plugin_pods(kube, namespace, release)
        images = [p.spec.containers[0].image for p in pods]
        ok = len(pods) == 1 and images == [image.name] and _ready(pods[0])
        return pods[0] if ok else NotYet([(p.metadata.name, p.status.phase) for p in pods])

    return wait_for(rolled, timeout=TIMEOUT, what=f"the plugin to run {image.name}")


class _ReadyPlugins:
    """The most plugin Pods of a release Ready at once while the `with` block runs, from
    a watch of them: a surge shows 2 (the new Pod Ready before the old one goes)."""

    def __init__(self, kube: Kube, namespace: str, release: str) -> None:
        self.kube, self.namespace = kube, namespace
        self.selector = f"app.kubernetes.io/instance={release},{PLUGIN_COMPONENT}"
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ready-plugins", daemon=True)

    def __enter__(self) -> _ReadyPlugins:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _watch(self) -> None:
        while not self._stop.is_set():
            ready: dict[str, bool] = {}  # a new watch lists every Pod again
            try:
                stream = watch.Watch().stream(  # type: ignore[no-untyped-call]
                    self.kube.core.list_namespaced_pod, self.namespace,
                    label_selector=self.selector, timeout_seconds=5, _request_timeout=30,
                )  # fmt: skip
                for event in stream:
                    pod = event["object"]
                    if event["type"] == "DELETED":
                        ready.pop(pod.metadata.name, None)
                    else:
                        ready[pod.metadata.name] = _ready(pod)
                    self.most = max(self.most, sum(ready.values()))
                    if self._stop.is_set():
                        return
            except (ApiException, urllib3.exceptions.HTTPError):
                time.sleep(1)


def _specs(node: Node, namespace: str) -> list[str]:
    """The driver's CDI spec files on the node for claims of `namespace`."""
    return sorted(
        p.name
        for p in node.cdi_dir.glob(f"k8s.{DRIVER}-claim_*.json")
        if json.loads(p.read_text())["annotations"]["drasil.dev/claim-namespace"] == namespace
    )


def _claim_entries(node: Node) -> list[str]:
    folder = node.plugins_dir / DRIVER / "checkpoint" / "claims"
    return sorted(p.name for p in folder.glob("*.json")) if folder.exists() else []


def _unchanged(kube: Kube, namespace: str, name: str, uid: str) -> None:
    pod = _pod(kube, namespace, name)
    assert pod.metadata.uid == uid
    assert pod.status.phase == "Running"
    assert pod.status.container_statuses[0].restart_count == 0


def test_upgrade_from_the_pinned_release_and_roll_back_keeps_every_claim(
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    node: Node,
    earlier: tuple[Path, LocalImage],
    current: LocalImage,
    device_class: str,
    churn_kinds: dict[str, Kind],
    churn_namespace: str,
    relay: ApiRelay,
    tmp_path: Path,
) -> None:
    tree, old_image = earlier
    assert old_image.name != current.name
    release = f"upg{secrets.token_hex(2)}"
    common = [f"--namespace={namespace}", f"--timeout={TIMEOUT}s", "--wait"]
    old_values = _values_file(node, old_image, kubeconfig, tmp_path, relay)
    new_values = _values_file(node, current, kubeconfig, tmp_path, relay)
    old_chart = tree / "charts" / "drasil"
    churn = Churn(kubeconfig, Target.of(node, DRIVER), churn_namespace, churn_kinds.values())
    try:
        # 1. The earlier release; a workload prepared by its plugin.
        _helm(kubeconfig, "install", release, str(old_chart), "-f", str(old_values), *common)
        _rolled_to(kube, namespace, release, old_image)
        first = _workload(kube, namespace, node, device_class)
        first_gpu = _running_with_gpu(kube, namespace, first)
        first_uid = _pod(kube, namespace, first).metadata.uid
        assert len(_specs(node, namespace)) == 1, _specs(node, namespace)
        with churning(churn):
            churn.wait_started(4)

            # 2. Upgraded: the first claim stays prepared and held.
            churn.phase("helm upgrade")
            with _ReadyPlugins(kube, namespace, release) as plugins:
                _helm(kubeconfig, "upgrade", release, str(CHART), "-f", str(new_values), *common)
                _rolled_to(kube, namespace, release, current)
            assert plugins.most == 2, "the new plugin Pod was not Ready beside the old one"
            _unchanged(kube, namespace, first, first_uid)
            second = _workload(kube, namespace, node, device_class)
            second_gpu = _running_with_gpu(kube, namespace, second)
            assert second_gpu != first_gpu  # two GPUs; the first is still the first Pod's
            assert len(_specs(node, namespace)) == 2, _specs(node, namespace)
            churn.phase("upgraded")
            churn.wait_started(4)

            # 3. Rolled back: the earlier plugin reads the new one's state.
            churn.phase("helm rollback")
            with _ReadyPlugins(kube, namespace, release) as plugins:
                _helm(kubeconfig, "rollback", release, "1", *common)
                _rolled_to(kube, namespace, release, old_image)
            assert plugins.most == 2, "the earlier plugin Pod was not Ready beside the new one"
            _unchanged(kube, namespace, first, first_uid)
            _delete_pod(kube, namespace, second)
            assert len(_specs(node, namespace)) == 1, _specs(node, namespace)
            third = _workload(kube, namespace, node, device_class)
            assert _running_with_gpu(kube, namespace, third) == second_gpu
            churn.phase("rolled back")
            churn.wait_started(4)
        churn.ledger.keep("test_upgrade_and_rollback", api_relay_connections=relay.connections)
        churn.ledger.assert_clean()
        # Both handovers surged: kubelet always had a plugin to call.
        assert not churn.ledger.unserved_by_phase, churn.ledger.summary()

        # 4. Nothing left once the workloads are gone.
        for name in (first, third):
            _delete_pod(kube, namespace, name)
        assert _specs(node, namespace) == []
        assert _claim_entries(node) == []
    finally:  # never masks the failure that got here: check=False
        helm(
            f"--kubeconfig={kubeconfig}", "uninstall", release, f"--namespace={namespace}",
            "--wait", check=False, timeout=TIMEOUT + 60,
        )  # fmt: skip

"""MPS daemons in Pods of their own (the chart's launcher): the Pod's manifest, and
``MpsDaemons`` driving ``PodLauncher`` against an in-memory Pod API whose "kubelet"
runs each Pod's command as a real process here, so the simulated backend's stand-in
really starts, answers, keeps a client across a plugin restart and quits.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubelet_client import FileClaims, claim_json, ref_of, result
from test_mps_locks import held_elsewhere, preparer

from drasil.driver.files import CRASH_ENV
from drasil.driver.kubeapi import ApiError
from drasil.driver.simulated import mpsstandin
from drasil.kubeletplugin.options import OptionsError, parse_options
from drasil.kubeletplugin.vendors.nvidia.mps import daemons as daemons_module
from drasil.kubeletplugin.vendors.nvidia.mps.daemons import (
    RECORD_FILE,
    DaemonLimits,
    DaemonProgram,
    MpsDaemons,
    MpsError,
    folder_key,
    is_mount_point,
    process_start_time,
)
from drasil.kubeletplugin.vendors.nvidia.mps.pods import (
    COMPONENT,
    COMPONENT_LABEL,
    DRIVER_LABEL,
    GPU_ANNOTATION,
    DaemonPods,
    PodLauncher,
    daemon_pod,
    describe,
    pod_name,
)
from drasil.kubeletplugin.vendors.nvidia.node import mps_launcher

GPU_A = "GPU-5a1e9c1e-0000-4000-8000-00000000000a"
GPU_B = "GPU-5a1e9c1e-0000-4000-8000-00000000000b"
SHARE = DaemonLimits(20480, 25)
NODE = "node-1"
DRIVER = "gpu.drasil.dev"
NS = "drasil"


# ---- the manifest -----------------------------------------------------------------------


def test_pod_names_are_per_driver_and_gpu_and_fit_a_hostname() -> None:
    name = pod_name(NODE, DRIVER, GPU_A)
    assert name.startswith("drasil-mps-node-1-")
    assert name == pod_name(NODE, DRIVER, GPU_A)
    assert len({name, pod_name(NODE, DRIVER, GPU_B), pod_name(NODE, "gpu.other.dev", GPU_A)}) == 3
    long_node = "a" * 60 + ".-b" + "c" * 100
    cut = pod_name(long_node, DRIVER, GPU_A)
    assert len(cut) <= 63
    assert cut.split("-")[-2].isalnum()  # no "." or "-" left before the hash


def _pods(state: Path, **changes: Any) -> DaemonPods:
    return DaemonPods(
        namespace=NS,
        node=NODE,
        driver=DRIVER,
        image="example.com/drasil:1",
        state_dir=state,
        **changes,
    )


def test_the_daemon_pod_runs_privileged_on_this_node_with_the_plugins_paths() -> None:
    overrides = {
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        "priorityClassName": "system-node-critical",
        "imagePullPolicy": "Never",
        "resources": {"requests": {"cpu": "10m"}},
    }
    pods = _pods(
        Path("/var/lib/kubelet/plugins/gpu.drasil.dev"),
        driver_root_host="/run/nvidia/driver",
        driver_root_local=Path("/driver-root"),
        overrides=overrides,
    )
    command = ["python", "-m", "mpsview", "--", "nvidia-cuda-mps-control", "-f"]
    pod = daemon_pod(pods, GPU_A, command, {"CUDA_VISIBLE_DEVICES": GPU_A})
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == pod_name(NODE, DRIVER, GPU_A)
    assert meta["namespace"] == NS
    assert meta["labels"][COMPONENT_LABEL] == COMPONENT
    assert meta["labels"][DRIVER_LABEL] == DRIVER
    assert meta["annotations"][GPU_ANNOTATION] == GPU_A
    assert "ownerReferences" not in meta  # it must outlive the plugin's Pod
    assert spec["nodeName"] == NODE
    assert spec["hostPID"] is True
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False
    assert spec["tolerations"] == overrides["tolerations"]
    assert spec["priorityClassName"] == "system-node-critical"
    (container,) = spec["containers"]
    assert container["command"] == command
    assert container["env"] == [{"name": "CUDA_VISIBLE_DEVICES", "value": GPU_A}]
    assert container["securityContext"]["privileged"] is True
    assert container["imagePullPolicy"] == "Never"
    assert container["resources"] == {"requests": {"cpu": "10m"}}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    # The same paths as in the plugin's container: the command line is the same.
    assert mounts["state-dir"]["mountPath"] == volumes["state-dir"] == str(pods.state_dir)
    assert mounts["state-dir"]["mountPropagation"] == "HostToContainer"  # the tmpfs
    assert mounts["driver-root"]["mountPath"] == "/driver-root"
    assert volumes["driver-root"] == "/run/nvidia/driver"


def test_a_driver_at_root_needs_no_driver_root_mount(tmp_path: Path) -> None:
    pod = daemon_pod(_pods(tmp_path), GPU_A, ["x"], {})
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["state-dir"]


def test_describe_says_why_a_pod_does_not_run() -> None:
    pod = {
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {"state": {"waiting": {"reason": "ErrImagePull", "message": "not found"}}}
            ],
            "conditions": [{"type": "Ready", "status": "False", "message": "containers not ready"}],
        }
    }
    said = describe(pod)
    assert "phase Pending" in said
    assert "container waiting: ErrImagePull not found" in said
    assert "Ready: containers not ready" in said


# ---- options -------------------------------------------------------------------------


def test_an_image_selects_pods_in_the_plugins_namespace(tmp_path: Path) -> None:
    env = {"NODE_NAME": NODE, "MPS_DAEMON_IMAGE": "img:1", "POD_NAMESPACE": NS}
    env["MPS_DAEMON_POD"] = '{"tolerations": [], "imagePullPolicy": "Never"}'
    opts = parse_options([f"--plugins-dir={tmp_path}"], env)
    launcher = mps_launcher(opts, api=None)  # type: ignore[arg-type]
    assert isinstance(launcher, PodLauncher)
    assert launcher.pods.namespace == NS
    assert launcher.pods.image == "img:1"
    assert launcher.pods.state_dir == tmp_path / DRIVER
    assert launcher.pods.overrides == {"tolerations": [], "imagePullPolicy": "Never"}
    plain = parse_options([], {"NODE_NAME": NODE})
    assert not isinstance(mps_launcher(plain, api=None), PodLauncher)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"MPS_DAEMON_IMAGE": "img:1"}, "needs --pod-namespace"),
        ({"MPS_DAEMON_POD": "[]"}, "is not a JSON object"),
        ({"MPS_DAEMON_POD": "{"}, "not JSON"),
        ({"MPS_DAEMON_POD": '{"hostNetwork": true}'}, "unknown fields hostNetwork; allowed:"),
    ],
)
def test_bad_daemon_pod_options_are_refused(env: dict[str, str], said: str) -> None:
    with pytest.raises(OptionsError, match=said):
        parse_options([], {"NODE_NAME": NODE, **env})


# ---- the launcher against a Pod API whose kubelet runs processes --------------------------


@dataclass
class FakePod:
    obj: dict[str, Any]
    proc: subprocess.Popen[bytes] | None = None


@dataclass
class FakePods:
    """The Pod API with a kubelet: a created Pod's command runs at once as a process
    here (unless ``hold`` says the image cannot be pulled); its phase follows it."""

    hold: bool = False
    forbid: bool = False
    pods: dict[str, FakePod] = field(default_factory=dict)
    uids: Iterator[int] = field(default_factory=itertools.count)
    created: int = 0
    lists: int = 0
    gets: int = 0

    def get_pod(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        self.gets += 1
        pod = self.pods.get(name)
        if pod is None:
            return None
        self._update(pod)
        return pod.obj

    def list_pods(
        self, namespace: str, *, field_selector: str = ""
    ) -> Sequence[Mapping[str, Any]] | None:
        assert field_selector == f"spec.nodeName={NODE}"
        self.lists += 1
        for pod in self.pods.values():
            self._update(pod)
        return [p.obj for p in self.pods.values()]

    def create_pod(self, namespace: str, pod: Mapping[str, Any]) -> Mapping[str, Any]:
        if self.forbid:
            raise ApiError(status=403, reason="Forbidden")
        name = pod["metadata"]["name"]
        if name in self.pods:
            raise ApiError(status=409, reason="AlreadyExists")
        obj = dict(pod)
        obj["metadata"] = dict(pod["metadata"], uid=f"uid-{next(self.uids)}")
        obj["status"] = {"phase": "Pending"}
        self.pods[name] = fake = FakePod(obj)
        self.created += 1
        if self.hold:
            waiting = {"reason": "ErrImagePull", "message": "image not found"}
            obj["status"]["containerStatuses"] = [{"state": {"waiting": waiting}}]
        else:
            self._run(fake)
        return obj

    def delete_pod(self, namespace: str, name: str, *, uid: str, grace_seconds: int) -> None:
        pod = self.pods.get(name)
        if pod is None or pod.obj["metadata"]["uid"] != uid:
            return
        if pod.proc is not None and pod.proc.poll() is None:
            pod.proc.terminate()
            try:
                pod.proc.wait(grace_seconds)
            except subprocess.TimeoutExpired:
                pod.proc.kill()
                pod.proc.wait()
        del self.pods[name]

    def kill(self, name: str) -> None:
        """The daemon dies (an OOM kill): the container, so the Pod, ends."""
        proc = self.pods[name].proc
        assert proc is not None
        proc.kill()
        proc.wait()

    def stop_all(self) -> None:
        for pod in list(self.pods.values()):
            self.delete_pod(
                NS, pod.obj["metadata"]["name"], uid=pod.obj["metadata"]["uid"], grace_seconds=1
            )

    def _run(self, pod: FakePod) -> None:
        (container,) = pod.obj["spec"]["containers"]
        env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
        env |= {e["name"]: e["value"] for e in container["env"]}
        pod.proc = subprocess.Popen(
            container["command"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        pod.obj["status"] = {"phase": "Running"}

    @staticmethod
    def _update(pod: FakePod) -> None:
        if pod.proc is None or (code := pod.proc.poll()) is None:
            return
        terminated = {"reason": "Completed" if code == 0 else "Error", "exitCode": code}
        pod.obj["status"] = {
            "phase": "Succeeded" if code == 0 else "Failed",
            "containerStatuses": [{"state": {"terminated": terminated}}],
        }


@pytest.fixture
def api(tmp_path: Path) -> Iterator[FakePods]:
    fake = FakePods()
    yield fake
    fake.stop_all()
    for shm in tmp_path.glob("state/mps/*/shm"):
        if is_mount_point(shm):
            subprocess.run(["umount", "-l", str(shm)], check=False)


def _daemons(api: FakePods, state: Path, **timeouts: float) -> MpsDaemons:
    launcher = PodLauncher(api, _pods(state), poll=0.02, **timeouts)
    return MpsDaemons(state, program=DaemonProgram.for_backend("simulated"), launcher=launcher)


def _running(api: FakePods) -> list[str]:
    return sorted(n for n, p in api.pods.items() if p.obj["status"]["phase"] == "Running")


def test_a_daemon_runs_in_its_pod_outlives_the_plugin_and_goes_with_its_pod(
    api: FakePods, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    daemons = _daemons(api, state)
    daemon = daemons.ensure(GPU_A, SHARE)
    name = pod_name(NODE, DRIVER, GPU_A)
    assert daemon.pod == name
    assert _running(api) == [name]
    assert "-f" in api.pods[name].obj["spec"]["containers"][0]["command"]
    assert mpsstandin.control(daemon.pipe_dir, "get_default_device_pinned_mem_limit 0") == "20480M"
    client = mpsstandin.connect_client(daemon.pipe_dir, daemon.shm_dir)

    # The plugin restarts (a new MpsDaemons, launcher, API client): the same Pod.
    again = _daemons(api, state)
    assert again.ensure(GPU_A, SHARE).pod_uid == daemon.pod_uid
    (state / "mps" / folder_key(GPU_A) / RECORD_FILE).unlink()  # a record lost
    adopted = again.ensure(GPU_A, SHARE)
    assert (adopted.pod, adopted.pod_uid) == (daemon.pod, daemon.pod_uid)
    assert api.created == 1
    client.ping()  # still connected

    assert again.stop(GPU_A)
    assert api.pods == {}
    assert not is_mount_point(daemon.shm_dir)
    assert not again.stop(GPU_A)  # idempotent
    client.close()


def test_a_dead_daemons_pod_is_replaced(api: FakePods, tmp_path: Path) -> None:
    daemons = _daemons(api, tmp_path / "state")
    first = daemons.ensure(GPU_A, SHARE)
    assert first.pod is not None
    api.kill(first.pod)
    assert not daemons.alive(first)
    second = daemons.ensure(GPU_A, SHARE)
    assert second.pod == first.pod
    assert second.pod_uid != first.pod_uid
    assert mpsstandin.control(second.pipe_dir, "get_default_active_thread_percentage") == "25.0"


def test_a_pod_created_before_a_crash_is_adopted_not_made_twice(
    api: FakePods, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    daemons = _daemons(api, state)
    # What ensure did up to its crash: the directories and the Pod, no record.
    daemons.ensure(GPU_A, SHARE)
    (state / "mps" / folder_key(GPU_A) / RECORD_FILE).unlink()
    (pod,) = api.pods.values()
    uid = pod.obj["metadata"]["uid"]
    after = _daemons(api, state).ensure(GPU_A, SHARE)
    assert after.pod_uid == uid
    assert api.created == 1


def test_sweep_deletes_daemon_pods_no_share_needs_even_without_their_folder(
    api: FakePods, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    daemons = _daemons(api, state)
    daemons.ensure(GPU_A, SHARE)
    daemons.ensure(GPU_B, SHARE)
    (state / "mps" / folder_key(GPU_B) / "gpu").unlink()  # the state dir forgot GPU_B
    assert daemons.sweep(keep=[GPU_A]) == [GPU_B]
    assert _running(api) == [pod_name(NODE, DRIVER, GPU_A)]


def test_a_pod_that_does_not_start_fails_the_share_with_its_reason(
    api: FakePods, tmp_path: Path
) -> None:
    api.hold = True
    daemons = _daemons(api, tmp_path / "state", start_timeout=0.3)
    name = pod_name(NODE, DRIVER, GPU_A)
    with pytest.raises(MpsError, match=f"Pod {NS}/{name} .*ErrImagePull image not found"):
        daemons.ensure(GPU_A, SHARE)
    # kubelet's retry finds the same Pod and waits for it again; no second Pod.
    with pytest.raises(MpsError, match="not answering within"):
        daemons.ensure(GPU_A, SHARE)
    assert api.created == 1
    # Its last share's unprepare does not wait for it: the Pod is deleted.
    assert daemons.stop(GPU_A)
    assert api.pods == {}


def test_a_forbidden_create_names_the_role(api: FakePods, tmp_path: Path) -> None:
    api.forbid = True
    with pytest.raises(MpsError, match=f"create: 403 Forbidden .*Role in namespace {NS}"):
        _daemons(api, tmp_path / "state").ensure(GPU_A, SHARE)


def test_a_daemon_that_ignores_quit_ends_with_its_pod(
    api: FakePods, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemons = _daemons(api, tmp_path / "state", stop_timeout=0.3)
    daemon = daemons.ensure(GPU_A, SHARE)
    monkeypatch.setattr(daemons, "_quit", lambda _daemon: None)
    assert daemons.stop(GPU_A)
    assert api.pods == {}
    assert process_start_time(daemon.pid) is None  # the Pod's deletion ended it


def test_the_watch_reads_every_daemon_pod_of_the_node_in_one_list(
    api: FakePods, tmp_path: Path
) -> None:
    daemons = _daemons(api, tmp_path / "state")
    first = daemons.ensure(GPU_A, SHARE)
    daemons.ensure(GPU_B, SHARE)
    gets, lists = api.gets, api.lists
    assert daemons.running_of([GPU_A, GPU_B]) == {GPU_A: True, GPU_B: True}
    assert (api.gets, api.lists) == (gets, lists + 1)
    assert first.pod is not None
    api.kill(first.pod)  # OOM-killed: its Pod fails
    assert daemons.running_of([GPU_A, GPU_B]) == {GPU_A: False, GPU_B: True}
    del api.pods[pod_name(NODE, DRIVER, GPU_B)]  # deleted by someone else
    assert daemons.running_of([GPU_A, GPU_B]) == {GPU_A: False, GPU_B: False}


class Told:
    """The claim's Pod reader and the Events posted to it."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def get_pod(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        return None

    def post_event(self, **event: Any) -> bool:
        self.events.append(event)
        return True


def test_a_daemon_pod_slow_to_start_fails_the_claim_retriably_and_tells_its_pod(
    api: FakePods, tmp_path: Path
) -> None:
    p, effects = preparer(tmp_path)
    launcher = PodLauncher(api, _pods(tmp_path / "state"), poll=0.02, start_timeout=0.3)
    effects.daemons.launcher = launcher
    told = Told()
    effects.pods = told
    api.hold = True  # the image is still being pulled
    entry = result("gpu-0", share_id="share-1")
    entry["consumedCapacity"] = {"memory": "20Gi"}
    claim = claim_json("aaaaaaaa-0000-4000-8000-00000000000a", entry, name="c", namespace="ml")
    claim["status"]["reservedFor"] = [{"resource": "pods", "name": "train", "uid": "u-1"}]
    FileClaims(tmp_path / "claims").put(claim)
    error = p.prepare(ref_of(claim)).error
    gpu = p.devices["gpu-0"].uuid
    name = pod_name(NODE, DRIVER, gpu)
    assert f"MPS daemon Pod {NS}/{name} of GPU {gpu} not answering within 0.3s" in error
    assert "ErrImagePull image not found" in error
    assert "kubelet retries this claim" in error
    deadline = time.monotonic() + 10
    while not told.events:
        assert time.monotonic() < deadline, "no Event on the claim's Pod"
        time.sleep(0.02)
    (event,) = told.events
    assert event["involved"] == {"kind": "Pod", "name": "train", "namespace": "ml", "uid": "u-1"}
    assert event["reason"] == "MpsDaemonNotReady"
    assert name in event["message"]
    assert "ErrImagePull" in event["message"]
    # The image arrives: kubelet's retry gets the same Pod, now running.
    api.hold = False
    (pod,) = api.pods.values()
    api._run(pod)
    # The short bound above was for the failure; the stand-in's own start may take longer
    # than 0.3 s on a loaded machine (CI saw that), so the retry gets the real bound.
    launcher.start_timeout = 20
    assert p.prepare(ref_of(claim)).error == ""
    assert api.created == 1
    assert p.unprepare(ref_of(claim)) == ""
    assert api.pods == {}


def test_the_wait_for_the_gpus_lock_is_taken_from_the_start_s_time(
    api: FakePods, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(daemons_module, "DAEMON_CALL_BUDGET", 1.0)
    api.hold = True  # a Pod that never starts
    daemons = _daemons(api, tmp_path / "state")
    release, thread = held_elsewhere(daemons, GPU_A)  # another call, for 0.6 s
    threading.Timer(0.6, release.set).start()
    # The call's 1 s less the wait for the lock: under half a second was left to start.
    with pytest.raises(MpsError, match=r"not answering within 0(\.[0-4]\d*)?s"):
        daemons.ensure(GPU_A, SHARE)
    thread.join()
    assert daemons.stop(GPU_A)

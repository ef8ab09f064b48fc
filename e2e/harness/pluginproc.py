"""The drasil kubelet plugin as a real process, and a client that talks to it as kubelet.

Used by the e2e tests, `make demo` and the benchmarks: the plugin runs with its own
registrar/plugins/CDI directories under a temp dir, against the API server of the
cluster under test, and `KubeletClient` calls its sockets exactly as kubelet does.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from drasil.api.kubelet.deviceplugin.v1beta1 import deviceplugin_pb2 as dp_pb2
from drasil.api.kubelet.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as dp_grpc
from drasil.api.kubelet.dra.v1 import dra_pb2, dra_pb2_grpc
from drasil.api.kubelet.dra.v1beta1 import dra_pb2 as dra_v1beta1_pb2
from drasil.api.kubelet.dra.v1beta1 import dra_pb2_grpc as dra_v1beta1_grpc
from drasil.api.kubelet.pluginregistration import registration_pb2, registration_pb2_grpc
from drasil.driver.checkpoint import CHECKPOINT_DIR
from drasil.driver.checkpointdisk import read_state
from drasil.driver.nvidia.nvml import NO_INSTANCE
from drasil.driver.simulated.gpus import simulated_gpus
from drasil.kubeletplugin.deviceplugin.resources import socket_name
from e2e.harness import driverroot, mocknvml, procs
from e2e.harness.kube import RESOURCE

DRIVER = "gpu.drasil.dev"
# kubelet hard-codes this directory (and its kubelet.sock) whatever its --root-dir.
DEVICE_PLUGINS_DIR = Path("/var/lib/kubelet/device-plugins")
GPU_RESOURCE = "drasil.dev/gpu"
# Logged by the plugin each time kubelet accepted it (both modes).
PLUGIN_REGISTERED = "registered with kubelet"
# The chart's gpu.drasil.dev DeviceClass (charts/drasil/templates/deviceclasses.yaml).
GPU_CLASS = {
    "apiVersion": RESOURCE,
    "kind": "DeviceClass",
    "metadata": {"name": DRIVER},
    "spec": {
        "selectors": [
            {
                "cel": {
                    "expression": f'device.driver == "{DRIVER}" && '
                    f'device.attributes["{DRIVER}"].type == "gpu"'
                }
            }
        ]
    },
}


def checkpoint_claims(state_dir: Path) -> dict[str, Any]:
    """The claims the plugin's checkpoint records, by UID, as stored (camelCase JSON)."""
    state = read_state(state_dir / CHECKPOINT_DIR)
    claims = state.claims if state is not None else {}
    return {uid: record.model_dump(mode="json") for uid, record in claims.items()}


def checkpoint_gpus(state_dir: Path) -> dict[str, Any]:
    """What the checkpoint records per GPU UUID, as stored (camelCase JSON)."""
    state = read_state(state_dir / CHECKPOINT_DIR)
    gpus = state.gpus if state is not None else {}
    return {uuid: record.model_dump(mode="json") for uuid, record in gpus.items()}


def lose_checkpoint(state_dir: Path) -> None:
    """Delete the plugin's checkpoint, as a careless clean-up would."""
    shutil.rmtree(state_dir / CHECKPOINT_DIR)


@dataclass
class PluginProcess:
    """``drasil-kubelet-plugin`` on temp dirs; start/kill/restart it like a node would."""

    root: Path
    kubeconfig: Path
    node_name: str
    profile: str = "h100-80gb:8"
    driver: str = DRIVER
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    # For a plugin beside a real kubelet (e2e.harness.cluster.node): `root` is then kubelet's
    # --root-dir, whose plugins_registry/ and plugins/ the plugin uses as they are.
    cdi_dir: Path | None = None  # default <root>/cdi
    log_file: Path | None = None  # default <root>/plugin.log
    # "<pid> <start time>" (e2e.harness.procs) so that another process (`python -m
    # e2e.harness.cluster down`, a test attached to a running node) can stop or kill it.
    pid_file: Path | None = None
    detach: bool = False  # own session: outlives the process that started it
    die_with_parent: bool = False  # SIGKILLed by the kernel when the starter dies
    # "device-plugin": serve drasil.dev/gpu through kubelet's classic device-plugin
    # API in `device_plugins_dir` instead of DRA (docs/device-plugin.md).
    mode: str = "dra"
    device_plugins_dir: Path = DEVICE_PLUGINS_DIR
    # "simulated": the simulated backend's GPUs of `profile`. "nvml": the same GPUs
    # served by our C mock NVML (e2e.harness.mocknvml) from a fake driver root under
    # `<root>/nvml`, the plugin run with --backend=nvml as users run it (`mock_root`).
    backend: str = "simulated"
    _mock: MockNvmlRoot | None = field(default=None, repr=False)

    @property
    def registrar_dir(self) -> Path:
        return self.root / "plugins_registry"

    @property
    def plugins_dir(self) -> Path:
        return self.root / "plugins"

    @property
    def cdi_root(self) -> Path:
        return self.cdi_dir if self.cdi_dir is not None else self.root / "cdi"

    @property
    def state_dir(self) -> Path:
        return self.plugins_dir / self.driver

    @property
    def dra_socket(self) -> Path:
        return self.state_dir / "dra.sock"

    @property
    def reg_socket(self) -> Path:
        return self.registrar_dir / f"{self.driver}-reg.sock"

    @property
    def log_path(self) -> Path:
        return self.log_file if self.log_file is not None else self.root / "plugin.log"

    @property
    def device_plugin_socket(self) -> Path:
        """The socket kubelet dials in device-plugin mode (`drasil-gpu.sock`)."""
        return self.device_plugins_dir / socket_name(GPU_RESOURCE)

    @property
    def gpu_state_file(self) -> Path:
        """Where the GPUs' MIG state lives: the simulated backend's file, or the mock
        NVML's (the same JSON format, ``drasil.driver.simulated.gpustate``)."""
        if self.backend == "nvml":
            return self.mock_root().node.state_file
        return self.state_dir / "simulated-gpus.json"

    def mock_root(self) -> MockNvmlRoot:
        """The nvml backend's fake driver root and mock node, built on first use."""
        if self.backend != "nvml":
            raise ValueError(f"the {self.backend} backend has no mock NVML")
        if self._mock is None:
            self._mock = make_mock_nvml_root(self.root / "nvml", self.profile, self.node_name)
        return self._mock

    def inject_xid(
        self,
        gpu_uuid: str,
        xid: int,
        gpu_instance_id: int = NO_INSTANCE,
        compute_instance_id: int = NO_INSTANCE,
    ) -> None:
        """An XID critical error of the GPU (or of its MIG device), as NVML's events
        deliver it to the plugin (nvml backend only; the simulated one has fault files)."""
        events = self.mock_root().node.events_file
        mocknvml.inject_xid(events, gpu_uuid, xid, gpu_instance_id, compute_instance_id)

    def _backend_args(self) -> list[str]:
        if self.backend == "simulated":
            return ["--backend=simulated", f"--simulated-profile={self.profile}"]
        if self.backend != "nvml":
            raise ValueError(f"unknown backend {self.backend!r}")
        mock = self.mock_root()
        return [
            "--backend=nvml",
            f"--nvidia-driver-root={mock.root}",
            f"--proc-root={mock.node.proc_root}",
        ]

    def command(self) -> list[str]:
        mode = (
            [f"--mode={self.mode}", f"--device-plugins-dir={self.device_plugins_dir}"]
            if self.mode != "dra"
            else []
        )
        return [
            sys.executable,
            "-m",
            "drasil.kubeletplugin.main",
            f"--node-name={self.node_name}",
            f"--driver-name={self.driver}",
            *self._backend_args(),
            f"--kubeconfig={self.kubeconfig}",
            f"--registrar-dir={self.registrar_dir}",
            f"--plugins-dir={self.plugins_dir}",
            f"--cdi-root={self.cdi_root}",
            "--metrics-addr=127.0.0.1:0",
            "--health-addr=",
            "--log-format=json",
            *mode,
        ]

    def start(self, *, crash_at: str | None = None, timeout: float = 30.0) -> None:
        env = {**os.environ, **self.env}
        if self.backend == "nvml":
            env.update(self.mock_root().node.env())
        env.pop("DRASIL_CRASH_AT", None)
        if crash_at:
            env["DRASIL_CRASH_AT"] = crash_at
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=self.detach,
            preexec_fn=procs.kill_on_parent_death if self.die_with_parent else None,  # noqa: PLW1509
        )
        log.close()
        if self.pid_file is not None:
            started = procs.start_time(self.proc.pid)
            procs.write_pid_file(
                self.pid_file, procs.Proc(self.pid_file.stem, self.proc.pid, started or -1)
            )
        self.wait_ready(timeout)

    def attached(self) -> procs.Proc | None:
        """The running plugin of `pid_file`, also when another process started it."""
        if self.pid_file is None:
            return None
        proc = procs.read_pid_file(self.pid_file)
        return proc if proc is not None and proc.alive() else None

    def running(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return self.attached() is not None

    def wait_ready(self, timeout: float) -> None:
        """Until the plugin answers a real gRPC call: GetInfo on its registration
        socket, or in device-plugin mode GetDevicePluginOptions on its socket."""
        deadline = time.monotonic() + timeout
        last = "no attempt"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                self._forget_pid_file()
                raise RuntimeError(f"plugin exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.mode == "dra":
                    KubeletClient(self).get_info()
                else:
                    self.device_plugin_options()
                return
            except grpc.RpcError as err:
                last = str(err)
            time.sleep(0.1)
        raise TimeoutError(f"plugin not ready after {timeout}s ({last}):\n{self.log_tail()}")

    def device_plugin_options(self) -> dp_pb2.DevicePluginOptions:
        with grpc.insecure_channel(f"unix://{self.device_plugin_socket}") as channel:
            stub = dp_grpc.DevicePluginStub(channel)
            return stub.GetDevicePluginOptions(dp_pb2.Empty(), timeout=5)

    def registrations(self) -> int:
        """How often kubelet has registered this plugin, by its log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return 0
        return text.count(PLUGIN_REGISTERED)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def wait_exit(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout=timeout)
        self._forget_pid_file()
        return code

    def kill(self) -> None:
        """kill -9: what a crash, an OOM kill or a node power cut looks like."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        elif self.proc is None and (other := self.attached()) is not None:
            other.signal(signal.SIGKILL)
            _wait_gone(other, 10)
        self._forget_pid_file()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            procs.end_child(self.proc)
        elif self.proc is None and (other := self.attached()) is not None:
            procs.stop(other, grace=10)
        self._forget_pid_file()

    def _forget_pid_file(self) -> None:
        if self.pid_file is not None and self.attached() is None:
            self.pid_file.unlink(missing_ok=True)


@dataclass(frozen=True)
class MockNvmlRoot:
    """A fake driver root whose ``libnvidia-ml.so.<version>`` is the mock NVML, and the
    mock's node; the node's ``dev`` is the root's ``dev`` (one set of device nodes)."""

    root: Path  # --nvidia-driver-root
    node: mocknvml.MockNode


def make_mock_nvml_root(dest: Path, profile: str, node_name: str) -> MockNvmlRoot:
    """``<dest>/driver``: a fake driver root (``e2e.harness.driverroot``, layout debian, the
    device nodes of every GPU) with the mock NVML over its libnvidia-ml; ``<dest>/node``:
    the mock node of ``profile`` (config, fake /proc, events file, state file), whose
    ``dev`` links to the driver root's. A process finds the node through
    ``node.env()``. Needs root (mknod, ldconfig -r)."""
    gpus = simulated_gpus(profile, node_name=node_name)
    fake = driverroot.build_fake_root(
        dest / "driver",
        layout="debian",
        dev_nodes=True,
        gpus=max((g.minor for g in gpus), default=-1) + 1,
    )
    node_dir = dest / "node"
    node_dir.mkdir(parents=True)
    (node_dir / "dev").symlink_to(fake.root / "dev")
    node = mocknvml.make_mock_node(node_dir, profile, node_name=node_name, dev_nodes=False)
    nvml = fake.host(f"{fake.lib_dirs[0]}/libnvidia-ml.so.{fake.version}")
    nvml.unlink()
    shutil.copyfile(mocknvml.compiled_mock(), nvml)
    nvml.chmod(0o755)
    return MockNvmlRoot(root=fake.root, node=node)


def _wait_gone(proc: procs.Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while proc.alive() and time.monotonic() < deadline:
        time.sleep(0.05)


@dataclass(frozen=True)
class ClaimId:
    namespace: str
    name: str
    uid: str


class KubeletClient:
    """Calls the plugin's sockets with the same messages kubelet sends.

    Like kubelet, it keeps one connection to ``dra.sock`` and reuses it; gRPC
    reconnects by itself after the plugin restarts.
    """

    def __init__(self, plugin: PluginProcess) -> None:
        self.plugin = plugin
        self._dra: grpc.Channel | None = None

    def close(self) -> None:
        if self._dra is not None:
            self._dra.close()
            self._dra = None

    def get_info(self) -> registration_pb2.PluginInfo:
        with grpc.insecure_channel(f"unix://{self.plugin.reg_socket}") as channel:
            stub = registration_pb2_grpc.RegistrationStub(channel)
            return stub.GetInfo(registration_pb2.InfoRequest(), timeout=5)

    def notify_registered(self) -> None:
        with grpc.insecure_channel(f"unix://{self.plugin.reg_socket}") as channel:
            stub = registration_pb2_grpc.RegistrationStub(channel)
            status = registration_pb2.RegistrationStatus(plugin_registered=True)
            stub.NotifyRegistrationStatus(status, timeout=5)

    def _stub(self) -> dra_pb2_grpc.DRAPluginStub:
        if self._dra is None:
            self._dra = grpc.insecure_channel(f"unix://{self.plugin.dra_socket}")
        return dra_pb2_grpc.DRAPluginStub(self._dra)

    def prepare(
        self, claims: Sequence[ClaimId], *, timeout: float = 45.0
    ) -> dra_pb2.NodePrepareResourcesResponse:
        request = dra_pb2.NodePrepareResourcesRequest(
            claims=[dra_pb2.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]
        )
        return self._stub().NodePrepareResources(request, timeout=timeout)

    def unprepare(
        self, claims: Sequence[ClaimId], *, timeout: float = 45.0
    ) -> dra_pb2.NodeUnprepareResourcesResponse:
        request = dra_pb2.NodeUnprepareResourcesRequest(
            claims=[dra_pb2.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]
        )
        return self._stub().NodeUnprepareResources(request, timeout=timeout)

    def prepare_v1beta1(
        self, claims: Sequence[ClaimId], *, timeout: float = 45.0
    ) -> dra_v1beta1_pb2.NodePrepareResourcesResponse:
        request = dra_v1beta1_pb2.NodePrepareResourcesRequest(
            claims=[
                dra_v1beta1_pb2.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims
            ]
        )
        if self._dra is None:
            self._stub()
        assert self._dra is not None
        return dra_v1beta1_grpc.DRAPluginStub(self._dra).NodePrepareResources(
            request, timeout=timeout
        )

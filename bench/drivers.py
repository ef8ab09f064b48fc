"""The DRA drivers `bench.prepare` measures, behind one interface.

- ``drasil``: drasil's kubelet plugin (``e2e.harness.pluginproc.PluginProcess``) on a simulated
  node of 64 H100s (``gpu-0`` ... ``gpu-63``).
- ``reference``: Kubernetes' own e2e DRA test driver
  (``k8s.io/kubernetes/test/e2e/dra/test-driver``, built from the cluster's Kubernetes
  module by ``e2e.harness.build``) in kubelet-plugin mode with 64 devices (``device-00`` ...
  ``device-63``). Its API client's rate limit is lifted (``--kube-api-qps=-1``: client-go
  creates no rate limiter for a QPS below zero), so what is measured is the driver, not
  a token bucket. It reads each claim from the API server on prepare as drasil does
  (the kubeletplugin helper's GET), writes a CDI spec per claim, and keeps its prepared
  claims in memory only.

Both serve DRAPlugin v1 on a ``dra.sock`` that ``drasil-kubelet-client`` calls.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from e2e.harness import binaries, procs
from e2e.harness.pluginproc import DRIVER, PluginProcess

REFERENCE_DRIVER = "test-driver.cdi.k8s.io"
"""The test driver's default name; its claims' allocations name it."""


class DriverUnderTest(Protocol):
    """What the benchmark needs of a driver: its name, devices, socket and process."""

    label: str
    driver: str

    def device(self, index: int) -> str:
        """The name of the node's ``index``-th device, as allocations name it."""
        ...

    @property
    def dra_socket(self) -> Path: ...

    @property
    def pid(self) -> int: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class Drasil:
    """drasil's kubelet plugin with ``gpus`` simulated GPUs."""

    root: Path
    kubeconfig: Path
    node: str
    gpus: int
    label: str = "drasil"
    driver: str = DRIVER
    plugin: PluginProcess | None = None

    def device(self, index: int) -> str:
        return f"gpu-{index}"

    @property
    def dra_socket(self) -> Path:
        return self._plugin().dra_socket

    @property
    def pid(self) -> int:
        proc = self._plugin().proc
        assert proc is not None
        return proc.pid

    def start(self) -> None:
        self.plugin = PluginProcess(
            root=self.root,
            kubeconfig=self.kubeconfig,
            node_name=self.node,
            profile=f"h100-80gb:{self.gpus}",
        )
        self.plugin.start()

    def stop(self) -> None:
        if self.plugin is not None:
            self.plugin.stop()

    def _plugin(self) -> PluginProcess:
        assert self.plugin is not None, "start() first"
        return self.plugin


@dataclass
class Reference:
    """The upstream e2e DRA test driver with ``devices`` devices and no API rate limit."""

    root: Path
    kubeconfig: Path
    node: str
    devices: int
    label: str = "reference"
    driver: str = REFERENCE_DRIVER
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def device(self, index: int) -> str:
        return f"device-{index:02d}"  # the test driver's own naming (--num-devices)

    @property
    def dra_socket(self) -> Path:
        return self.root / "plugins" / self.driver / "dra.sock"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "start() first"
        return self.proc.pid

    @property
    def log_path(self) -> Path:
        return self.root / "reference.log"

    def command(self, binary: Path) -> list[str]:
        return [
            str(binary),
            f"--kubeconfig={self.kubeconfig}",
            "--kube-api-qps=-1",
            "--kube-api-burst=1000",
            f"--drivername={self.driver}",
            "kubelet-plugin",
            f"--node-name={self.node}",
            f"--num-devices={self.devices}",
            f"--datadir={self.root / 'plugins'}",
            f"--plugin-registration-path={self.root / 'registry'}",
            f"--cdi-dir={self.root / 'cdi'}",
        ]

    def start(self, timeout: float = 60.0) -> None:
        binary = binaries.ensure_binaries(["dra-test-driver"])["dra-test-driver"]
        # It makes only the parent of its socket directory itself.
        for directory in (self.dra_socket.parent, self.root / "registry", self.root / "cdi"):
            directory.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(binary),
                stdout=log,
                stderr=log,
                preexec_fn=procs.kill_on_parent_death,  # noqa: PLW1509 - prctl only; dies with the benchmark
            )
        deadline = time.monotonic() + timeout
        while not self.dra_socket.is_socket():
            if self.proc.poll() is not None:
                last = procs.tail(self.log_path)
                raise RuntimeError(f"dra-test-driver exited with {self.proc.returncode}:\n{last}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"dra-test-driver: no {self.dra_socket} after {timeout}s")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            procs.end_child(self.proc)

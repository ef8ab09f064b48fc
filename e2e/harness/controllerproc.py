"""drasil-controller as a real process, as the e2e tests run it: JSON logs in a file,
metrics on a free port, leader election on a Lease of its own with short timings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.request import urlopen

from e2e.harness import procs
from e2e.harness.kube import NotYet, wait_for


@dataclass
class ControllerProcess:
    """``drasil-controller`` with JSON logs in a file; metrics on a free port."""

    kubeconfig: Path
    log_path: Path
    driver: str
    lease: str
    identity: str
    lease_namespace: str = "default"
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # set on top of this process's
    proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "drasil.controller.main",
            f"--driver-name={self.driver}",
            f"--kubeconfig={self.kubeconfig}",
            "--metrics-addr=127.0.0.1:0",
            "--health-addr=",
            "--log-format=json",
            f"--leader-elect-lease-name={self.lease}",
            f"--leader-elect-namespace={self.lease_namespace}",
            f"--leader-elect-identity={self.identity}",
            "--leader-elect-lease-duration=4",
            "--leader-elect-renew-deadline=3",
            "--leader-elect-retry-period=1",
            *self.args,
        ]

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            # Dies with the test or benchmark that started it, even on SIGKILL.
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=log,
                env={**os.environ, **self.env},
                preexec_fn=procs.kill_on_parent_death,  # noqa: PLW1509 - prctl only
            )

    def logs(self) -> list[dict[str, Any]]:
        lines = self.log_path.read_text().splitlines() if self.log_path.exists() else []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"msg": line})
        return out

    def tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text() if self.log_path.exists() else "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_logged(self, message: str, *, timeout: float = 30) -> dict[str, Any]:
        def logged() -> Any:
            if not self.alive():
                raise AssertionError(f"controller exited:\n{self.tail()}")
            found = [entry for entry in self.logs() if entry.get("msg") == message]
            return found[-1] if found else NotYet(self.tail(5))

        result: dict[str, Any] = wait_for(logged, timeout=timeout, what=f"log {message!r}")
        return result

    def metrics(self) -> dict[str, float]:
        address = self.wait_logged("serving HTTP")["address"]
        with urlopen(f"http://{address}/metrics", timeout=5) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

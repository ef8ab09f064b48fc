"""A simulated fleet beside the control plane (`up --fake-nodes N`, docs/scale.md).

- **KWOK**'s controller (`sigs.k8s.io/kwok`, built like the other binaries) manages the
  Nodes annotated `kwok.x-k8s.io/node: fake`: it makes them Ready and plays their Pods'
  lifecycle (bound Pods turn Running, deleted ones go), with the stages in
  `<run>/fleet/kwok.yaml`. Node leases are off (`--node-lease-duration-seconds=0`): the
  node-lifecycle controller's grace period here is a year anyway, and N lease renewals
  every 10 s would be most of the idle API traffic of this 2-core machine.
- **N Nodes** `<prefix>0..N-1`, created by the admin.
- **One fleet publisher** (`python -m tools.fleet`) that publishes every node's pool with
  drasil's own slice code, as the chart's kubelet-plugin service account (release
  `drasil-fleet`).

Everything is in the run dir: `logs/kwok.log`, `logs/fleet-publisher.log`,
`pids/{kwok,fleet-publisher}.pid`, `fleet/` (stages, the publisher's kubeconfig and
HTTP port). `Cluster.down()` stops both; `Cluster.status()` lists them.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2e.harness import binaries, procs
from e2e.harness.chart import create_chart_identity
from e2e.harness.cluster.host import free_ports
from e2e.harness.cluster.rundir import ClusterError, RunDir, http_get
from e2e.harness.kube import RESOURCE, Kube

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
FLEET_LABEL = "drasil.dev/fleet"  # every fake Node carries it (value: the run's fleet)
NODE_PREFIX = "kwok-node-"
DRIVER = "gpu.drasil.dev"
DEFAULT_FLEET_PROFILE = "h100-80gb:8"
RELEASE = "drasil-fleet"
KWOK = "kwok"
PUBLISHER = "fleet-publisher"

# Our own stages (KWOK's Stage API, kwok.x-k8s.io/v1alpha1): a fake Node becomes Ready
# with room for many Pods; a Pod bound to one becomes Running; a deleted one goes (no
# kubelet confirms the deletion).
STAGES = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: drasil-node-ready}
spec:
  resourceRef: {apiGroup: v1, kind: Node}
  selector:
    matchExpressions:
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: NotIn
      values: ['True']
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - type: Ready
        status: "True"
        reason: KubeletReady
        message: KWOK plays this node's kubelet
        lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $now | Quote }}
      allocatable: {cpu: "1k", memory: 1Ti, pods: "1k"}
      capacity: {cpu: "1k", memory: 1Ti, pods: "1k"}
      nodeInfo:
        architecture: amd64
        operatingSystem: linux
        kubeletVersion: {{ printf "kwok-%s" Version | Quote }}
      phase: Running
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: drasil-pod-running}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: .metadata.deletionTimestamp, operator: DoesNotExist}
    - {key: .status.phase, operator: In, values: [Pending]}
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
      - {type: ContainersReady, status: "True", lastTransitionTime: {{ $now | Quote }}}
      - {type: Ready, status: "True", lastTransitionTime: {{ $now | Quote }}}
      containerStatuses:
      {{ range .spec.containers }}
      - name: {{ .name | Quote }}
        image: {{ .image | Quote }}
        ready: true
        restartCount: 0
        state: {running: {startedAt: {{ $now | Quote }}}}
      {{ end }}
      phase: Running
      startTime: {{ $now | Quote }}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: drasil-pod-delete}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: .metadata.deletionTimestamp, operator: Exists}
  next:
    delete: true
"""


def fleet_dir(run: RunDir) -> Path:
    return run.run_dir / "fleet"


def _kwok_argv(run: RunDir, kwok: Path, port: int, kubeconfig: Path) -> list[str]:
    return [
        str(kwok),
        f"--kubeconfig={kubeconfig}",
        f"--config={fleet_dir(run) / 'kwok.yaml'}",
        f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
        "--node-lease-duration-seconds=0",
        "--cidr=10.128.0.0/12",
        "--node-ip=10.127.0.1",
        f"--server-address=127.0.0.1:{port}",
    ]


def _node(name: str, fleet: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                FLEET_LABEL: fleet,
            },
            "annotations": {KWOK_ANNOTATION: "fake"},
        },
    }


def fleet_nodes(kube: Kube) -> list[dict[str, Any]]:
    found = kube.resource("v1", "Node").get(label_selector=FLEET_LABEL, _request_timeout=60)
    items: list[dict[str, Any]] = found.to_dict().get("items") or []
    return items


def _ready_untainted(kube: Kube, count: int) -> tuple[bool, str]:
    """Whether all `count` fake Nodes are Ready; lifts the not-ready taint admission put
    on them (the node-lifecycle controller would too, later)."""
    ready = 0
    for node in fleet_nodes(kube):
        conditions = (node.get("status") or {}).get("conditions") or []
        if not any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
            continue
        taints = (node.get("spec") or {}).get("taints") or []
        kept = [t for t in taints if not t["key"].startswith("node.kubernetes.io/")]
        if len(kept) != len(taints):
            name = node["metadata"]["name"]
            kube.core.patch_node(name, {"spec": {"taints": kept or None}}, _request_timeout=30)
            continue
        ready += 1
    return ready >= count, f"{ready} of {count} fake Nodes Ready without taints"


class KwokFleet:
    """KWOK, the fake Nodes and the fleet publisher of one run."""

    def __init__(self, run: RunDir) -> None:
        self.run = run

    @property
    def state(self) -> dict[str, Any]:
        found = self.run.state().get("fleet")
        return found if isinstance(found, dict) else {}

    def _spawn(self, name: str, argv: list[str]) -> procs.Proc:
        return procs.spawn(
            name,
            argv,
            log=self.run.log(name),
            pid_file=self.run.pid_file(name),
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.run.run_dir)},
            die_with_parent=self.run.die_with_parent,
        )

    def start(
        self, count: int, *, profile: str = DEFAULT_FLEET_PROFILE, timeout: float = 600.0
    ) -> float:
        """KWOK, `count` Nodes Ready, every pool published; seconds taken."""
        started = time.monotonic()
        directory = fleet_dir(self.run)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "kwok.yaml").write_text(STAGES)
        kwok = binaries.ensure_binaries(["kwok"])["kwok"]
        (port,) = free_ports(1)
        self.run.save_state(
            fleet={
                "nodes": count,
                "profile": profile,
                "prefix": NODE_PREFIX,
                "state": "starting",
                "kwok_port": port,
            }
        )
        kubeconfig = self.run.write_kubeconfig(
            "kwok", user="kwok-controller", groups=("system:masters",)
        )
        kwok_proc = self._spawn(KWOK, _kwok_argv(self.run, kwok, port, kubeconfig))
        deadline = time.monotonic() + timeout
        self._wait("kwok /healthz", self._kwok_healthy, deadline, [kwok_proc])
        kube = Kube(self.run.kubeconfig)
        self.run.say(f"creating {count} fake Nodes")
        for i in range(count):
            kube.create(_node(f"{NODE_PREFIX}{i:0{len(str(max(count - 1, 0)))}d}", RELEASE))
        self._wait("fake Nodes Ready", lambda: _ready_untainted(kube, count), deadline, [kwok_proc])
        identity = create_chart_identity(
            kube,
            self.run.kubeconfig,
            component="kubelet-plugin",
            release=RELEASE,
            driver=DRIVER,
            directory=directory,
            expiration_seconds=48 * 3600,
        )
        publisher = self._spawn(
            PUBLISHER,
            [
                sys.executable,
                "-m",
                "tools.fleet",
                f"--kubeconfig={identity.kubeconfig}",
                f"--driver={DRIVER}",
                f"--profile={profile}",
                f"--node-prefix={NODE_PREFIX}",
                f"--count={count}",
                f"--port-file={directory / 'publisher.port'}",
            ],
        )
        self.run.say(f"publishing {count} pools ({profile} each)")
        self._wait(
            "every pool published", lambda: self._published(count), deadline, [kwok_proc, publisher]
        )
        self.run.save_state(fleet={**self.state, "state": "up"})
        return time.monotonic() - started

    def _wait(
        self,
        what: str,
        check: Callable[[], tuple[bool, str]],
        deadline: float,
        watching: list[procs.Proc],
    ) -> None:
        procs.wait_until(
            what,
            check,
            max(deadline - time.monotonic(), 1.0),
            watching=watching,
            log=self.run.log,
            error=ClusterError,
            interval=0.5,
        )

    def _kwok_healthy(self) -> tuple[bool, str]:
        code, body = http_get(f"http://127.0.0.1:{self.state.get('kwok_port')}/healthz", None)
        return code == 200, f"/healthz: {code or body}"

    def publisher_url(self) -> str:
        port = (fleet_dir(self.run) / "publisher.port").read_text().strip()
        return f"http://127.0.0.1:{port}"

    def publisher_status(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.publisher_url()}/status", timeout=10) as r:
            result: dict[str, Any] = json.loads(r.read())
        return result

    def flip(self, node: str, device: str, *, healthy: bool) -> dict[str, Any]:
        """Flip a device's health in the fleet publisher; the writes it took."""
        body = json.dumps({"node": node, "device": device, "healthy": healthy}).encode()
        request = urllib.request.Request(
            f"{self.publisher_url()}/flip",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            result: dict[str, Any] = json.loads(r.read())
        return result

    def _published(self, count: int) -> tuple[bool, str]:
        try:
            status = self.publisher_status()
        except (OSError, ValueError) as err:
            return False, f"publisher not answering: {err}"
        return status["published"] >= count, json.dumps(status)[:300]

    def procs(self) -> list[procs.Proc]:
        found = [procs.read_pid_file(self.run.pid_file(n)) for n in (PUBLISHER, KWOK)]
        return [p for p in found if p is not None]

    def status(self) -> list[tuple[str, int | None, bool, bool, str]]:
        """(name, pid, alive, healthy, detail) of KWOK and the publisher."""
        rows = []
        for name, check in ((KWOK, self._kwok_healthy), (PUBLISHER, self._publisher_check)):
            proc = procs.read_pid_file(self.run.pid_file(name))
            alive = proc is not None and proc.alive()
            healthy, detail = check() if alive else (False, "")
            rows.append((name, proc.pid if proc else None, alive, healthy, detail))
        return rows

    def _publisher_check(self) -> tuple[bool, str]:
        try:
            status = self.publisher_status()
        except (OSError, ValueError) as err:
            return False, str(err)
        ok = status["published"] >= status["nodes"]
        return (
            ok,
            f"{status['published']}/{status['nodes']} pools published, writes {status['writes']}",
        )

    def down(self, *, grace: float) -> list[str]:
        """Stop the publisher and KWOK; what is still running."""
        left = []
        for proc in self.procs():
            if not procs.stop(proc, grace=grace):
                left.append(f"{proc.name} (pid {proc.pid})")
        if self.state:
            self.run.save_state(fleet={**self.state, "state": "down"})
        return left


def published_slices(kube: Kube) -> list[dict[str, Any]]:
    """Every ResourceSlice of the fleet's driver, as the admin reads them."""
    found = kube.resource(RESOURCE, "ResourceSlice").get(
        field_selector=f"spec.driver={DRIVER}", _request_timeout=120
    )
    items: list[dict[str, Any]] = found.to_dict().get("items") or []
    return items

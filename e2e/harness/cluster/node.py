"""A real node beside the control plane: containerd, kubelet and the drasil kubelet plugin.

`Cluster.start_node()` (or `python -m tools.cluster up --with-node`) starts, on this
machine, with everything in the cluster's run directory:

    containerd/            containerd's root (content, snapshots), state and runc dirs
    containerd.sock        its socket (CRI, and `ctr`)
    kubelet ->             kubelet's --root-dir, /var/lib/drasil-e2e/<hash>/ (see
                           KUBELET_ROOT_BASE): plugins_registry/ and plugins/ (the DRA
                           plugin's sockets and checkpoint), pods/ (volumes), pki/
    cdi/                   the plugin's CDI root, one of containerd's cdi_spec_dirs
    pod-logs/              kubelet's podLogsDir (container logs, `kubectl logs`)
    node/                  containerd.toml, kubelet.yaml, CNI config and IPAM state
    device-plugin/         with `start_device_plugin`: the plugin's plugins dir in
                           device-plugin mode (its fault file)
    logs/{containerd,kubelet,drasil-plugin,drasil-device-plugin}.log

Outside it: kubelet's root dir, a cgroup `/drasil-e2e-<run id>` in every cgroup
hierarchy (kubelet's cgroupRoot: the node's Pods live under it and `down` finds every
process), a Linux bridge `drasil<hex>` whose address is the node IP, shim sockets in
/run/containerd/s and kubelet's hard-coded /var/log/containers links and
/var/lib/kubelet/device-plugins socket. `down` removes all of it, unmounts whatever
kubelet and containerd mounted, and checks that no process is left.

The kubelet is a real one: it registers `system:node:<name>` with its own client
certificate (so the Node authorizer and NodeRestriction apply), serves its API on the
node IP with a certificate from the cluster CA (so `kubectl logs/exec` work), and finds
the plugin through its plugin watcher.

Its files and what they say: `e2e.harness.cluster.nodeconfig`; what it changes on the host and
finds again there: `e2e.harness.cluster.host`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from e2e.harness import binaries, node_images, pluginproc, procs, recipes
from e2e.harness.chart import create_chart_identity
from e2e.harness.cluster import host
from e2e.harness.cluster.nodeconfig import (
    DEFAULT_PROFILE,
    NODE_NAME,
    NodeConfig,
    NodeError,
    NodeFiles,
    new_config,
)
from e2e.harness.cluster.rundir import RunDir, http_get
from e2e.harness.kube import Kube

__all__ = ["DEFAULT_PROFILE", "NODE_NAME", "Node", "NodeConfig", "NodeError", "describe"]

NODE_COMPONENTS = ("containerd", "kubelet", "drasil-plugin")
CONTAINERD_PROCESSES = ("containerd", "containerd-shim-runc-v2", "runc", "ctr")
# Logged at -v=3 by kubelet's dra_plugin_manager.go (our --vmodule turns it on).
KUBELET_STARTUP_WIPE = '"Deleted ResourceSlices" logger="DRA registration handler.startup"'
# Host paths kubelet uses whatever its --root-dir (kubelet 1.37 hard-codes them).
CONTAINER_LOG_LINKS = "/var/log/containers"
DEVICE_PLUGIN_SOCKET = "/var/lib/kubelet/device-plugins/kubelet.sock"
DEVICE_CHECKPOINT = "kubelet_internal_checkpoint"  # kubelet's device manager, beside it
NOT_READY_TAINTS = frozenset({"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"})


class Node(NodeFiles):
    """The node of one run. `Node(run)` attaches to the node recorded in the run's
    state (to stop or restart it from another process)."""

    def __init__(self, cluster: RunDir) -> None:
        super().__init__(cluster)
        self._procs: dict[str, procs.Proc] = {}
        self._plugin: pluginproc.PluginProcess | None = None
        self._device_plugin: pluginproc.PluginProcess | None = None

    @property
    def plugin(self) -> pluginproc.PluginProcess:
        """The drasil kubelet plugin beside this kubelet (started, stopped and killed
        through its pid file from any process)."""
        if self._plugin is None:
            self._plugin = self._plugin_process("drasil-plugin", root=self.kubelet_root)
        return self._plugin

    @property
    def device_plugin(self) -> pluginproc.PluginProcess:
        """drasil's plugin in device-plugin mode beside the DRA one, for the same
        simulated GPUs: it serves `drasil.dev/gpu` in kubelet's device-plugins/ dir.
        Started on demand (`start_device_plugin`); its own plugins dir keeps its fault
        file apart from the DRA plugin's."""
        if self._device_plugin is None:
            self._device_plugin = self._plugin_process(
                "drasil-device-plugin", root=self.run_dir / "device-plugin", mode="device-plugin"
            )
        return self._device_plugin

    def _plugin_process(
        self, component: str, *, root: Path, mode: str = "dra"
    ) -> pluginproc.PluginProcess:
        return pluginproc.PluginProcess(
            env={"BOOT_ID_FILE": str(self.boot_id_file)},
            root=root,
            kubeconfig=self.plugin_kubeconfig,
            node_name=self.name,
            profile=self.config.profile,
            cdi_dir=self.cdi_dir,
            log_file=self.log(component),
            pid_file=self.cluster.pid_file(component),
            detach=True,
            die_with_parent=self.cluster.die_with_parent,
            mode=mode,
        )

    @property
    def boot_id_file(self) -> Path:
        """The plugins' boot id (their ``--boot-id-file``): `reboot` writes a new one,
        as a real boot gives the kernel a new one."""
        return self.conf_dir / "boot_id"

    def _new_boot_id(self) -> None:
        self.boot_id_file.write_text(f"{uuid.uuid4()}\n")

    @property
    def plugin_kubeconfig(self) -> Path:
        """The plugin's credentials: a token of the Helm chart's kubelet-plugin service
        account with the chart's RBAC (made by `start`), so that a permission the chart
        lacks fails here before it fails on a user's cluster."""
        return self.run_dir / "plugin.kubeconfig"

    def _make_plugin_identity(self) -> None:
        kube = Kube(self.cluster.kubeconfig)
        directory = self.run_dir / "plugin-identity"
        directory.mkdir(parents=True, exist_ok=True)
        identity = create_chart_identity(
            kube,
            self.cluster.kubeconfig,
            component="kubelet-plugin",
            release="drasil-node",
            driver=pluginproc.DRIVER,
            directory=directory,
            # The node lives as long as its cluster; the API server may cap this.
            expiration_seconds=7 * 24 * 3600,
        )
        identity.kubeconfig.replace(self.plugin_kubeconfig)

    def _proc(self, name: str) -> procs.Proc | None:
        return self._procs.get(name) or procs.read_pid_file(self.cluster.pid_file(name))

    # -- lifecycle ------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        bin_dir = str(self.bin("containerd").parent)
        path = os.environ.get(
            "PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        )
        # containerd finds containerd-shim-runc-v2 on PATH.
        return {"PATH": f"{bin_dir}:{path}", "HOME": str(self.run_dir), "LANG": "C.UTF-8"}

    def _start(self, name: str, argv: Sequence[str]) -> procs.Proc:
        proc = procs.spawn(
            name,
            argv,
            log=self.log(name),
            pid_file=self.cluster.pid_file(name),
            env=self._env(),
            die_with_parent=self.cluster.die_with_parent,
        )
        self._procs[name] = proc
        return proc

    def _wait(self, what: str, check: Callable[[], tuple[bool, str]], timeout: float) -> None:
        procs.wait_until(
            what,
            check,
            timeout,
            watching=self._procs.values(),
            log=self.log,
            error=NodeError,
            interval=0.2,
        )

    def ctr(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """`ctr --address <our socket> -n k8s.io <args>`."""
        return subprocess.run(
            [str(self.bin("ctr")), "--address", str(self.containerd_socket), "-n", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def _containerd_ready(self) -> tuple[bool, str]:
        if not self.containerd_socket.exists():
            return False, "no socket yet"
        done = self.ctr("version", timeout=10)
        return done.returncode == 0, (done.stderr or done.stdout).strip()[-300:]

    def _api(self, path: str) -> tuple[int, Any]:
        """(200, the decoded JSON) of a GET from the API server, else (status, why)."""
        code, body = self.cluster.api_get(path, timeout=5)
        if code != 200:
            return code, body
        try:
            return code, json.loads(body)
        except ValueError as e:
            return 0, str(e)

    def _kubelet_healthy(self) -> tuple[bool, str]:
        url = f"http://127.0.0.1:{self.config.healthz_port}/healthz"
        code, body = http_get(url, None)
        return code == 200, f"/healthz: {code or body}"

    def node_ready(self) -> tuple[bool, str]:
        """The Node object is Ready and carries no not-ready taint."""
        code, node = self._api(f"/api/v1/nodes/{self.name}")
        if code != 200:
            return False, f"GET node: {code} {str(node)[:200]}"
        conditions = {c["type"]: c for c in node.get("status", {}).get("conditions") or []}
        ready = conditions.get("Ready", {})
        taints = [t["key"] for t in node.get("spec", {}).get("taints") or []]
        if ready.get("status") != "True":
            return False, f"Ready={ready.get('status')}: {ready.get('message', '')}"
        if NOT_READY_TAINTS & set(taints):
            return False, f"Ready, still tainted {taints}"
        return True, "Ready"

    def devices_published(self, count: int | None) -> tuple[bool, str]:
        """(whether `count` devices of the plugin are published for this node, detail);
        `count` None: any."""
        code, body = self._api(
            f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName={self.name}"
        )
        if code != 200:
            return False, f"list ResourceSlices: {code}"
        devices = [
            d
            for s in body.get("items", [])
            if s["spec"].get("driver") == pluginproc.DRIVER
            for d in s["spec"].get("devices") or []
        ]
        if count is None:
            return bool(devices), f"{len(devices)} devices published"
        return len(devices) == count, f"{len(devices)} of {count} devices published"

    def startup_wipes(self) -> int:
        """How often a starting kubelet deleted this node's ResourceSlices (it does at
        every start, before any plugin can have registered)."""
        try:
            text = self.log("kubelet").read_text(errors="replace")
        except OSError:
            return 0
        return text.count(KUBELET_STARTUP_WIPE)

    def _wait_startup_wipe(self, *, after: int, timeout: float) -> None:
        # Otherwise the wipe may delete what the plugin has just published.
        self._wait(
            "kubelet's start-up deletion of the node's ResourceSlices",
            lambda: (self.startup_wipes() > after, f"{self.startup_wipes()} wipes logged"),
            timeout,
        )

    def registrations(self) -> int:
        """How often the plugin has been told by kubelet that it is registered."""
        return self.plugin.registrations()

    def wait_plugin_registered(self, *, after: int, timeout: float = 60.0) -> None:
        """Until kubelet's plugin watcher registered the plugin more than `after` times."""
        self.wait_registered(self.plugin, after=after, timeout=timeout)

    def wait_registered(
        self, plugin: pluginproc.PluginProcess, *, after: int, timeout: float = 60.0
    ) -> None:
        """Until kubelet registered `plugin` (either mode) more than `after` times."""
        self._wait(
            f"kubelet to register {plugin.log_path.stem}",
            lambda: (plugin.registrations() > after, f"{plugin.registrations()} registrations"),
            timeout,
        )

    def start(
        self, *, name: str = NODE_NAME, profile: str = DEFAULT_PROFILE, timeout: float = 180.0
    ) -> float:
        """Build what is missing, start containerd, kubelet and the plugin, wait until
        the Node is Ready and the plugin's devices are published; seconds taken."""
        started = time.monotonic()
        out = self.cluster.out
        binaries.ensure_binaries(recipes.NODE_BINARY_NAMES, out=out)
        binaries.ensure_host_tools(["ip"], out=out)
        imgs = node_images.ensure_images(out=out)
        config = new_config(self.cluster, name=name, profile=profile)
        self.cluster.save_state(node={"config": asdict(config), "state": "starting"})
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(deadline - time.monotonic(), 1.0)

        self.write_config(config)
        host.make_cgroups(config.cgroup_root)
        failed = host.make_bridge(config.bridge, config.bridge_address)
        if failed is not None:
            raise NodeError(failed)
        self._say(f"starting containerd ({self.containerd_socket})")
        self._start(
            "containerd",
            [str(self.bin("containerd")), f"--config={self.conf_dir / 'containerd.toml'}"],
        )
        self._wait("containerd to answer", self._containerd_ready, left())
        for image in imgs.values():
            done = self.ctr("images", "import", "--no-unpack=false", str(image.archive))
            if done.returncode != 0:
                done = self.ctr("images", "import", str(image.archive))
            if done.returncode != 0:
                raise NodeError(
                    f"ctr images import {image.archive} failed:\n{done.stderr or done.stdout}"
                )
        self._say(f"starting kubelet for Node {name} (root dir {self.kubelet_root})")
        self._start("kubelet", self.kubelet_argv())
        self._wait("kubelet /healthz", self._kubelet_healthy, left())
        self._wait(f"Node {name} Ready", self.node_ready, left())
        self._wait_startup_wipe(after=0, timeout=left())
        self._say(f"starting the drasil kubelet plugin ({profile}) with the chart's RBAC")
        self._make_plugin_identity()
        self._new_boot_id()
        self.plugin.start(timeout=left())
        self.wait_plugin_registered(after=0, timeout=left())
        count = _profile_size(profile)
        self._wait(
            f"the devices of {name} published",
            lambda: self.devices_published(count),
            left(),
        )
        seconds = time.monotonic() - started
        self.cluster.save_state(
            node={"config": asdict(config), "state": "up", "up_seconds": round(seconds, 2)}
        )
        return seconds

    def _say(self, msg: str) -> None:
        self.cluster.say(msg)

    def stop_kubelet(self) -> None:
        proc = self._proc("kubelet")
        if proc is not None and not procs.stop(proc, grace=10):
            raise NodeError(f"kubelet (pid {proc.pid}) did not stop")
        self._procs.pop("kubelet", None)

    def start_kubelet(self, *, timeout: float = 60.0) -> None:
        """Start kubelet (again) with the same configuration; waits for /healthz and
        for its start-up deletion of the node's ResourceSlices."""
        wipes = self.startup_wipes()
        self._start("kubelet", self.kubelet_argv())
        self._wait("kubelet /healthz", self._kubelet_healthy, timeout)
        self._wait_startup_wipe(after=wipes, timeout=timeout)

    def restart_kubelet(self, *, timeout: float = 60.0) -> None:
        """What a kubelet upgrade or crash looks like to the plugin and the Pods: the
        plugin must be registered again; running Pods keep running."""
        before = self.registrations()
        self.stop_kubelet()
        self.start_kubelet(timeout=timeout)
        self.wait_plugin_registered(after=before, timeout=timeout)

    def restart_plugin_with(
        self,
        env: Mapping[str, str | None],
        *,
        published: int,
        reset_gpus: bool = False,
        timeout: float = 90.0,
    ) -> None:
        """Stop the plugin, change its environment (None removes a variable), start it
        and wait until kubelet registered it and `published` devices are out.

        `reset_gpus` forgets the simulated GPUs' state (MIG mode, instances, time
        slices), as a GPU reset would, so a later static run sees them whole again.
        """
        before = self.registrations()
        self.plugin.stop()
        for name, value in env.items():
            if value is None:
                self.plugin.env.pop(name, None)
            else:
                self.plugin.env[name] = value
        if reset_gpus:
            (self.plugin.state_dir / "simulated-gpus.json").unlink(missing_ok=True)
        self.plugin.start(timeout=timeout)
        self.wait_plugin_registered(after=before, timeout=timeout)
        self._wait(
            f"{published} devices of {self.name} published",
            lambda: self.devices_published(published),
            timeout,
        )

    def restart_plugin(self, *, kill: bool = True, timeout: float = 60.0) -> None:
        """kill -9 (or stop) the plugin and start it again; waits until registered."""
        before = self.registrations()
        if kill:
            self.plugin.kill()
        else:
            self.plugin.stop()
        self.plugin.start(timeout=timeout)
        self.wait_plugin_registered(after=before, timeout=timeout)

    def reboot(self, *, timeout: float = 180.0) -> float:
        """A power cut and a boot, as the node's software meets them; seconds taken.

        Down at once (SIGKILL): kubelet, the plugin, every Pod process, the MPS daemons
        and containerd with its shims. Gone as tmpfs goes: every mount (Pod volumes,
        MPS shm, container rootfs), the CDI dir, containerd's state and runc dirs. A
        new boot id. Kept, as disks keep them: kubelet's root dir, containerd's root,
        the plugin's state dir (checkpoint, simulated GPUs' file). Then containerd,
        kubelet and the plugin start again; kubelet finds the Pods still bound to the
        node and starts them again, preparing their claims anew.
        """
        started = time.monotonic()
        config = self.config
        kubelet = self._proc("kubelet")
        if kubelet is not None:
            kubelet.signal(signal.SIGKILL)
        self.plugin.kill()
        host.kill_cgroup(config.cgroup_root)
        self._kill_mps_daemons()
        containerd = self._proc("containerd")
        if containerd is not None:
            containerd.signal(signal.SIGKILL)
        for proc in (kubelet, containerd):
            if proc is not None and not procs.stop(proc, grace=0):
                raise NodeError(f"{proc.name} (pid {proc.pid}) survived SIGKILL")
        self._procs.clear()
        # Only the node's own (the control plane's binaries share the folder).
        procs.stop_strays(
            self.bin("containerd").parent, self.run_dir, grace=0, names=CONTAINERD_PROCESSES
        )
        left = host.unmount_all(self.run_dir) + host.unmount_all(self.kubelet_root)
        if left:
            raise NodeError(f"still mounted after the power cut: {left}")
        for tmpfs in (self.cdi_dir, self.containerd_dir / "state", self.containerd_dir / "runc"):
            shutil.rmtree(tmpfs, ignore_errors=True)
        self.cdi_dir.mkdir()
        self._new_boot_id()
        self._boot(timeout=timeout)
        return time.monotonic() - started

    def _kill_mps_daemons(self) -> None:
        """Every MPS daemon of the plugin's (host processes with its state dir in
        their arguments; the simulated backend's stand-ins)."""
        mark = str(self.plugin.state_dir / "mps")
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if mark in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    os.kill(int(entry.name), signal.SIGKILL)

    def _boot(self, *, timeout: float) -> None:
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(deadline - time.monotonic(), 1.0)

        before = self.registrations()
        self._start(
            "containerd",
            [str(self.bin("containerd")), f"--config={self.conf_dir / 'containerd.toml'}"],
        )
        self._wait("containerd to answer", self._containerd_ready, left())
        self._start("kubelet", self.kubelet_argv())
        self._wait("kubelet /healthz", self._kubelet_healthy, left())
        self.plugin.start(timeout=left())
        self.wait_plugin_registered(after=before, timeout=left())
        self._wait(f"Node {self.name} Ready", self.node_ready, left())

    # -- device-plugin mode -----------------------------------------------------------

    def extended_resource(self, name: str) -> tuple[int, int]:
        """(capacity, allocatable) of extended resource `name` in the Node's status."""
        code, node = self._api(f"/api/v1/nodes/{self.name}")
        if code != 200:
            raise NodeError(f"GET node {self.name}: {code} {str(node)[:200]}")
        status = node.get("status", {})
        return (
            int(status.get("capacity", {}).get(name, 0)),
            int(status.get("allocatable", {}).get(name, 0)),
        )

    def wait_extended_resource(
        self, name: str, *, capacity: int | None = None, allocatable: int, timeout: float = 60.0
    ) -> None:
        """Until the Node reports `allocatable` (and `capacity`, if given) of `name`."""

        def check() -> tuple[bool, str]:
            cap, alloc = self.extended_resource(name)
            ok = alloc == allocatable and capacity in (None, cap)
            return ok, f"capacity {cap}, allocatable {alloc}"

        want = f"allocatable {allocatable}" + (f", capacity {capacity}" if capacity else "")
        self._wait(f"Node {self.name} to report {name} {want}", check, timeout)

    def check_device_plugin_socket(self) -> None:
        """Our kubelet must own kubelet's hard-coded kubelet.sock: a second node run on
        this machine (a demo, another test session) takes it over when it starts."""
        kubelet = self._proc("kubelet")
        owners = host.socket_owners(Path(DEVICE_PLUGIN_SOCKET))
        if kubelet is None or kubelet.pid not in owners:
            raise NodeError(
                f"{DEVICE_PLUGIN_SOCKET} is served by pid(s) {sorted(owners) or 'none'}, not "
                f"by this node's kubelet ({kubelet.pid if kubelet else 'not running'}): "
                "another node run on this machine took it over (kubelet hard-codes the "
                "path); stop that run first"
            )

    def start_device_plugin(self, *, timeout: float = 60.0) -> None:
        """Start the device plugin and wait until kubelet registered it and the Node
        reports every device as allocatable `drasil.dev/gpu`."""
        self.check_device_plugin_socket()
        self._say(f"starting the drasil device plugin ({pluginproc.GPU_RESOURCE})")
        before = self.device_plugin.registrations()
        self.device_plugin.start(timeout=timeout)
        self.wait_registered(self.device_plugin, after=before, timeout=timeout)
        count = _profile_size(self.config.profile)
        if count is not None:
            self.wait_extended_resource(
                pluginproc.GPU_RESOURCE, capacity=count, allocatable=count, timeout=timeout
            )

    def stop_device_plugin(self, *, timeout: float = 60.0) -> None:
        """Stop it; kubelet then counts none of its devices as allocatable, so
        kube-scheduler serves `drasil.dev/gpu` on this node through DRA again."""
        self.device_plugin.stop()
        self.wait_extended_resource(pluginproc.GPU_RESOURCE, allocatable=0, timeout=timeout)

    def status(self) -> list[tuple[str, int | None, bool, bool, str]]:
        """(component, pid, alive, healthy, detail) of containerd, kubelet, plugin."""
        result = []
        for name in NODE_COMPONENTS:
            proc = self._proc(name)
            alive = proc is not None and proc.alive()
            if not alive:
                result.append((name, proc.pid if proc else None, False, False, ""))
                continue
            if name == "containerd":
                healthy, detail = self._containerd_ready()
                detail = "ctr version: ok" if healthy else detail
            elif name == "kubelet":
                healthy, detail = self._kubelet_healthy()
                if healthy:
                    ready, why = self.node_ready()
                    healthy, detail = ready, f"{detail}, Node {self.name}: {why}"
            else:
                healthy = self.plugin.reg_socket.exists() and self.plugin.dra_socket.exists()
                detail = f"{self.registrations()} registrations with kubelet"
            result.append((name, proc.pid if proc else None, alive, healthy, detail))
        if (dp := self.device_plugin.attached()) is not None:  # only when started
            try:
                cap, alloc = self.extended_resource(pluginproc.GPU_RESOURCE)
                detail = f"{pluginproc.GPU_RESOURCE}: capacity {cap}, allocatable {alloc}"
            except NodeError as e:
                detail = str(e)
            healthy = self.device_plugin.device_plugin_socket.is_socket()
            result.append(("drasil-device-plugin", dp.pid, True, healthy, detail))
        return result

    # -- teardown -------------------------------------------------------------------

    def _clean_host_paths(self) -> None:
        """What kubelet writes to fixed host paths whatever its --root-dir: symlinks to
        container logs in /var/log/containers, and in /var/lib/kubelet/device-plugins
        the registration socket and the device manager's checkpoint (left alone while
        a kubelet serves the socket, and the checkpoint if it names others' resources)."""
        logs = Path(CONTAINER_LOG_LINKS)
        for link in logs.glob("*.log") if logs.is_dir() else ():
            with contextlib.suppress(OSError):
                if link.is_symlink() and os.readlink(link).startswith(f"{self.pod_logs_dir}/"):
                    link.unlink()
        sock = Path(DEVICE_PLUGIN_SOCKET)
        if not host.listening(sock):
            sock.unlink(missing_ok=True)
            if _only_drasil_resources(sock.parent / DEVICE_CHECKPOINT):
                (sock.parent / DEVICE_CHECKPOINT).unlink()
        for d in (logs, sock.parent, sock.parent.parent):
            with contextlib.suppress(OSError):
                d.rmdir()  # only when empty: then nothing else uses it

    def down(self, *, grace: float = 10.0) -> list[str]:
        """Stop kubelet, the plugin, every Pod process and containerd; unmount what
        they mounted under the run dir; remove the node's cgroups and bridge.
        Idempotent. Returns what could not be cleaned up (empty when all is gone)."""
        try:
            config = self.config
        except NodeError:
            return []
        problems = []
        kubelet = self._proc("kubelet")
        if kubelet is not None and not procs.stop(kubelet, grace=grace):
            problems.append(f"kubelet (pid {kubelet.pid})")
        for plugin in (self.plugin, self.device_plugin):
            plugin.stop()
            if plugin.attached() is not None:
                problems.append(plugin.log_path.stem)
        # The Pods' containers and sandboxes.
        stuck = host.kill_cgroup(config.cgroup_root)
        problems += [f"pod process {pid}" for pid in stuck]
        containerd = self._proc("containerd")
        if containerd is not None and not procs.stop(containerd, grace=grace):
            problems.append(f"containerd (pid {containerd.pid})")
        for name in NODE_COMPONENTS:
            proc = self._proc(name)
            if proc is None or not proc.alive():
                self.cluster.pid_file(name).unlink(missing_ok=True)
        self._procs.clear()
        # Shims (and anything else run from our binaries for this run) outlive
        # containerd by design.
        problems += procs.stop_strays(
            self.bin("containerd").parent,
            self.run_dir,
            grace=grace,
            names=CONTAINERD_PROCESSES,
        )
        left_mounted = host.unmount_all(self.run_dir) + host.unmount_all(self.kubelet_root)
        problems += [f"mount {m}" for m in left_mounted]
        if not left_mounted:
            # Pod volumes, kubelet's and the plugin's state: nothing outside the run dir
            # stays behind (the logs, CDI dir and configs are in the run dir).
            shutil.rmtree(self.kubelet_root, ignore_errors=True)
        problems += [f"cgroup {c}" for c in host.remove_cgroups(config.cgroup_root)]
        host.delete_bridge(config.bridge)
        self._clean_host_paths()
        raw = self.cluster.state().get("node") or {}
        self.cluster.save_state(node={**raw, "state": "down"})
        return problems


def _only_drasil_resources(checkpoint: Path) -> bool:
    """Whether kubelet's device-manager checkpoint names only drasil.dev/* resources,
    so that it was written for our device plugin, not for a real kubelet's."""
    try:
        data = json.loads(checkpoint.read_text()).get("Data") or {}
    except (OSError, ValueError):
        return False
    names = set(data.get("RegisteredDevices") or {})
    names |= {e.get("ResourceName", "") for e in data.get("PodDeviceEntries") or []}
    return all(n.startswith("drasil.dev/") for n in names)


def _profile_size(profile: str) -> int | None:
    """How many devices a simulated profile such as `h100-80gb:8,l4:2` publishes; None
    for MIG profiles (their partitions add devices)."""
    total = 0
    for part in profile.split(","):
        name, _, count = part.partition(":")
        if "mig" in name:
            return None
        total += int(count or 1)
    return total


def describe(node: Node) -> str:
    """Where things are, for the CLI and the demo."""
    cfg = node.config
    ctr = f"{node.bin('ctr')} --address {node.containerd_socket} -n k8s.io"
    lines = [
        f"node {cfg.name}: kubelet root {node.kubelet_root}, cgroup /{cfg.cgroup_root}, "
        f"Pod network {cfg.subnet} on bridge {cfg.bridge}",
        f"  plugin sockets: {node.plugin.reg_socket}, {node.plugin.dra_socket}",
        f"  CDI specs: {node.cdi_dir}; checkpoint: {node.plugin.state_dir / 'checkpoint'}",
        f"  containers: {ctr} containers ls",
    ]
    if node.device_plugin.running():
        dp = node.device_plugin
        lines.append(
            f"  device plugin: {dp.device_plugin_socket} ({pluginproc.GPU_RESOURCE}); "
            f"faults: drasil fault inject gpu-3 --plugins-dir {dp.plugins_dir}"
        )
    return "\n".join(lines)

"""The NVIDIA driver's files and hooks in drasil's specs, checked two ways.

1. **NVIDIA's generator as the oracle.** On fake driver roots of several layouts
   (`e2e.harness.driverroot`: ELF libraries with the real SONAMEs, `ldconfig -r`, firmware,
   utilities, sockets), the host files drasil mounts, the links and ld cache folders its
   hooks make and its hooks' arguments equal what `nvidia-ctk cdi generate
   --mode=management` (built from the toolkit's Go module, `e2e.harness.nvidiatoolkit`) writes
   for the same root. Device nodes aside: drasil's are per device.
2. **On the real node** (kubelet, containerd, runc): the plugin runs with a fake driver
   root and the real `nvidia-cdi-hook`; a glibc container (`versions.PROBE_IMAGE`) runs
   `gpu-probe`, which `dlopen`s `libcuda.so.1` and `libnvidia-ml.so.1` by SONAME and calls
   into them. One claim, two claims in one container, an MPS share, and a driver
   upgraded under the running plugin.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from drasil.driver.cdi.spec import common_edits_dict, validate_spec
from drasil.driver.nvidia.driveredits import control_edits, driver_edits
from drasil.driver.nvidia.driveredits import merged as merged_edits
from drasil.driver.nvidia.driverfiles import DriverRoot, find_driver_files
from drasil.kubeletplugin.gpucheck import cdicheck
from e2e.harness import mocknvml, versions
from e2e.harness.cluster.node import Node
from e2e.harness.driverroot import FakeRoot, build_fake_root, upgrade_fake_root
from e2e.harness.kube import RESOURCE, Kube, NotYet, wait_for
from e2e.harness.nvidiatoolkit import (
    VOID_MOUNT_HOST_PATH,
    cdi_hook_path,
    reference_run,
    reference_spec,
)
from e2e.harness.pluginproc import DRIVER
from e2e.harness.pods import (
    POD_TIMEOUT,
    cdi_spec,
    delete_pod,
    node_events,
    prepared_in,
    template,
)

GPUS = 8  # the node's default profile
LAYOUTS = ("debian", "operator", "rhel", "no-ldcache", "leftovers", "custom-dir")
NEWER = "590.44.01"


# -- 1. the oracle -----------------------------------------------------------------------


def _summary(edits: Mapping[str, Any]) -> dict[str, Any]:
    """What must agree: mounts (host path -> container path, options), the variables,
    and the hooks in order, each with order-free arguments. Device nodes are left out."""
    mounts = {
        m["hostPath"]: (m["containerPath"], tuple(m.get("options") or ()))
        for m in edits.get("mounts") or []
    }
    hooks: list[tuple[str, dict[str, Any]]] = []
    for hook in edits.get("hooks") or []:
        command, args = hook["args"][1], hook["args"][2:]
        paired = command in ("create-symlinks", "update-ldcache")
        value = sorted(zip(args[::2], args[1::2], strict=True)) if paired else args
        detail = {
            "path": hook["path"],
            "hookName": hook["hookName"],
            "argv0": hook["args"][0],
            "args": value,
            "env": hook.get("env"),
        }
        hooks.append((command, detail))
    return {"mounts": mounts, "hooks": hooks, "env": sorted(edits.get("env") or [])}


# The generator's hooks drasil does not write, by mode, and why:
# - chmod (management): folder permissions of its device nodes; drasil's are per device;
# - apply-cuda-memory-limits (nvml): one per device, not spec-wide; drasil's memory
#   limits are its shares' own (docs/sharing.md);
# - update-application-profile (nvml): a hook of nvidia-cdi-hook 1.20 (EGL's visible
#   GPUs); a node with an older toolkit (NVIDIA's DRA driver pins 1.19) would fail every
#   container on the unknown command.
NOT_WRITTEN = {
    "management": ("chmod",),
    "nvml": ("apply-cuda-memory-limits", "update-application-profile"),
}
NVML_PROFILE = "h100-80gb:1"


def _oracle(fake: FakeRoot, hook: Path, mode: str = "management") -> dict[str, Any]:
    """NVIDIA's spec of `fake` in `mode`, spec-wide and per-device edits merged. nvml
    mode (NVIDIA's DRA driver's) needs the root's NVML to list GPUs: the root gets the
    mock NVML of one H100 first (it stays)."""
    if mode == "nvml":
        node = mocknvml.make_mock_node(fake.root.parent / "mock", NVML_PROFILE, node_name="n")
        mocknvml.install_mock(fake.host(f"{fake.lib_dirs[0]}/libnvidia-ml.so.{fake.version}"), node)
        run = reference_run(fake.root, hook_path=hook, mode=mode, require_fake_nvml=False)
        # The mock answered (not some NVML of this machine): its GPU is the spec's device.
        assert {d["name"] for d in run.spec["devices"]} >= {node.gpus[0].uuid}
        spec = run.spec
    else:
        spec = reference_spec(fake.root, hook_path=hook, env=fake.env())
    merged: dict[str, list[Any]] = {"mounts": [], "hooks": [], "env": []}
    for edits in [spec.get("containerEdits") or {}] + [
        d["containerEdits"] for d in spec["devices"]
    ]:
        for key in merged:
            merged[key] += edits.get(key) or []
    merged["hooks"] = [h for h in merged["hooks"] if h["args"][1] not in NOT_WRITTEN[mode]]
    if mode == "management":
        # Management mode alone leaves out disable-device-node-modification (its
        # containers manage every GPU); per-device specs (nvml mode, NVIDIA's DRA driver,
        # drasil) carry it after update-ldcache, with the same path and env.
        ldcache = next(h for h in merged["hooks"] if h["args"][1] == "update-ldcache")
        merged["hooks"].append(
            {**ldcache, "args": [ldcache["args"][0], "disable-device-node-modification"]}
        )
    return _summary(merged)


def _drasil(fake: FakeRoot, hook: Path, *, host: str | None = None) -> dict[str, Any]:
    """drasil's spec-wide edits of `fake`: the control edits (device nodes aside: the
    void marker) and the driver's."""
    root = DriverRoot(host=host or str(fake.root), local=fake.root)
    files = find_driver_files(root, fake.version)
    edits = merged_edits(control_edits(()), driver_edits(files, root, hook_path=str(hook)))
    return _summary(common_edits_dict(edits))


@pytest.fixture(scope="module")
def hook() -> Path:
    return cdi_hook_path()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_drasil_mounts_and_hooks_what_nvidias_generator_does(
    layout: str, tmp_path: Path, hook: Path
) -> None:
    """Against both modes the generator runs in without a GPU of ours: management, and
    nvml (over the mock NVML), NVIDIA's DRA driver's. The void marker, by variable and
    by mount, is in both; the GBM backend link only in nvml mode, in a hook of its own
    before the driver's create-symlinks."""
    fake = build_fake_root(tmp_path / "root", layout=layout, dev_nodes=True)
    ours = _drasil(fake, hook)
    management = _oracle(fake, hook)
    nvml = _oracle(fake, hook, "nvml")
    for theirs in (management, nvml):
        assert ours["mounts"] == theirs["mounts"]
        assert ours["env"] == theirs["env"]
    assert ours["hooks"] == nvml["hooks"]
    (gbm, *rest) = ours["hooks"]
    assert rest == management["hooks"]
    assert gbm[0] == "create-symlinks"
    lib = fake.lib_dirs[0]
    assert gbm[1]["args"] == [
        ("--link", f"../libnvidia-allocator.so.1::{lib}/gbm/nvidia-drm_gbm.so")
    ]
    void = ("/var/run/nvidia-container-devices/void", ("ro", "nosuid", "nodev", "bind"))
    assert ours["mounts"][VOID_MOUNT_HOST_PATH] == void
    assert "NVIDIA_VISIBLE_DEVICES=void" in ours["env"]
    # And the oracle is not vacuous: the current version's files, none of an older one.
    assert {p for p, _ in ours["mounts"].values()} >= set(fake.libraries) | set(fake.firmware)
    assert not {p for p, _ in ours["mounts"].values()} & set(fake.old_libraries)


def test_a_root_seen_at_another_path_is_written_with_host_paths(tmp_path: Path, hook: Path) -> None:
    fake = build_fake_root(tmp_path / "root", layout="operator", dev_nodes=True)
    theirs = _oracle(fake, hook)
    ours = _drasil(fake, hook, host="/run/nvidia/driver")
    expected = {
        "/run/nvidia/driver" + host.removeprefix(str(fake.root)): mount
        for host, mount in theirs["mounts"].items()
        if host != VOID_MOUNT_HOST_PATH
    }
    expected[VOID_MOUNT_HOST_PATH] = theirs["mounts"][VOID_MOUNT_HOST_PATH]
    assert ours["mounts"] == expected


# -- 2. on the node ----------------------------------------------------------------------


PROBE = "gpu-probe > /tmp/probe.json; cat /tmp/probe.json; echo; sleep 3600"


@pytest.fixture(scope="module")
def driver_root(node: Node, hook: Path) -> Iterator[FakeRoot]:
    """A fake Debian driver root on the node, and the plugin restarted to use it."""
    where = node.run_dir / "driver-root"
    shutil.rmtree(where, ignore_errors=True)
    fake = build_fake_root(where, layout="debian")
    node.restart_plugin_with(
        {"NVIDIA_DRIVER_ROOT": str(fake.root), "NVIDIA_CDI_HOOK_PATH": str(hook)}, published=GPUS
    )
    yield fake
    node.restart_plugin_with(
        {"NVIDIA_DRIVER_ROOT": None, "NVIDIA_CDI_HOOK_PATH": None}, published=GPUS
    )
    shutil.rmtree(where, ignore_errors=True)


def _probe_pod(
    kube: Kube, namespace: str, node: Node, claims: Mapping[str, str], *, extra: str = ""
) -> str:
    """A Pod of the probe image whose one container uses every claim (name -> template)."""
    name = f"probe-{len(claims)}-{abs(hash(tuple(claims.values()))) % 10**6}"
    container = {
        "name": "c",
        "image": versions.PROBE_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", extra + PROBE],
        "resources": {"claims": [{"name": n} for n in claims]},
    }
    spec = {
        "nodeSelector": {"kubernetes.io/hostname": node.name},
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "containers": [container],
        "resourceClaims": [{"name": n, "resourceClaimTemplateName": t} for n, t in claims.items()],
    }
    kube.create(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}, namespace
    )
    return name


def _probe_result(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    def printed() -> Any:
        pod = kube.get("v1", "Pod", name, namespace)
        if pod["status"].get("phase") not in ("Running", "Succeeded", "Failed"):
            return NotYet(pod["status"])
        log = kube.core.read_namespaced_pod_log(name, namespace, container="c")
        line = next((x for x in log.splitlines() if x.startswith("{")), None)
        return json.loads(line) if line else NotYet(log)

    result: dict[str, Any] = wait_for(printed, timeout=POD_TIMEOUT, what=f"the probe of {name}")
    return result


def _claim_uids(kube: Kube, namespace: str, name: str) -> list[str]:
    statuses = kube.get("v1", "Pod", name, namespace)["status"].get("resourceClaimStatuses") or []
    return [
        kube.get(RESOURCE, "ResourceClaim", s["resourceClaimName"], namespace)["metadata"]["uid"]
        for s in statuses
    ]


def _assert_loaded(result: Mapping[str, Any], version: str) -> None:
    assert "error" not in result, result
    assert result["cuInit"] == 0
    assert result["nvmlInit"] == 0
    assert result["driverVersion"] == version
    assert result["libcuda"].startswith("/usr/lib/x86_64-linux-gnu/libcuda.so")
    assert result["libnvml"].startswith("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so")


def _assert_valid_cdi(spec: Mapping[str, Any]) -> None:
    """The official CDI JSON Schema, then drasil's own rules."""
    cdicheck.schema_validator().validate(spec)
    validate_spec(spec)


def test_a_cuda_program_loads_the_driver_by_soname(
    kube: Kube, ns: str, node: Node, driver_root: FakeRoot
) -> None:
    lib = driver_root.lib_dirs[0]
    # What the real hooks and runtime made: GBM's backend link (resolving to the driver's
    # allocator) and the void marker, /dev/null's character device (1,3).
    looks = (
        f"echo gbm=$(readlink {lib}/gbm/nvidia-drm_gbm.so)"
        f"=$(readlink -f {lib}/gbm/nvidia-drm_gbm.so)"
        " void=$(stat -c %t,%T /var/run/nvidia-container-devices/void); "
    )
    name = _probe_pod(kube, ns, node, {"gpu": template(kube, ns)}, extra=looks)
    _assert_loaded(_probe_result(kube, ns, name), driver_root.version)
    log = kube.core.read_namespaced_pod_log(name, ns, container="c")
    allocator = f"{lib}/libnvidia-allocator.so.{driver_root.version}"
    assert f"gbm=../libnvidia-allocator.so.1={allocator} void=1,3" in log
    (uid,) = _claim_uids(kube, ns, name)
    spec = json.loads(cdi_spec(node, uid).read_text())
    _assert_valid_cdi(spec)
    hosts = {m["hostPath"] for m in spec["containerEdits"]["mounts"]}
    assert {str(driver_root.host(p)) for p in driver_root.libraries} <= hosts
    assert [h["args"][1] for h in spec["containerEdits"]["hooks"]] == [
        "create-symlinks",  # the graphics links
        "create-symlinks",
        "enable-cuda-compat",
        "update-ldcache",
        "disable-device-node-modification",
    ]


def test_two_claims_in_one_container_run_the_hooks_twice_harmlessly(
    kube: Kube, ns: str, node: Node, driver_root: FakeRoot
) -> None:
    claims = {"a": template(kube, ns), "b": template(kube, ns)}
    name = _probe_pod(kube, ns, node, claims)
    _assert_loaded(_probe_result(kube, ns, name), driver_root.version)
    assert len(_claim_uids(kube, ns, name)) == 2


SHARED_CLASS = f"shared-driver-files.{DRIVER}"


def test_an_mps_share_gets_the_driver_and_its_daemons_pipe(
    kube: Kube, ns: str, node: Node, driver_root: FakeRoot
) -> None:
    attrs = f'device.attributes["{DRIVER}"]'
    selector = (
        f'device.driver == "{DRIVER}" && {attrs}.type == "gpu" && device.allowMultipleAllocations'
    )
    kube.delete(RESOURCE, "DeviceClass", SHARED_CLASS)
    kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "DeviceClass",
            "metadata": {"name": SHARED_CLASS},
            "spec": {"selectors": [{"cel": {"expression": selector}}]},
        }
    )
    node.restart_plugin_with({"GPU_SHARING": "consumable"}, published=GPUS)
    name = ""
    try:
        share = [
            {
                "name": "gpu",
                "exactly": {
                    "deviceClassName": SHARED_CLASS,
                    "capacity": {"requests": {"memory": "10Gi"}},
                },
            }
        ]
        name = _probe_pod(
            kube,
            ns,
            node,
            {"gpu": template(kube, ns, requests=share)},
            extra='test -n "$CUDA_MPS_PIPE_DIRECTORY" && ',
        )
        _assert_loaded(_probe_result(kube, ns, name), driver_root.version)
        (uid,) = _claim_uids(kube, ns, name)
        spec = json.loads(cdi_spec(node, uid).read_text())
        _assert_valid_cdi(spec)
        device_mounts = [
            m["containerPath"]
            for d in spec["devices"]
            for m in d["containerEdits"].get("mounts", [])
        ]
        assert device_mounts, "the share's MPS pipe is mounted per device"
    finally:
        if name:  # unprepared (its daemon gone) before the plugin leaves consumable mode
            delete_pod(kube, ns, name)
            wait_for(
                lambda: not prepared_in(node, ns) or NotYet(prepared_in(node, ns)),
                timeout=POD_TIMEOUT,
                what="the share unprepared",
            )
        node.restart_plugin_with({"GPU_SHARING": None}, published=GPUS)
        kube.delete(RESOURCE, "DeviceClass", SHARED_CLASS)


def test_drasil_doctor_on_the_node(driver_root: FakeRoot, hook: Path) -> None:
    args = ["--backend", "simulated", "--nvidia-driver-root", str(driver_root.root)]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "drasil.driver.cli",
            "doctor",
            *args,
            "--nvidia-cdi-hook-path",
            str(hook),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok    cdi hook" in done.stdout
    assert "ok    driver files" in done.stdout


def test_a_node_without_the_hook_says_so_in_a_node_event(
    kube: Kube, node: Node, driver_root: FakeRoot, hook: Path
) -> None:
    # No hook given and none in the "image": specs could carry no hooks.
    missing = str(node.run_dir / "no-such-hook")
    node.restart_plugin_with(
        {"NVIDIA_CDI_HOOK_PATH": None, "DRASIL_BUNDLED_CDI_HOOK": missing}, published=GPUS
    )
    try:
        messages = node_events(kube, node.name, "GPUDriverNotReady")
        assert any("no nvidia-cdi-hook" in m for m in messages), messages
    finally:
        node.restart_plugin_with(
            {"NVIDIA_CDI_HOOK_PATH": str(hook), "DRASIL_BUNDLED_CDI_HOOK": None}, published=GPUS
        )


def test_a_driver_upgraded_under_the_plugin_gives_new_claims_the_new_files(
    kube: Kube, ns: str, node: Node, driver_root: FakeRoot
) -> None:
    before = _probe_pod(kube, ns, node, {"gpu": template(kube, ns)})
    _assert_loaded(_probe_result(kube, ns, before), driver_root.version)
    upgrade_fake_root(driver_root, NEWER)  # as a package upgrade replaces the files
    after = _probe_pod(kube, ns, node, {"gpu": template(kube, ns)})
    _assert_loaded(_probe_result(kube, ns, after), NEWER)
    (uid,) = _claim_uids(kube, ns, after)
    spec = json.loads(cdi_spec(node, uid).read_text())
    for mount in spec["containerEdits"]["mounts"]:
        assert Path(mount["hostPath"]).exists(), mount
        assert driver_root.version not in mount["hostPath"], mount

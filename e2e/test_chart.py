"""The Helm chart (charts/drasil): lint, template, schema, and a server-side dry-run of
everything it renders against the real API server.

Rendered with the default values and with each values file in charts/drasil/ci/
(non-default-values.yaml changes every value the chart lets change; device-plugin-values.yaml
is the no-DRA mode with the nvml backend and the deprecated nvml.driverRoot;
nvml-values.yaml is DRA mode on GPU Operator nodes). The DaemonSet's command line and
environment are parsed by the kubelet plugin's own option parser, so a flag the plugin
does not know fails here, not on a node.
"""

from __future__ import annotations

import importlib.util
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from drasil.driver.nvidia.nodelabels import OWN_KEY
from drasil.kubeletplugin.options import PluginOptions, parse_options
from e2e.harness import paths
from e2e.harness.chart import (
    CHART,
    CRD,
    RELEASE,
    crd_installed,
    dump,
    helm,
    kubectl_run,
    render,
    values_args,
)
from e2e.harness.kube import Kube

REPO = paths.CHECKOUT
VALUES_FILES: dict[str, Path | None] = {
    "default": None,
    **{p.stem: p for p in sorted((CHART / "ci").glob("*.yaml"))},
}
# Kinds the local cluster does not serve; rendered objects of these kinds are checked
# structurally instead of by the API server (no Prometheus operator runs here).
NOT_SERVED_HERE = {"monitoring.coreos.com/v1/ServiceMonitor"}


def gvk(obj: dict[str, Any]) -> str:
    return f"{obj['apiVersion']}/{obj['kind']}"


def by_kind(objs: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: Iterable[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objs, kind)
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]


def load_values(values_file: Path | None) -> dict[str, Any]:
    """The chart's defaults overlaid with a values file, as helm merges them."""

    def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in over.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value)
            else:
                out[key] = value
        return out

    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    if values_file is not None:
        values = merge(values, yaml.safe_load(values_file.read_text()) or {})
    return values


VALUES_PARAMS = [pytest.param(path, id=name) for name, path in VALUES_FILES.items()]


# ---- lint and template -------------------------------------------------------------


@pytest.mark.parametrize("values_file", VALUES_PARAMS)
def test_helm_lint_strict(values_file: Path | None) -> None:
    result = helm("lint", "--strict", str(CHART), *values_args(values_file))
    assert "0 chart(s) failed" in result.stdout, result.stdout
    assert "[ERROR]" not in result.stdout, result.stdout
    assert "[WARNING]" not in result.stdout, result.stdout


def mps_daemons(values: dict[str, Any]) -> bool:
    """Whether the plugin runs MPS daemons (docs/sharing.md): for shares of consumable
    GPUs, and for devices allocated whole with mps.enabled or NVIDIA's preset."""
    wanted = values["gpuSharing"] == "consumable" or values["mps"].get("enabled", False)
    wanted = wanted or values.get("compatibility") == "nvidia-dra"
    return values["mode"] == "dra" and bool(wanted)


@pytest.mark.parametrize("values_file", VALUES_PARAMS)
def test_template_renders_both_daemons_as_documented(values_file: Path | None) -> None:
    values = load_values(values_file)
    objs = render(namespace="drasil-system", values_file=values_file)
    kinds = sorted(gvk(o) for o in objs)
    dra = values["mode"] == "dra"
    controller = values["controller"]["enabled"]
    expected = ["apps/v1/DaemonSet", "v1/Service", "v1/ServiceAccount"]
    if dra:
        expected += ["rbac.authorization.k8s.io/v1/ClusterRole"]
        expected += ["rbac.authorization.k8s.io/v1/ClusterRoleBinding"]
        if mps_daemons(values):  # the MPS daemon Pods, in its namespace
            expected += ["rbac.authorization.k8s.io/v1/Role"]
            expected += ["rbac.authorization.k8s.io/v1/RoleBinding"]
    if controller:
        expected += [
            "apps/v1/Deployment",
            "rbac.authorization.k8s.io/v1/ClusterRole",
            "rbac.authorization.k8s.io/v1/ClusterRoleBinding",
            "v1/Service",
            "v1/ServiceAccount",
        ]
        if values["controller"]["leaderElect"]:
            expected += ["rbac.authorization.k8s.io/v1/Role"]
            expected += ["rbac.authorization.k8s.io/v1/RoleBinding"]
    if values["deviceClasses"]["create"]:
        # NVIDIA 3, AMD 2, any-gpu, vfio, and one per MIG profile listed
        classes = 7 + len(values["deviceClasses"]["migProfiles"])
        expected += ["resource.k8s.io/v1/DeviceClass"] * classes
    if values["validatingAdmissionPolicy"]["enabled"]:
        labels = values["nodeLabels"]
        patches_node = dra and labels["names"] != "off" and not labels["nfdFeaturesDir"]
        policies = int(dra) + int(controller) + int(patches_node)
        expected += ["admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"] * policies
        expected += ["admissionregistration.k8s.io/v1/ValidatingAdmissionPolicyBinding"] * policies
    if values["serviceMonitor"]["enabled"]:
        expected += ["monitoring.coreos.com/v1/ServiceMonitor"]
    assert kinds == sorted(expected)
    for obj in objs:
        if obj["kind"] not in ("ClusterRole", "ClusterRoleBinding", "DeviceClass") and not obj[
            "kind"
        ].startswith("ValidatingAdmissionPolicy"):
            assert obj["metadata"]["namespace"] == "drasil-system", obj["metadata"]


def _plain_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _api_server_env(values: dict[str, Any]) -> dict[str, str]:
    """apiServer.host/port become the variables in-cluster clients read."""
    api = values["apiServer"]
    if not api["host"]:
        return {}
    return {"KUBERNETES_SERVICE_HOST": api["host"], "KUBERNETES_SERVICE_PORT": str(api["port"])}


def driver_root(values: dict[str, Any]) -> str:
    """The host's driver root the values say: nvidiaDriverRoot, or the deprecated
    nvml.driverRoot where that is set and nvidiaDriverRoot is left at "/"."""
    old = values["nvml"].get("driverRoot")
    root = str(values["nvidiaDriverRoot"])
    return str(old) if old and root == "/" else root


def _plugin_container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    ds = one(objs, "DaemonSet")
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    return dict(container)


@pytest.mark.parametrize("values_file", VALUES_PARAMS)
def test_daemonset_rolls_one_node_at_a_time_with_host_dirs_and_probes(
    values_file: Path | None,
) -> None:
    values = load_values(values_file)
    plugin = values["kubeletPlugin"]
    objs = render(namespace="drasil-system", values_file=values_file)
    ds = one(objs, "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    per_pod = plugin["podUidInSocketNames"]
    surge = per_pod and not plugin["hostNetwork"]  # no two Pods on one host port
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}
        if surge
        else {"maxSurge": 0, "maxUnavailable": 1},
    }
    assert spec["priorityClassName"] == plugin["priorityClassName"]
    assert spec["nodeSelector"]["kubernetes.io/os"] == "linux"
    assert spec["automountServiceAccountToken"] is (values["mode"] == "dra")
    container = _plugin_container(objs)
    assert container["command"] == ["drasil-kubelet-plugin"]
    env = {
        e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        for e in container["env"]
    }
    assert env["NODE_NAME"] == "spec.nodeName"
    assert env.get("POD_UID") == ("metadata.uid" if per_pod else None)
    plain = _plain_env(container)
    api_env = _api_server_env(values) if values["mode"] == "dra" else {}
    assert {k: v for k, v in plain.items() if k.startswith("KUBERNETES_")} == api_env
    assert spec.get("hostNetwork", False) is plugin["hostNetwork"]

    # Host dirs are mounted at their own path: kubelet dials the registered socket paths.
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    host = {
        name: (volumes[name]["hostPath"]["path"], mounts[name]["mountPath"])
        for name in volumes
        if "hostPath" in volumes[name] and name not in ("driver-root", "host-dev")
    }
    state_dir = f"{plugin['pluginsDir'].rstrip('/')}/{values['driverName']}"
    expected = {"state-dir": state_dir, "cdi-root": plugin["cdiRoot"]}
    if values["mode"] == "dra":
        expected["registrar-dir"] = plugin["registrarDir"]
        if values["nodeLabels"]["nfdFeaturesDir"]:
            expected["nfd-features"] = values["nodeLabels"]["nfdFeaturesDir"]
    else:
        expected["device-plugins-dir"] = plugin["devicePluginsDir"]
    assert host == {name: (path, path) for name, path in expected.items()}

    # The NVIDIA driver's files (backend nvml): the host's driver root read-only at
    # /driver-root, with HostToContainer propagation so that a driver container started
    # after the plugin is seen; the plugin is told both paths.
    driver_env = {"NVIDIA_DRIVER_ROOT", "CONTAINER_DRIVER_ROOT"}
    if values["backend"] == "nvml":
        root = driver_root(values)
        assert volumes["driver-root"]["hostPath"] == {"path": root, "type": "DirectoryOrCreate"}
        assert mounts["driver-root"] == {
            "name": "driver-root",
            "mountPath": "/driver-root",
            "readOnly": True,
            "mountPropagation": "HostToContainer",
        }
        assert plain["NVIDIA_DRIVER_ROOT"] == root
        assert plain["CONTAINER_DRIVER_ROOT"] == "/driver-root"
        # NVML is loaded from the root by path: the host's libc must not reach Python.
        assert "LD_LIBRARY_PATH" not in plain
    else:
        assert "driver-root" not in volumes
        assert "driver-root" not in mounts
        assert not driver_env & plain.keys()
    assert plain["CDI_HOOKS"] == values["cdiHooks"]
    assert plain.get("NVIDIA_CDI_HOOK_PATH") == (values["nvidiaCDIHookPath"] or None)
    _check_passthrough(values, spec, container, volumes, mounts)

    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": plugin["metricsPort"], "health": plugin["healthPort"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] == "health", probe
        assert get["path"] in ("/healthz", "/readyz"), probe

    security = container["securityContext"]
    shares = mps_daemons(values)
    # MPS daemons: the plugin mounts each daemon's tmpfs under its state dir, which the
    # host must see (docs/sharing.md).
    assert mounts["state-dir"].get("mountPropagation") == ("Bidirectional" if shares else None)
    if (values["backend"] == "nvml" and values["nvml"]["privileged"]) or shares:
        assert security["privileged"] is True
    else:
        assert security["privileged"] is False
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["runAsUser"] == 0  # root-owned kubelet dirs; see docs/helm.md
    assert security["readOnlyRootFilesystem"] is True


def _check_passthrough(
    values: dict[str, Any],
    spec: dict[str, Any],
    container: dict[str, Any],
    volumes: dict[str, Any],
    mounts: dict[str, Any],
) -> None:
    """Passthrough on real GPUs: the node's processes (hostPID), the host's /dev read-only
    with HostToContainer (udev's /dev/vfio/<group> after a bind), and privileged."""
    on = values["mode"] == "dra" and values["passthrough"]["enabled"]
    real = on and values["backend"] == "nvml"
    assert ("--passthrough" in container["args"]) is on
    assert spec.get("hostPID", False) is real
    if not real:
        assert "host-dev" not in volumes
        return
    assert volumes["host-dev"]["hostPath"] == {"path": "/dev", "type": "Directory"}
    assert mounts["host-dev"] == {
        "name": "host-dev",
        "mountPath": "/host-dev",
        "readOnly": True,
        "mountPropagation": "HostToContainer",
    }
    assert _plain_env(container)["VFIO_DEV_ROOT"] == "/host-dev"
    assert container["securityContext"]["privileged"] is True


@pytest.mark.parametrize("values_file", VALUES_PARAMS)
def test_daemonset_command_line_is_accepted_by_the_plugin(values_file: Path | None) -> None:
    """The flags and variables the chart passes are the plugin's own
    (kubeletplugin/options.py), and they say what the values say."""
    values = load_values(values_file)
    plugin = values["kubeletPlugin"]
    container = _plugin_container(render(namespace="ns", values_file=values_file))
    downward = {"spec.nodeName": "node-1", "metadata.uid": "uid-1", "metadata.namespace": "ns"}
    env = {
        e["name"]: downward[e["valueFrom"]["fieldRef"]["fieldPath"]]
        for e in container["env"]
        if "valueFrom" in e
    }
    env |= _plain_env(container)
    opts = parse_options(container["args"], env=env)
    assert opts.node_name == "node-1"
    assert opts.pod_uid == ("uid-1" if plugin["podUidInSocketNames"] else None)
    assert opts.driver_name == values["driverName"]
    assert opts.mode == values["mode"]
    assert opts.backend == values["backend"]
    if values["backend"] == "simulated":
        assert opts.simulated_profile == values["simulatedProfile"]
    assert str(opts.plugins_dir) == plugin["pluginsDir"]
    assert str(opts.cdi_root) == plugin["cdiRoot"]
    assert opts.log_format == values["logFormat"]
    assert opts.verbosity == values["verbosity"]
    assert opts.metrics_addr == f":{plugin['metricsPort']}"
    assert opts.health_addr == f":{plugin['healthPort']}"
    if values["backend"] == "nvml":
        assert opts.driver_root_host == driver_root(values)
        assert opts.driver_root_local == Path("/driver-root")
    else:  # simulated GPUs get no driver files
        assert opts.nvidia_driver_root is None
    assert opts.nvidia_cdi_hook_path == (values["nvidiaCDIHookPath"] or None)
    assert opts.cdi_hooks == values["cdiHooks"]
    if values["mode"] == "dra":
        assert str(opts.registrar_dir) == plugin["registrarDir"]
        assert opts.gpu_sharing == values["gpuSharing"]
        assert opts.mps_multiuser == values["mps"]["multiUser"]
        assert opts.mps_whole_devices == mps_daemons(values)
        assert opts.device_plugin_resources == tuple(plugin["devicePluginResources"])
        hosts = {k: str(v) for k, v in plugin["hostResourcesPerGpu"].items()}
        assert dict(opts.host_resources_per_gpu) == hosts
        assert opts.node_labels == values["nodeLabels"]["names"]
        nfd = values["nodeLabels"]["nfdFeaturesDir"]
        assert opts.nfd_features_dir == (Path(nfd) if nfd else None)
        _check_mps_daemon_pods(opts, values, container["image"])
    else:
        assert str(opts.device_plugins_dir) == plugin["devicePluginsDir"]
        assert opts.resource_name == plugin["devicePlugin"]["resourceName"]
        assert opts.time_slicing_replicas == plugin["devicePlugin"]["timeSlicingReplicas"]
        assert opts.mig_strategy == plugin["devicePlugin"]["migStrategy"]


def _check_mps_daemon_pods(opts: PluginOptions, values: dict[str, Any], image: str) -> None:
    """Shared GPUs: each MPS daemon in a Pod of the plugin's image, namespace,
    tolerations and priority (docs/sharing.md); whole GPUs need none."""
    if not mps_daemons(values):
        assert opts.mps_daemon_image is None
        return
    plugin = values["kubeletPlugin"]
    assert opts.mps_daemon_image == image  # the plugin's own
    assert opts.pod_namespace == "ns"
    pod = opts.mps_daemon_pod
    assert pod["imagePullPolicy"] == values["image"]["pullPolicy"]
    assert pod.get("tolerations", []) == plugin["tolerations"]
    assert pod.get("priorityClassName", "") == plugin["priorityClassName"]
    assert pod["resources"] == values["mps"]["resources"]
    secrets = values["image"]["pullSecrets"]
    assert pod.get("imagePullSecrets", []) == [{"name": s} for s in secrets]


@pytest.mark.parametrize("values_file", VALUES_PARAMS)
def test_controller_runs_non_root_read_only_with_leader_election(
    values_file: Path | None,
) -> None:
    values = load_values(values_file)
    objs = render(namespace="drasil-system", values_file=values_file)
    if not values["controller"]["enabled"]:
        assert not by_kind(objs, "Deployment")
        return
    deployment = one(objs, "Deployment")
    assert deployment["spec"]["replicas"] == values["controller"]["replicas"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["command"] == ["drasil-controller"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # The flags are the controller's own (controller/options.py) and say what the values say.
    from drasil.controller.options import parse_options as controller_options

    env = {"POD_NAMESPACE": "drasil-system", "POD_NAME": "controller-0"}
    opts = controller_options(container["args"], env=env)
    ctl = values["controller"]
    assert opts.driver_name == values["driverName"]
    assert opts.explain_after == ctl["explainAfterSeconds"]
    assert opts.metrics_addr == f":{ctl['metricsPort']}"
    assert opts.health_addr == f":{ctl['healthPort']}"
    assert opts.log_format == values["logFormat"]
    assert opts.verbosity == values["verbosity"]
    assert opts.leader.enabled is ctl["leaderElect"]
    if ctl["leaderElect"]:
        # The Role grants get/update on exactly this Lease.
        (role,) = [r for r in by_kind(objs, "Role") if "controller" in r["metadata"]["name"]]
        (named,) = [r for r in role["rules"] if r.get("resourceNames")]
        assert named["resourceNames"] == [opts.leader.name]
        assert opts.leader.namespace == "drasil-system"
        assert opts.leader.identity == "controller-0"
    env_from = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in container["env"]
        if "valueFrom" in e
    }
    assert env_from == {"POD_NAMESPACE": "metadata.namespace", "POD_NAME": "metadata.name"}
    assert _plain_env(container) == _api_server_env(values)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": ctl["metricsPort"], "health": ctl["healthPort"]}
    assert pod.get("hostNetwork", False) is ctl["hostNetwork"]
    if ctl["hostNetwork"]:
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    # The plugin and the controller must not share a ServiceAccount.
    plugin_sa = one(objs, "DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"]
    assert pod["serviceAccountName"] != plugin_sa


def test_device_classes_select_our_driver_and_type() -> None:
    objs = render(namespace="ns", sets=["driverName=gpu.example.com"])
    classes = {o["metadata"]["name"]: o["spec"] for o in by_kind(objs, "DeviceClass")}
    assert classes == {
        "gpu.drasil.dev": {
            "selectors": [
                {
                    "cel": {
                        "expression": 'device.driver == "gpu.example.com" && '
                        'device.attributes["gpu.example.com"].type == "gpu"'
                    }
                }
            ],
            "extendedResourceName": "drasil.dev/gpu",
        },
        "mig.drasil.dev": {
            "selectors": [
                {
                    "cel": {
                        "expression": 'device.driver == "gpu.example.com" && '
                        'device.attributes["gpu.example.com"].type == "mig"'
                    }
                }
            ]
        },
        "shared.drasil.dev": {
            "selectors": [
                {
                    "cel": {
                        "expression": 'device.driver == "gpu.example.com" && '
                        'device.attributes["gpu.example.com"].type == "gpu" && '
                        "device.allowMultipleAllocations"
                    }
                }
            ]
        },
        **{
            name: {
                "selectors": [
                    {
                        "cel": {
                            "expression": 'device.driver == "gpu.example.com" && '
                            f'device.attributes["gpu.example.com"].type {test}'
                        }
                    }
                ]
            }
            for name, test in (
                ("amdgpu.drasil.dev", '== "amdgpu"'),
                ("amdgpu-partition.drasil.dev", '== "amdgpu-partition"'),
                ("any-gpu.drasil.dev", 'in ["gpu", "amdgpu"]'),
                ("vfio.gpu.drasil.dev", 'in ["vfio", "amdgpu-vfio"]'),
            )
        },
    }
    without = render(namespace="ns", sets=["deviceClasses.extendedResourceName="])
    assert all("extendedResourceName" not in o["spec"] for o in by_kind(without, "DeviceClass"))
    amd = render(namespace="ns", sets=["deviceClasses.amdExtendedResourceName=amd.com/gpu"])
    named = {
        o["metadata"]["name"]: o["spec"].get("extendedResourceName")
        for o in by_kind(amd, "DeviceClass")
    }
    assert named["amdgpu.drasil.dev"] == "amd.com/gpu"
    assert named["gpu.drasil.dev"] == "drasil.dev/gpu"


def test_the_node_label_policy_lets_the_plugin_change_exactly_its_own_keys() -> None:
    """The chart's CEL pattern of the keys the plugin may change is the one the plugin
    keeps to (drasil.driver.nvidia.nodelabels.OWN_KEY), GFD's names only with gfd."""
    for names, prefixes in (("gfd", r"drasil\.dev|nvidia\.com"), ("drasil", r"drasil\.dev")):
        rendered = render(namespace="ns", sets=[f"nodeLabels.names={names}"])
        (policy,) = [
            o
            for o in by_kind(rendered, "ValidatingAdmissionPolicy")
            if o["metadata"]["name"].endswith("-node-labels")
        ]
        (foreign,) = [v for v in policy["spec"]["variables"] if v["name"] == "foreign"]
        pattern = foreign["expression"].split("matches(r'", 1)[1].removesuffix("'))")
        expected = OWN_KEY.pattern.replace(r"drasil\.dev|nvidia\.com", prefixes, 1)
        assert pattern == expected
    for off in (["nodeLabels.names=off"], ["nodeLabels.nfdFeaturesDir=/etc/nfd/features.d"]):
        policies = [
            p["metadata"]["name"]
            for p in by_kind(render(namespace="ns", sets=off), "ValidatingAdmissionPolicy")
        ]
        assert not any(n.endswith("-node-labels") for n in policies), policies


def test_a_mig_profile_class_stands_for_the_device_plugins_resource_of_it() -> None:
    """deviceClasses.migProfiles: one class per profile, selecting MIG devices of it,
    whose extended resource is named as NVIDIA's device plugin names it ("+" as ".")."""
    sets = [
        "deviceClasses.migProfiles={1g.10gb,1g.10gb+me}",
        "deviceClasses.migExtendedResourcePrefix=nvidia.com/mig-",
        "deviceClasses.extendedResourceName=nvidia.com/gpu",
    ]
    rendered = render(namespace="ns", sets=sets)
    classes = {o["metadata"]["name"]: o["spec"] for o in by_kind(rendered, "DeviceClass")}
    assert classes["gpu.drasil.dev"]["extendedResourceName"] == "nvidia.com/gpu"
    assert classes["mig-1g.10gb.drasil.dev"]["extendedResourceName"] == "nvidia.com/mig-1g.10gb"
    plus = classes["mig-1g.10gb.me.drasil.dev"]
    assert plus["extendedResourceName"] == "nvidia.com/mig-1g.10gb.me"
    (selector,) = plus["selectors"]
    assert selector["cel"]["expression"] == (
        'device.driver == "gpu.drasil.dev" && device.attributes["gpu.drasil.dev"].type == "mig"'
        ' && device.attributes["gpu.drasil.dev"].profile == "1g.10gb+me"'
    )
    # Without a prefix the classes are there, with no extended resource.
    bare = render(namespace="ns", sets=["deviceClasses.migProfiles={2g.20gb}"])
    (two,) = [o for o in by_kind(bare, "DeviceClass") if o["metadata"]["name"].startswith("mig-")]
    assert two["metadata"]["name"] == "mig-2g.20gb.drasil.dev"
    assert "extendedResourceName" not in two["spec"]


# ---- values.schema.json ------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        pytest.param(
            ["nosuchvalue=1"], ["additional properties 'nosuchvalue' not allowed"], id="unknown-top"
        ),
        pytest.param(
            ["kubeletPlugin.registrarDIR=/x"],
            ["/kubeletPlugin", "additional properties 'registrarDIR' not allowed"],
            id="unknown-nested-typo",
        ),
        pytest.param(["backend=cuda"], ["/backend", "'nvml', 'simulated'"], id="bad-enum-backend"),
        pytest.param(["mode=dp"], ["/mode", "'dra', 'device-plugin'"], id="bad-enum-mode"),
        pytest.param(["logFormat=xml"], ["/logFormat", "'json', 'text'"], id="bad-enum-log"),
        pytest.param(
            ["driverName=GPU_Driver"],
            ["/driverName", "does not match pattern"],
            id="bad-driver-name",
        ),
        pytest.param(
            ["kubeletPlugin.cdiRoot=var/run/cdi"], ["/kubeletPlugin/cdiRoot"], id="relative-path"
        ),
        pytest.param(
            ["kubeletPlugin.metricsPort=70000"], ["/kubeletPlugin/metricsPort"], id="bad-port"
        ),
        pytest.param(["cdiHooks=off"], ["/cdiHooks", "'enabled', 'disabled'"], id="bad-cdi-hooks"),
        pytest.param(
            ["cdiHooks=true"], ["/cdiHooks", "'enabled', 'disabled'"], id="bool-cdi-hooks"
        ),
        pytest.param(
            ["nvidiaDriverRoot=run/nvidia/driver"],
            ["/nvidiaDriverRoot", "does not match pattern"],
            id="relative-driver-root",
        ),
        pytest.param(
            ["nvidiaCDIHookPath=nvidia-cdi-hook"],
            ["/nvidiaCDIHookPath", "does not match pattern"],
            id="relative-hook-path",
        ),
        pytest.param(
            ["nvml.driverRoot=run/nvidia/driver"],
            ["/nvml/driverRoot", "does not match pattern"],
            id="relative-deprecated-driver-root",
        ),
        pytest.param(
            ["deviceClasses.migProfiles={1g.10gb\\,x}"],
            ["/deviceClasses/migProfiles/0", "does not match pattern"],
            id="bad-mig-profile",
        ),
        pytest.param(
            ["deviceClasses.migExtendedResourcePrefix=mig-"],
            ["/deviceClasses/migExtendedResourcePrefix"],
            id="prefix-without-domain",
        ),
        pytest.param(
            ["kubeletPlugin.hostResourcesPerGpu.nvidia\\.com/gpu=1"],
            # helm names a wrong location for a propertyNames error; the rest is right.
            ["invalid propertyName 'nvidia.com/gpu'", "hugepages-[0-9]+[KMGT]i?"],
            id="extended-resource-with-a-gpu",
        ),
        pytest.param(
            ["controller.replicas=2", "controller.leaderElect=false"],
            ["/controller/leaderElect", "must be true"],
            id="replicas-without-leader-election",
        ),
    ],
)
def test_values_schema_rejects_with_a_clear_message(sets: list[str], expected: list[str]) -> None:
    result = helm("template", RELEASE, str(CHART), *values_args(None, sets), check=False)
    assert result.returncode != 0, f"--set {sets} was accepted"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    for text in expected:
        assert text in result.stderr, result.stderr


def test_socket_paths_too_long_for_unix_sockets_are_refused_at_install() -> None:
    """With the Pod UID's first 13 characters in the socket names, the default kubelet
    paths leave room for a driver name of 40 characters; one more would make the
    plugin fail on every node."""
    fits, too_long = f"gpu.{'a' * 32}.com", f"gpu.{'a' * 33}.com"
    assert (len(fits), len(too_long)) == (40, 41)
    helm("template", RELEASE, str(CHART), "--set", f"driverName={fits}")
    result = helm("template", RELEASE, str(CHART), "--set", f"driverName={too_long}", check=False)
    assert result.returncode != 0
    assert "over the 97 a unix socket allows" in result.stderr, result.stderr
    assert "kubeletPlugin.podUidInSocketNames=false" in result.stderr
    helm(
        "template",
        RELEASE,
        str(CHART),
        "--set",
        f"driverName={too_long}",
        "--set",
        "kubeletPlugin.podUidInSocketNames=false",
    )


def _readme_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "values_readme", CHART / "hack" / "values_readme.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chart_readme_lists_every_value_with_its_default() -> None:
    readme = _readme_module()
    expected = readme.render()
    assert (CHART / "README.md").read_text() == expected, (
        "charts/drasil/README.md is stale: run .venv/bin/python charts/drasil/hack/values_readme.py"
    )
    # Every leaf of values.yaml has a row (render() also refuses schema/values drift).
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def leaves(node: Any, prefix: str = "") -> Iterator[str]:
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else key
            if (
                isinstance(value, dict)
                and value
                and path.split(".")[-1]
                not in (
                    "resources",
                    "nodeSelector",
                    "affinity",
                    "podAnnotations",
                    "labels",
                )
            ):
                yield from leaves(value, path)
            else:
                yield path

    for path in leaves(values):
        assert f"| `{path}` |" in expected, f"{path} has no row in README.md"


# ---- server-side dry-run against the real API server ----------------------------------


@pytest.fixture
def devicepool_crd(kube: Kube, kubeconfig: Path) -> Iterator[dict[str, Any]]:
    with crd_installed(kube, kubeconfig) as crd:
        yield crd


def _served(kube: Kube, obj: dict[str, Any]) -> bool:
    try:
        kube.resource(obj["apiVersion"], obj["kind"])
    except Exception:  # ResourceNotFoundError: the API server does not serve the kind
        return False
    return True


@pytest.mark.parametrize("values_file", VALUES_PARAMS)
def test_every_rendered_object_passes_a_server_side_dry_run(
    values_file: Path | None,
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    devicepool_crd: dict[str, Any],
) -> None:
    objs = render(namespace=namespace, values_file=values_file, include_crds=True)
    crds = by_kind(objs, "CustomResourceDefinition")
    assert [c["metadata"]["name"] for c in crds] == ["devicepools.drasil.dev"]
    assert crds[0]["spec"] == devicepool_crd["spec"]
    rest = [o for o in objs if o["kind"] != "CustomResourceDefinition"]
    unserved = [o for o in rest if not _served(kube, o)]
    assert {gvk(o) for o in unserved} <= NOT_SERVED_HERE, [gvk(o) for o in unserved]
    served = [o for o in rest if o not in unserved]
    result = kubectl_run(
        kubeconfig,
        "apply",
        "--dry-run=server",
        "--validate=strict",
        "--server-side",
        "--field-manager=drasil-e2e",
        "-f",
        "-",
        stdin=dump(served),
    )
    applied = [line for line in result.stdout.splitlines() if "(server dry run)" in line]
    assert len(applied) == len(served), result.stdout
    assert "Warning" not in result.stderr, result.stderr  # e.g. deprecated or unknown fields
    for monitor in unserved:
        _check_service_monitor(monitor, objs)


def _check_service_monitor(monitor: dict[str, Any], objs: list[dict[str, Any]]) -> None:
    """What the API server would not check here: the monitor selects both metrics
    Services of the release by label and scrapes their named metrics port."""
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [
        s for s in by_kind(objs, "Service") if selector.items() <= s["metadata"]["labels"].items()
    ]
    assert len(services) == len(by_kind(objs, "Service")) >= 1
    (endpoint,) = monitor["spec"]["endpoints"]
    for service in services:
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [monitor["metadata"]["namespace"]]


def test_devicepool_crd_is_generated_from_the_api_types() -> None:
    from drasil.api.devicepool import crd_yaml

    assert CRD.read_text() == crd_yaml(), (
        f"{CRD.relative_to(REPO)} is stale: run .venv/bin/python -m drasil.api.devicepool crd "
        f"> {CRD.relative_to(REPO)}"
    )


def test_devicepool_crd_accepts_the_documented_example(
    kube: Kube, kubeconfig: Path, devicepool_crd: dict[str, Any]
) -> None:
    """The DevicePool example of docs and issue 5 passes the served CRD (dry-run)."""
    pools = kube.resource("drasil.dev/v1alpha1", "DevicePool")
    pool: dict[str, Any] = {
        "apiVersion": "drasil.dev/v1alpha1",
        "kind": "DevicePool",
        "metadata": {"name": "rack-a"},
        "spec": {
            "driver": "gpu.drasil.dev",
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "rack", "operator": "In", "values": ["a"]}]}
                ]
            },
            "devices": [
                {
                    "name": "remote-0",
                    "attributes": {
                        "type": {"string": "remote-gpu"},
                        "productName": {"string": "NVIDIA L4"},
                    },
                    "capacity": {"memory": {"value": "24Gi"}},
                }
            ],
        },
    }
    created = pools.create(body=pool, dry_run="All").to_dict()
    assert created["spec"]["devices"] == pool["spec"]["devices"]  # nothing pruned


def _notes(*sets: str) -> str:
    result = helm(
        "install",
        RELEASE,
        str(CHART),
        "--dry-run=client",
        "--namespace=drasil",
        *values_args(None, sets),
    )
    return result.stdout.split("NOTES:", 1)[1]


def test_notes_tell_how_to_see_the_driver_work() -> None:
    notes = _notes("backend=simulated")
    assert "kubectl get resourceslices --field-selector spec.driver=gpu.drasil.dev" in notes
    assert "deviceClassName: gpu.drasil.dev" in notes
    assert "{drasil.dev/gpu: 1}" in notes
    assert "privileged" not in notes
    assert "drasil doctor" not in notes
    nvml = _notes("backend=nvml")
    assert "runs the plugin privileged" in nvml
    assert "The NVIDIA driver is expected under / on the nodes" in nvml
    assert "kubectl -n drasil exec <plugin pod> -- drasil doctor" in nvml
    assert "DEPRECATED" not in nvml
    assert "cdiHooks is disabled" in _notes("cdiHooks=disabled")
    assert "WARNING" in _notes("validatingAdmissionPolicy.enabled=false")


# ---- the driver root, and the deprecated nvml.driverRoot ---------------------------------


def _driver_root_rendered(*sets: str) -> tuple[str, str]:
    """The driver-root volume's host path and the plugin's NVIDIA_DRIVER_ROOT."""
    objs = render(namespace="ns", sets=["backend=nvml", *sets])
    spec = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "driver-root"]
    return volume["hostPath"]["path"], _plain_env(spec["containers"][0])["NVIDIA_DRIVER_ROOT"]


def test_values_yaml_no_longer_sets_the_deprecated_driver_root() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert "driverRoot" not in values["nvml"]
    assert values["nvidiaDriverRoot"] == "/"
    assert _driver_root_rendered() == ("/", "/")


@pytest.mark.parametrize(
    ("sets", "root", "note"),
    [
        pytest.param(
            ["nvidiaDriverRoot=/run/nvidia/driver"], "/run/nvidia/driver", None, id="new-key"
        ),
        pytest.param(
            ["nvml.driverRoot=/run/nvidia/driver"],
            "/run/nvidia/driver",
            "It is used for now: the driver root is /run/nvidia/driver. "
            "Set nvidiaDriverRoot=/run/nvidia/driver instead.",
            id="old-key-still-works",
        ),
        pytest.param(
            ["nvml.driverRoot=/run/nvidia/driver", "nvidiaDriverRoot=/home/kubernetes/bin/nvidia"],
            "/home/kubernetes/bin/nvidia",
            "It is ignored: nvidiaDriverRoot=/home/kubernetes/bin/nvidia is set.",
            id="new-key-wins",
        ),
        pytest.param(["nvml.driverRoot=/"], "/", "It is used for now", id="old-key-at-root"),
    ],
)
def test_deprecated_nvml_driver_root_is_used_when_the_new_key_is_left_at_root(
    sets: list[str], root: str, note: str | None
) -> None:
    """nvml.driverRoot keeps working for one release: used when set while
    nvidiaDriverRoot is left at "/", ignored otherwise; the NOTES say which."""
    assert _driver_root_rendered(*sets) == (root, root)
    notes = _notes("backend=nvml", *sets)
    if note is None:
        assert "DEPRECATED" not in notes
    else:
        assert "DEPRECATED: nvml.driverRoot is replaced by nvidiaDriverRoot" in notes
        assert note in notes


# ---- the image ------------------------------------------------------------------------


def _images(objs: Iterable[dict[str, Any]]) -> set[str]:
    return {
        c["image"]
        for kind in ("DaemonSet", "Deployment")
        for o in by_kind(objs, kind)
        for c in o["spec"]["template"]["spec"]["containers"]
    }


def test_default_image_is_the_public_repository_at_the_version_make_image_builds() -> None:
    """The chart's default tag is its appVersion, which is the version `make image`
    tags (pyproject.toml): an image built from this checkout is the chart's default."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    with open(REPO / "pyproject.toml", "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert chart["appVersion"] == version
    objs = render(namespace="drasil", sets=["backend=simulated"])
    assert _images(objs) == {f"ghcr.io/drasil-dev/drasil:{version}"}


def test_image_repository_and_tag_set_both_daemons_images() -> None:
    sets = ["image.repository=registry.example.com/team/drasil", "image.tag=0.1.0-rc1"]
    objs = render(namespace="drasil", sets=sets)
    assert _images(objs) == {"registry.example.com/team/drasil:0.1.0-rc1"}
    readme = (CHART / "README.md").read_text()
    assert "make image" in readme
    assert "--set image.repository=" in readme
    assert "--set image.tag=" in readme

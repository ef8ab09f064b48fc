"""The chart's preset `compatibility: nvidia-dra` (docs/nvidia-dra.md "The chart preset").

With it the chart takes the names of NVIDIA's DRA driver: the driver name
`gpu.nvidia.com` wherever the chart names the driver (the daemons' flags, the plugin's
state dir and socket check, the controller's RBAC resourceNames, the admission
policies) and NVIDIA's DeviceClasses `gpu.nvidia.com` (with `extendedResourceName:
nvidia.com/gpu`) and `mig.nvidia.com` beside drasil's. Anything but "" and
`nvidia-dra` is refused, and so is a driverName of the user's own beside the preset.

`helm template` only (no cluster): the e2e harness builds the pinned helm first. The
classes' selectors are also evaluated with drasil's CEL on the devices a simulated
node publishes under the preset's driver name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from drasil.controller.options import parse_options as controller_options
from drasil.driver.cel.selectors import CelDevice, compile_selector
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.simulated.nvml import simulated_library
from drasil.driver.slices.build import build_slices
from drasil.kubeletplugin.options import parse_options
from e2e.harness.chart import CHART, RELEASE, helm, render, values_args

NVIDIA = "gpu.nvidia.com"
PRESET = "compatibility=nvidia-dra"
NVIDIA_CLASSES = {
    "gpu.nvidia.com": {
        "selectors": [
            {
                "cel": {
                    "expression": "device.driver == 'gpu.nvidia.com' && "
                    "device.attributes['gpu.nvidia.com'].type == 'gpu'"
                }
            }
        ],
        "extendedResourceName": "nvidia.com/gpu",
    },
    "mig.nvidia.com": {
        "selectors": [
            {
                "cel": {
                    "expression": "device.driver == 'gpu.nvidia.com' && "
                    "device.attributes['gpu.nvidia.com'].type == 'mig'"
                }
            }
        ]
    },
    "vfio.gpu.nvidia.com": {
        "selectors": [
            {
                "cel": {
                    "expression": "device.driver == 'gpu.nvidia.com' && "
                    "device.attributes['gpu.nvidia.com'].type == 'vfio'"
                }
            }
        ]
    },
}


def _of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def _one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = _of_kind(objs, kind)
    return found


def _classes(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o["spec"] for o in _of_kind(objs, "DeviceClass")}


def _strings(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _strings(value, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node


def _failure(*sets: str, extra: tuple[str, ...] = ()) -> str:
    result = helm("template", RELEASE, str(CHART), *values_args(None, sets), *extra, check=False)
    assert result.returncode != 0, f"--set {sets} was accepted"
    return result.stderr


def _plugin_options(objs: list[dict[str, Any]]) -> Any:
    (container,) = _one(objs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    downward = {"spec.nodeName": "node-1", "metadata.uid": "uid-1", "metadata.namespace": "ns"}
    env = {
        e["name"]: downward[e["valueFrom"]["fieldRef"]["fieldPath"]]
        for e in container["env"]
        if "valueFrom" in e
    }
    env |= {e["name"]: e["value"] for e in container["env"] if "value" in e}
    return parse_options(container["args"], env=env)


def test_helm_lint_strict_with_the_preset() -> None:
    result = helm("lint", "--strict", str(CHART), *values_args(None, [PRESET]))
    assert "0 chart(s) failed" in result.stdout, result.stdout
    assert "[WARNING]" not in result.stdout, result.stdout


# -- the driver name --------------------------------------------------------------------


def test_the_preset_names_the_driver_gpu_nvidia_com_everywhere() -> None:
    objs = render(namespace="ns", sets=[PRESET])
    # The plugin, as its own option parser reads the DaemonSet, and its host dirs.
    opts = _plugin_options(objs)
    assert opts.driver_name == NVIDIA
    spec = _one(objs, "DaemonSet")["spec"]["template"]["spec"]
    (state,) = [v for v in spec["volumes"] if v["name"] == "state-dir"]
    assert state["hostPath"]["path"] == f"/var/lib/kubelet/plugins/{NVIDIA}"
    # The controller, as its own option parser reads the Deployment.
    (container,) = _one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = {"POD_NAMESPACE": "ns", "POD_NAME": "controller-0"}
    assert controller_options(container["args"], env=env).driver_name == NVIDIA
    # The controller's synthetic subresource is named after the driver.
    roles = [
        r for r in _of_kind(objs, "ClusterRole") if r["metadata"]["name"].endswith("-controller")
    ]
    (role,) = roles
    (driver_rule,) = [r for r in role["rules"] if "resourceclaims/driver" in r["resources"]]
    assert driver_rule["resourceNames"] == [NVIDIA]
    # Both slice policies keep their account to this driver's slices.
    policies = {p["metadata"]["name"]: p for p in _of_kind(objs, "ValidatingAdmissionPolicy")}
    for name in (f"{RELEASE}-kubelet-plugin-slices", f"{RELEASE}-controller-slices"):
        expressions = [v["expression"] for v in policies[name]["spec"]["validations"]]
        assert any(f'variables.slice.spec.driver == "{NVIDIA}"' in e for e in expressions), name
        assert any(f'oldObject.spec.driver == "{NVIDIA}"' in e for e in expressions), name
    # drasil's default driver name is left nowhere but in drasil's own class names.
    for obj in objs:
        for path, text in _strings(obj):
            if "gpu.drasil.dev" in text:
                assert obj["kind"] == "DeviceClass", (path, text)
                assert path == ".metadata.name", (path, text)


def test_driver_name_gpu_nvidia_com_beside_the_preset_is_the_same_install() -> None:
    assert render(namespace="ns", sets=[PRESET, f"driverName={NVIDIA}"]) == render(
        namespace="ns", sets=[PRESET]
    )


def test_a_driver_name_of_ones_own_beside_the_preset_is_refused_naming_both() -> None:
    stderr = _failure(PRESET, "driverName=gpu.example.com")
    assert "compatibility nvidia-dra sets the driver name gpu.nvidia.com" in stderr, stderr
    assert "but driverName is gpu.example.com" in stderr, stderr


def test_the_socket_path_check_counts_the_presets_driver_name() -> None:
    long_dir = "/" + "k" * 60 + "/plugins_registry"
    stderr = _failure(PRESET, f"kubeletPlugin.registrarDir={long_dir}")
    assert "over the 97 a unix socket allows" in stderr, stderr
    assert f"{long_dir}/{NVIDIA}-<13 chars of the pod uid>-reg.sock" in stderr, stderr


def test_device_plugin_mode_keeps_its_state_under_the_presets_driver_name() -> None:
    sets = [PRESET, "mode=device-plugin", "deviceClasses.create=false"]
    sets += ["controller.enabled=false", "validatingAdmissionPolicy.enabled=false"]
    objs = render(namespace="ns", sets=sets)
    assert _plugin_options(objs).driver_name == NVIDIA
    assert not _of_kind(objs, "DeviceClass")


# -- the classes -------------------------------------------------------------------------


def test_the_preset_adds_nvidias_classes_beside_drasils() -> None:
    classes = _classes(render(namespace="ns", sets=[PRESET]))
    assert {n: classes[n] for n in NVIDIA_CLASSES} == NVIDIA_CLASSES
    # drasil's own classes select the same devices: their driver is gpu.nvidia.com too.
    for name in ("gpu.drasil.dev", "mig.drasil.dev", "shared.drasil.dev", "any-gpu.drasil.dev"):
        (selector,) = classes[name]["selectors"]
        assert selector["cel"]["expression"].startswith(
            f'device.driver == "{NVIDIA}" && device.attributes["{NVIDIA}"].type'
        ), name
    assert classes["gpu.drasil.dev"]["extendedResourceName"] == "drasil.dev/gpu"
    assert sorted(classes) == sorted(
        [
            "gpu.drasil.dev",
            "mig.drasil.dev",
            "shared.drasil.dev",
            "amdgpu.drasil.dev",
            "amdgpu-partition.drasil.dev",
            "any-gpu.drasil.dev",
            "vfio.gpu.drasil.dev",
            *NVIDIA_CLASSES,
        ]
    )


def test_without_the_preset_there_are_no_nvidia_classes() -> None:
    for sets in ([], ["compatibility="]):
        classes = _classes(render(namespace="ns", sets=sets))
        assert not [n for n in classes if n.endswith(".nvidia.com")]
        assert classes["gpu.drasil.dev"]["extendedResourceName"] == "drasil.dev/gpu"


def test_no_classes_without_device_classes_create() -> None:
    objs = render(namespace="ns", sets=[PRESET, "deviceClasses.create=false"])
    assert not _of_kind(objs, "DeviceClass")


def test_nvidia_com_gpu_goes_to_one_class_only() -> None:
    """Two classes must not claim one extended resource: asked of gpu.drasil.dev too
    under the preset, nvidia.com/gpu stays gpu.nvidia.com's alone (both select the same
    GPUs, so a Pod asking for it gets what the user meant)."""
    sets = [PRESET, "deviceClasses.extendedResourceName=nvidia.com/gpu"]
    classes = _classes(render(namespace="ns", sets=sets))
    claimed = {
        n: s["extendedResourceName"] for n, s in classes.items() if "extendedResourceName" in s
    }
    assert claimed == {"gpu.nvidia.com": "nvidia.com/gpu"}
    # Without the preset the value is gpu.drasil.dev's, as before.
    plain = _classes(render(namespace="ns", sets=sets[1:]))
    assert plain["gpu.drasil.dev"]["extendedResourceName"] == "nvidia.com/gpu"


def test_amd_gpus_cannot_stand_for_nvidia_com_gpu_under_the_preset() -> None:
    stderr = _failure(PRESET, "deviceClasses.amdExtendedResourceName=nvidia.com/gpu")
    assert "deviceClasses.amdExtendedResourceName cannot be nvidia.com/gpu" in stderr, stderr


@pytest.mark.parametrize(
    ("profile", "mig_mode"),
    [("h100-80gb:2,a100-40gb-mig:1", "static"), ("h100-80gb:1", "dynamic")],
)
def test_the_classes_select_what_a_node_publishes_under_the_preset(
    profile: str, mig_mode: str
) -> None:
    """The rendered selectors, evaluated as kube-scheduler does, on the devices of a
    simulated node published under gpu.nvidia.com: NVIDIA's classes select exactly
    drasil's GPUs and MIG devices, the same ones as gpu.drasil.dev and mig.drasil.dev."""
    classes = _classes(render(namespace="ns", sets=[PRESET]))
    result = discover(simulated_library(profile, node_name="n"), node_name="n", mig_mode=mig_mode)
    slices = build_slices(
        driver=NVIDIA,
        pool="n",
        devices=result.devices,
        node_name="n",
        counter_sets=result.counter_sets,
        generation=1,
        owner=None,
    )
    devices = [
        CelDevice.from_json(d, driver=NVIDIA) for s in slices for d in s["spec"].get("devices", ())
    ]

    def selected(name: str) -> set[str]:
        (selector,) = classes[name]["selectors"]
        compiled = compile_selector(selector["cel"]["expression"])
        out = set()
        for device in devices:
            verdict = compiled.evaluate(device)
            assert verdict.error is None, (name, device.name, verdict.error)
            if verdict.matched:
                out.add(device.name)
        return out

    gpus = {d.name for d in result.devices if d.type.value == "gpu"}
    migs = {d.name for d in result.devices if d.type.value == "mig"}
    assert gpus
    assert migs
    assert selected("gpu.nvidia.com") == selected("gpu.drasil.dev") == gpus
    assert selected("mig.nvidia.com") == selected("mig.drasil.dev") == migs


# -- refusals ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nvidia", "NVIDIA-DRA", "true"])
def test_the_schema_refuses_any_other_preset(value: str) -> None:
    stderr = _failure(f"compatibility={value}")
    assert "values don't meet the specifications of the schema" in stderr, stderr
    assert "/compatibility" in stderr, stderr
    assert "'', 'nvidia-dra'" in stderr, stderr


def test_the_templates_refuse_any_other_preset_without_the_schema() -> None:
    stderr = _failure("compatibility=nvidia", extra=("--skip-schema-validation",))
    assert 'compatibility "nvidia" is not a preset of this chart' in stderr, stderr
    assert "nvidia-dra" in stderr, stderr


# -- NOTES -------------------------------------------------------------------------------


def _notes(*sets: str) -> str:
    args = values_args(None, sets)
    result = helm("install", RELEASE, str(CHART), "--dry-run=client", "--namespace=drasil", *args)
    return result.stdout.split("NOTES:", 1)[1]


def test_notes_name_the_presets_driver_and_warn_against_nvidias_own() -> None:
    notes = _notes(PRESET, "backend=simulated")
    assert f"Driver {NVIDIA}, mode dra" in notes
    assert f"kubectl get resourceslices --field-selector spec.driver={NVIDIA}" in notes
    assert "gpu.nvidia.com\n(extended resource nvidia.com/gpu) and mig.nvidia.com" in notes
    assert "Do not run NVIDIA's own DRA driver on these" in notes
    assert "NVIDIA's own DRA driver" not in _notes("backend=simulated")

"""What device-plugin mode advertises: resources, IDs, MIG strategies, flags, the CDI spec."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
from kubelet_client import node_devices

from drasil.driver.cdi.spec import validate_spec
from drasil.driver.cdi.staticspec import (
    build_device_spec,
    device_cdi_id,
    device_spec_path,
    write_device_spec,
)
from drasil.driver.devices import Device, DeviceType
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.simulated.gpus import simulated_gpus
from drasil.driver.simulated.nvml import FakeNvml
from drasil.kubeletplugin.deviceplugin.resources import (
    DevicePluginConfigError,
    Resource,
    plan_resources,
    socket_name,
    validate_resource_name,
)
from drasil.kubeletplugin.options import OptionsError, parse_options

DRIVER = "gpu.drasil.dev"
GPU = "drasil.dev/gpu"


def devices(profile: str) -> list[Device]:
    return list(node_devices(profile).values())


def plan(profile: str, strategy: str = "none", *, replicas: int = 1) -> dict[str, Resource]:
    resources = plan_resources(
        devices(profile), resource_name=GPU, mig_strategy=strategy, replicas=replicas
    )
    return {r.name: r for r in resources}


def ids(resource: Resource) -> list[str]:
    return [u.id for u in resource.units]


# ---- MIG strategies ---------------------------------------------------------------------------


def test_none_advertises_full_gpus_only() -> None:
    resources = plan("a100-40gb-mig:1,l4:2")
    assert list(resources) == [GPU]
    assert ids(resources[GPU]) == ["gpu-1", "gpu-2"]  # gpu-0 is in MIG mode


def test_single_advertises_every_mig_device_of_the_one_profile() -> None:
    # Two A100s with only their two 1g.5gb slots configured.
    gpus = [replace(g, migs=g.migs[2:]) for g in simulated_gpus("a100-40gb-mig:2", node_name="n1")]
    found = discover(FakeNvml(gpus), node_name="n1").devices
    (resource,) = plan_resources(found, resource_name=GPU, mig_strategy="single", replicas=1)
    assert resource.name == GPU
    assert len(resource.units) == 4
    assert {u.device.attributes["profile"] for u in resource.units} == {"1g.5gb"}
    assert all(u.device.type == DeviceType.MIG for u in resource.units)


def test_single_refuses_several_profiles_naming_them() -> None:
    with pytest.raises(DevicePluginConfigError) as err:
        plan("a100-40gb-mig:2", "single")
    assert "found 1g.5gb, 2g.10gb, 3g.20gb" in str(err.value)
    assert "--mig-strategy mixed" in str(err.value)


def test_single_refuses_gpus_outside_mig_mode() -> None:
    with pytest.raises(
        DevicePluginConfigError, match="every GPU in MIG mode; not in MIG mode: gpu-1;"
    ):
        plan("a100-40gb-mig:1,l4:1", "single")


def test_single_without_mig_devices_falls_back_to_full_gpus() -> None:
    assert ids(plan("l4:2", "single")[GPU]) == ["gpu-0", "gpu-1"]


def test_mixed_serves_full_gpus_and_one_resource_per_profile() -> None:
    resources = plan("a100-40gb-mig:1,l4:1", "mixed")
    assert {name: len(r.units) for name, r in resources.items()} == {
        GPU: 1,
        "drasil.dev/mig-1g.5gb": 2,
        "drasil.dev/mig-2g.10gb": 1,
        "drasil.dev/mig-3g.20gb": 1,
    }
    assert ids(resources[GPU]) == ["gpu-1"]
    mig = resources["drasil.dev/mig-3g.20gb"].units[0].device
    assert mig.name == "gpu-0-mig-3g20gb-2-0"


def test_an_unknown_strategy_is_refused() -> None:
    with pytest.raises(DevicePluginConfigError, match="allowed values are"):
        plan("l4:1", "some")


# ---- IDs and names -----------------------------------------------------------------------


def test_replicas_are_numbered_per_device_in_minor_order() -> None:
    resource = plan("l4:12", replicas=2)[GPU]
    assert ids(resource)[:4] == ["gpu-0::0", "gpu-0::1", "gpu-1::0", "gpu-1::1"]
    assert ids(resource)[-2:] == ["gpu-11::0", "gpu-11::1"]  # 11 after 2, not after 1
    unit = resource.by_id["gpu-7::1"]
    assert (unit.device.name, unit.replica) == ("gpu-7", 1)
    assert [d.name for d in resource.devices][:3] == ["gpu-0", "gpu-1", "gpu-2"]


def test_replicas_below_one_are_refused() -> None:
    with pytest.raises(DevicePluginConfigError, match="less than 1"):
        plan("l4:1", replicas=0)


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("gpu", "must be <domain>/<name>"),
        ("drasil.dev/", "must be <domain>/<name>"),
        ("Drasil.dev/gpu", "not a lower-case DNS subdomain"),
        ("kubernetes.io/gpu", "reserved"),
        ("x.kubernetes.io/gpu", "reserved"),
        ("drasil.dev/-gpu", "must be at most 63"),
        ("drasil.dev/" + "g" * 64, "must be at most 63"),
    ],
)
def test_bad_resource_names_are_refused(name: str, problem: str) -> None:
    with pytest.raises(DevicePluginConfigError, match=problem):
        validate_resource_name(name)


@pytest.mark.parametrize("name", ["drasil.dev/gpu", "example.com/mig-1c.3g.20gb", "a/B_1"])
def test_good_resource_names_pass(name: str) -> None:
    validate_resource_name(name)


def test_socket_names() -> None:
    assert socket_name("drasil.dev/gpu") == "drasil-gpu.sock"
    assert socket_name("drasil.dev/mig-1g.5gb") == "drasil-mig-1g.5gb.sock"
    # Two instances during a rolling update must not take each other's socket.
    assert socket_name("drasil.dev/gpu", pod_uid="p-1") == "drasil-gpu-p-1.sock"
    uid = "3f2a9c1b-7d4e-4f6a-9b1c-2d3e4f5a6b7c"
    assert socket_name("drasil.dev/gpu", pod_uid=uid) == "drasil-gpu-3f2a9c1b-7d4e.sock"


# ---- flags ----------------------------------------------------------------------------------


def test_device_plugin_flag_defaults() -> None:
    opts = parse_options([], {"NODE_NAME": "n1"})
    assert opts.device_plugins_dir == Path("/var/lib/kubelet/device-plugins")
    assert opts.resource_name == "drasil.dev/gpu"
    assert opts.time_slicing_replicas == 1
    assert opts.mig_strategy == "none"


def test_device_plugin_flags_and_env() -> None:
    opts = parse_options(
        ["--device-plugins-dir=/dp", "--resource-name=example.com/gpu", "--mig-strategy=mixed"],
        {"NODE_NAME": "n1", "TIME_SLICING_REPLICAS": "4", "MIG_STRATEGY": "single"},
    )
    assert opts.device_plugins_dir == Path("/dp")
    assert opts.resource_name == "example.com/gpu"
    assert opts.time_slicing_replicas == 4
    assert opts.mig_strategy == "mixed"  # the flag wins over the environment


def test_bad_device_plugin_env_values_are_refused() -> None:
    with pytest.raises(OptionsError, match="--mig-strategy: unsupported value 'some'"):
        parse_options([], {"NODE_NAME": "n1", "MIG_STRATEGY": "some"})
    with pytest.raises(OptionsError, match="--time-slicing-replicas: 0 is less than 1"):
        parse_options([], {"NODE_NAME": "n1", "TIME_SLICING_REPLICAS": "0"})


# ---- the static CDI spec ----------------------------------------------------------------------


def test_static_spec_names_every_device(schema_validator: jsonschema.Draft7Validator) -> None:
    found = devices("a100-40gb-mig:1,l4:1")
    spec = build_device_spec(found, driver=DRIVER)
    schema_validator.validate(spec)
    assert spec["kind"] == "k8s.gpu.drasil.dev/device"
    assert spec["cdiVersion"] == "0.3.0"
    names = [d["name"] for d in spec["devices"]]
    assert sorted(names) == sorted(d.name for d in found)
    l4 = next(d for d in spec["devices"] if d["name"] == "gpu-1")
    uuid = next(d.uuid for d in found if d.name == "gpu-1")
    assert l4["containerEdits"] == {"env": [f"DRASIL_DEVICE_GPU_1={uuid}"]}
    assert device_cdi_id(driver=DRIVER, device_name="gpu-1") == "k8s.gpu.drasil.dev/device=gpu-1"


def test_static_spec_carries_device_nodes(schema_validator: jsonschema.Draft7Validator) -> None:
    gpu = replace(devices("l4:1")[0], device_nodes=("/dev/nvidia0",))
    spec = build_device_spec([gpu], driver=DRIVER)
    schema_validator.validate(spec)
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]


def test_write_device_spec_replaces_and_removes(tmp_path: Path) -> None:
    path = write_device_spec(devices("l4:2"), cdi_root=tmp_path / "cdi", driver=DRIVER)
    assert path == device_spec_path(tmp_path / "cdi", driver=DRIVER)
    assert path.name == "k8s.gpu.drasil.dev-device.json"
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    validate_spec(json.loads(path.read_text()))
    # A node whose devices are gone must not keep a spec naming them.
    assert write_device_spec([], cdi_root=tmp_path / "cdi", driver=DRIVER) is None
    assert not path.exists()
    assert list((tmp_path / "cdi").iterdir()) == []

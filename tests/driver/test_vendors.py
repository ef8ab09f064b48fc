"""Vendors on one node: backends chosen by ``--vendors`` or the simulated profile, their
devices merged, and what the vendor-neutral core does with an AMD device (configs it
refuses, NVIDIA's spec-wide edits it never gets)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_claimplan import REF, claim, config, result
from test_configs import DEVICES

from drasil.driver.amd.devices import discover_amd
from drasil.driver.cdi.spec import ContainerEdits
from drasil.driver.claims.deviceconfigs import ConfigResolutionError
from drasil.driver.claims.plan import NodePool, plan_prepare
from drasil.driver.devices import DeviceType, Vendor
from drasil.driver.discovery.backends import (
    VendorError,
    detect_vendors,
    discover_node,
    open_backends,
    split_profile,
)
from drasil.driver.simulated.amdsysfs import write_simulated_tree
from drasil.driver.simulated.gpus import ProfileSpecError

NODE = "node-a"


def _simulated(profile: str, tmp_path: Path) -> Any:
    return open_backends(
        "simulated",
        vendors=["nvidia"],
        profile=profile,
        node_name=NODE,
        simulated_amd_root=tmp_path / "amd",
    )


def test_a_profile_splits_by_vendor() -> None:
    assert split_profile("h100-80gb:2, mi300x:8,l4:1,mi250x:1") == (
        "h100-80gb:2,l4:1",
        "mi300x:8,mi250x:1",
    )


def test_a_mixed_simulated_node_serves_both_vendors(tmp_path: Path) -> None:
    backends = _simulated("h100-80gb:1,mi300x:2", tmp_path)
    assert backends.vendors == (Vendor.NVIDIA, Vendor.AMD)
    found = discover_node(backends.nvml, backends.amd_sysfs, node_name=NODE)
    types = sorted((d.name, d.type) for d in found.devices)
    assert types == [
        ("amdgpu-1", DeviceType.AMDGPU),
        ("amdgpu-9", DeviceType.AMDGPU),
        ("gpu-0", DeviceType.GPU),
    ]
    assert found.skipped == ()
    assert [d.split()[0] for d in found.drivers] == ["NVIDIA", "amdgpu"]


def test_an_amd_only_simulated_node_has_an_nvml_without_gpus(tmp_path: Path) -> None:
    backends = _simulated("mi300x-cpx:1", tmp_path)
    assert backends.vendors == (Vendor.AMD,)
    found = discover_node(backends.nvml, backends.amd_sysfs, node_name=NODE)
    assert len(found.devices) == 8
    assert {d.vendor for d in found.devices} == {Vendor.AMD}
    assert [d.split()[0] for d in found.drivers] == ["amdgpu"]


def test_an_unknown_model_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ProfileSpecError, match="h100-80gb"):
        _simulated("mi999:1", tmp_path)
    with pytest.raises(ProfileSpecError, match="count"):
        _simulated("mi300x:zero", tmp_path)


def test_a_gpu_that_cannot_be_read_is_skipped_and_the_rest_published(tmp_path: Path) -> None:
    backends = _simulated("mi300x:2", tmp_path)
    assert backends.amd_sysfs is not None
    gone = discover_amd(backends.amd_sysfs).devices[0]
    props = backends.amd_sysfs / "class/kfd/kfd/topology/nodes"
    for node in props.iterdir():
        if (
            f"drm_render_minor {gone.attributes['renderIndex']}"
            in (node / "properties").read_text()
        ):
            (node / "properties").unlink()
    found = discover_node(backends.nvml, backends.amd_sysfs, node_name=NODE)
    assert [d.name for d in found.devices] == ["amdgpu-9"]
    assert len(found.skipped) == 1
    assert found.skipped[0].startswith("AMD GPU 0000:")


def test_auto_finds_each_vendor_by_its_kernel_driver(tmp_path: Path) -> None:
    proc, sysfs = tmp_path / "proc", tmp_path / "sys"
    with pytest.raises(VendorError, match="no GPU driver found"):
        detect_vendors(proc_root=proc, amd_sysfs_root=sysfs)
    write_simulated_tree([("mi210", 1)], sysfs, node_name=NODE)
    assert detect_vendors(proc_root=proc, amd_sysfs_root=sysfs) == (Vendor.AMD,)
    (proc / "driver/nvidia").mkdir(parents=True)
    (proc / "driver/nvidia/version").write_text("NVRM version: 580.95.05\n")
    assert detect_vendors(proc_root=proc, amd_sysfs_root=sysfs) == (Vendor.NVIDIA, Vendor.AMD)


def test_amd_only_real_backend_opens_no_nvml(tmp_path: Path) -> None:
    write_simulated_tree([("mi210", 1)], tmp_path, node_name=NODE)
    backends = open_backends(
        "nvml", vendors=["amd"], profile="", node_name=NODE, amd_sysfs_root=tmp_path
    )
    assert backends.vendors == (Vendor.AMD,)
    found = discover_node(backends.nvml, backends.amd_sysfs, node_name=NODE)
    assert [d.name for d in found.devices] == ["amdgpu-1"]


# ---- the core with AMD devices ---------------------------------------------------------


@pytest.fixture
def mixed_pool(tmp_path: Path) -> NodePool:
    write_simulated_tree([("mi300x", 1)], tmp_path, node_name=NODE)
    amd = {d.name: d for d in discover_amd(tmp_path).devices}
    edits = ContainerEdits(env={"NVIDIA_VISIBLE_DEVICES": "void"})
    return NodePool(
        driver="gpu.drasil.dev", pool=NODE, devices={**DEVICES, **amd}, common_edits=edits
    )


def test_nvidias_spec_wide_edits_never_reach_an_amd_only_claim(mixed_pool: NodePool) -> None:
    amd = plan_prepare(claim(result("amdgpu-1")), ref=REF, node=mixed_pool)
    assert amd.spec.common_edits == ContainerEdits()
    both = plan_prepare(claim(result("amdgpu-1"), result("gpu-0")), ref=REF, node=mixed_pool)
    assert both.spec.common_edits is mixed_pool.common_edits


def test_an_amd_device_is_prepared_exclusive_with_its_nodes(mixed_pool: NodePool) -> None:
    (device,) = plan_prepare(claim(result("amdgpu-1")), ref=REF, node=mixed_pool).devices
    assert device.cdi.settings == {"SHARING_STRATEGY": "Exclusive"}
    paths = [c.path for c in device.cdi.device.char_devices]
    assert paths[0] == "/dev/kfd"
    assert len(paths) == 3


def test_a_config_naming_an_amd_request_is_refused_naming_the_vendor(
    mixed_pool: NodePool,
) -> None:
    bad = claim(result("amdgpu-1"), configs=(config("TimeSlicing", requests=("gpu",)),))
    with pytest.raises(ConfigResolutionError) as err:
        plan_prepare(bad, ref=REF, node=mixed_pool)
    (problem,) = err.value.problems
    assert 'device "amdgpu-1" of type amdgpu' in problem
    assert "AMD GPU, which takes no opaque config" in problem
    assert "compute" in problem


def test_a_claim_wide_config_leaves_amd_devices_alone(mixed_pool: NodePool) -> None:
    wide = claim(
        result("amdgpu-1", request="a"),
        result("gpu-0", request="b"),
        configs=(config("TimeSlicing"),),
    )
    amd, nvidia = plan_prepare(wide, ref=REF, node=mixed_pool).devices
    assert amd.cdi.settings == {"SHARING_STRATEGY": "Exclusive"}
    assert nvidia.cdi.settings["SHARING_STRATEGY"] == "TimeSlicing"


def test_device_types_know_their_vendor() -> None:
    vendors = {t: t.vendor for t in DeviceType.known()}
    assert vendors == {
        DeviceType.GPU: Vendor.NVIDIA,
        DeviceType.MIG: Vendor.NVIDIA,
        DeviceType.AMDGPU: Vendor.AMD,
        DeviceType.AMDGPU_PARTITION: Vendor.AMD,
        DeviceType.VFIO: Vendor.NVIDIA,
        DeviceType.AMDGPU_VFIO: Vendor.AMD,
    }


def test_a_config_the_scheduler_made_claim_wide_is_refused_for_an_amd_only_claim(
    mixed_pool: NodePool,
) -> None:
    # A config naming every request of the claim arrives with no requests at all.
    bad = claim(result("amdgpu-1"), configs=(config("TimeSlicing"),))
    with pytest.raises(ConfigResolutionError) as err:
        plan_prepare(bad, ref=REF, node=mixed_pool)
    (problem,) = err.value.problems
    assert 'device "amdgpu-1" of type amdgpu' in problem
    assert "AMD GPU, which takes no opaque config" in problem


def test_a_vendor_packages_device_is_planned_exclusive_with_its_nodes(
    third_vendor: Path,
) -> None:
    # The third vendor of e2e/harness/thirdvendor (tests/conftest.py): a type no config
    # kind fits.
    import acme_vendor

    npus = {d.name: d for d in acme_vendor.AcmeNode(1).discover(dra=True).devices}
    pool = NodePool(driver="gpu.drasil.dev", pool=NODE, devices={**DEVICES, **npus})
    (device,) = plan_prepare(claim(result("acme-0")), ref=REF, node=pool).devices
    assert device.cdi.settings == {"SHARING_STRATEGY": "Exclusive"}
    assert [(c.path, c.major, c.minor) for c in device.cdi.device.char_devices] == [
        ("/dev/acme0", 1, 3)
    ]
    assert device.cdi.device.vendor.value == "acme"

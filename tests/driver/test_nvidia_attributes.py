"""The attributes NVIDIA's DRA driver users select on, as drasil publishes them.

kubernetes-sigs/dra-driver-nvidia-gpu publishes its GPUs and MIG devices with these
attributes in its driver's domain (`gpu.nvidia.com`), typed as below in the
ResourceSlice (`string`, `int`, `version`), plus the standard
`resource.kubernetes.io/` ones. Its users' CEL selectors carry over only where drasil
publishes each under the same name and the same type: a `version` where they compare
with `semver(...)`, an `int` where they compare with a number. Under the chart's
`compatibility: nvidia-dra` drasil's driver name, and so its attribute domain, is
`gpu.nvidia.com`; the devices are built here for that driver name, through the slice
builder the plugin publishes with, and NVIDIA's DeviceClass selectors are evaluated on
them with drasil's CEL (kube-scheduler's semantics). docs/nvidia-dra.md
"Device attributes" is the table of the same.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import pytest

from drasil.driver.cel.selectors import CelDevice, compile_selector
from drasil.driver.cel.values import Semver
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.simulated.nvml import simulated_library
from drasil.driver.slices.build import build_slices

NVIDIA = "gpu.nvidia.com"
NODE = "node-a"

NVIDIA_GPU_ATTRIBUTES: Mapping[str, str] = {
    "type": "string",
    "uuid": "string",
    "productName": "string",
    "brand": "string",
    "architecture": "string",
    "cudaComputeCapability": "version",
    "driverVersion": "version",
    "cudaDriverVersion": "version",
    "addressingMode": "string",
    "index": "int",
    "minor": "int",
    "resource.kubernetes.io/pciBusID": "string",
    "resource.kubernetes.io/pcieRoot": "string",
    "resource.kubernetes.io/numaNode": "int",
}
NVIDIA_MIG_ATTRIBUTES: Mapping[str, str] = {
    **NVIDIA_GPU_ATTRIBUTES,
    "parentUUID": "string",
    "profile": "string",
}
MIG_CAPACITIES = (
    "memory",
    "multiprocessors",
    "copyEngines",
    "decoders",
    "encoders",
    "jpegEngines",
    "ofaEngines",
)
# NVIDIA's DeviceClasses, which the chart's preset creates with these selectors.
GPU_CLASS = f"device.driver == '{NVIDIA}' && device.attributes['{NVIDIA}'].type == 'gpu'"
MIG_CLASS = f"device.driver == '{NVIDIA}' && device.attributes['{NVIDIA}'].type == 'mig'"
# A semantic version as the API server checks it: no leading zeros, three parts.
SEMVER = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)")


def published(profile: str, *, mig_mode: str = "static") -> list[dict[str, Any]]:
    """The ResourceSlice devices of a simulated node under NVIDIA's driver name."""
    result = discover(simulated_library(profile, node_name=NODE), node_name=NODE, mig_mode=mig_mode)
    assert not result.skipped
    slices = build_slices(
        driver=NVIDIA,
        pool=NODE,
        devices=result.devices,
        node_name=NODE,
        counter_sets=result.counter_sets,
        generation=1,
        owner=None,
    )
    return [d for s in slices for d in s["spec"].get("devices", ())]


def kinds(device: Mapping[str, Any]) -> dict[str, str]:
    """Each attribute's ResourceSlice type (the one key of its value)."""
    out: dict[str, str] = {}
    for name, value in device.get("attributes", {}).items():
        (kind,) = value
        out[name] = kind
    return out


def check_types(device: Mapping[str, Any], wanted: Mapping[str, str]) -> None:
    found = kinds(device)
    missing = sorted(set(wanted) - set(found))
    assert not missing, f"{device['name']} lacks NVIDIA's {missing}"
    wrong = {n: (found[n], t) for n, t in wanted.items() if found[n] != t}
    assert not wrong, f"{device['name']}: (drasil's type, NVIDIA's) {wrong}"
    for name, kind in wanted.items():
        if kind == "version":
            value = device["attributes"][name]["version"]
            assert SEMVER.fullmatch(value), (name, value)
            Semver.parse(value)
    assert len(device["attributes"]) + len(device.get("capacity", {})) <= 32


def selects(expression: str, device: Mapping[str, Any]) -> bool:
    result = compile_selector(expression).evaluate(CelDevice.from_json(device, driver=NVIDIA))
    assert result.error is None, result.error
    return result.matched


def test_every_nvidia_gpu_attribute_on_an_h100_node() -> None:
    devices = published("h100-80gb:8")
    assert len(devices) == 8
    for i, device in enumerate(sorted(devices, key=lambda d: d["attributes"]["minor"]["int"])):
        check_types(device, NVIDIA_GPU_ATTRIBUTES)
        attrs = device["attributes"]
        assert attrs["type"] == {"string": "gpu"}
        assert attrs["uuid"]["string"].startswith("GPU-")
        assert attrs["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
        assert attrs["brand"] == {"string": "Nvidia"}
        assert attrs["architecture"] == {"string": "Hopper"}
        assert attrs["cudaComputeCapability"] == {"version": "9.0.0"}
        assert attrs["driverVersion"] == {"version": "580.95.5"}
        assert attrs["cudaDriverVersion"] == {"version": "13.0.0"}
        assert attrs["addressingMode"] == {"string": "None"}
        assert attrs["index"] == attrs["minor"] == {"int": i}
        assert attrs["resource.kubernetes.io/numaNode"] == {"int": 0 if i < 4 else 1}
        assert set(device["capacity"]) == {"memory"}
        assert selects(GPU_CLASS, device)
        assert not selects(MIG_CLASS, device)


@pytest.mark.parametrize("profile", ["a100-40gb-mig:1", "h100-80gb-mig:1"])
def test_every_nvidia_mig_attribute_on_a_mig_node(profile: str) -> None:
    devices = published(profile)
    assert devices
    for device in devices:
        check_types(device, NVIDIA_MIG_ATTRIBUTES)
        attrs = device["attributes"]
        assert attrs["type"] == {"string": "mig"}
        assert attrs["uuid"]["string"].startswith("MIG-")
        assert attrs["parentUUID"]["string"].startswith("GPU-")
        assert re.fullmatch(r"[1-7]g\.\d+gb", attrs["profile"]["string"])
        assert set(MIG_CAPACITIES) <= set(device["capacity"])
        assert selects(MIG_CLASS, device)
        assert not selects(GPU_CLASS, device)
    profiles = {d["attributes"]["profile"]["string"] for d in devices}
    assert ("1g.5gb" if profile.startswith("a100") else "1g.10gb") in profiles
    # A selector as NVIDIA's MIG examples write it.
    small = [
        d
        for d in devices
        if selects(MIG_CLASS + f" && device.attributes['{NVIDIA}'].profile == '1g.5gb'", d)
    ]
    assert len(small) == (2 if profile.startswith("a100") else 0)


def test_dynamic_mig_placements_carry_the_same_attributes_but_uuid() -> None:
    """In dynamic MIG mode a placement has no MIG device yet, so no `uuid` (NVIDIA's
    dynamic MIG devices have none either until prepared); the rest is there."""
    devices = published("h100-80gb:1", mig_mode="dynamic")
    whole = [d for d in devices if d["attributes"]["type"]["string"] == "gpu"]
    placements = [d for d in devices if d["attributes"]["type"]["string"] == "mig"]
    assert len(whole) == 1
    assert placements
    check_types(whole[0], NVIDIA_GPU_ATTRIBUTES)
    without_uuid = {k: v for k, v in NVIDIA_MIG_ATTRIBUTES.items() if k != "uuid"}
    for device in placements:
        check_types(device, without_uuid)
        assert set(MIG_CAPACITIES) <= set(device["capacity"])
        assert selects(MIG_CLASS, device)


def test_nvidia_selectors_on_versions_and_numbers() -> None:
    """Selectors of the kinds NVIDIA's users write: semver comparisons on the version
    attributes, numbers on index and the NUMA node, strings on product and brand."""
    (first, *_) = sorted(published("h100-80gb:8"), key=lambda d: d["attributes"]["index"]["int"])
    a = f"device.attributes['{NVIDIA}']"
    for expression in (
        f"{a}.cudaComputeCapability.isGreaterThan(semver('8.0.0'))",
        f"!{a}.cudaComputeCapability.isLessThan(semver('9.0.0'))",
        f"{a}.driverVersion.compareTo(semver('570.0.0')) > 0",
        f"{a}.cudaDriverVersion.isGreaterThan(semver('12.0.0'))",
        f"{a}.index == 0 && {a}.minor == 0",
        f"{a}.productName.startsWith('NVIDIA H100') && {a}.brand == 'Nvidia'",
        f"{a}.architecture == 'Hopper' && {a}.addressingMode == 'None'",
        "device.attributes['resource.kubernetes.io'].numaNode == 0",
        "device.attributes['resource.kubernetes.io'].pciBusID.startsWith('0000:')",
        f"device.capacity['{NVIDIA}'].memory.compareTo(quantity('40Gi')) > 0",
    ):
        assert selects(expression, first), expression

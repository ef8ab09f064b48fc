"""A MIG device's capability nodes in the specs a container gets.

A container opens a MIG device through its GPU's ``/dev/nvidia<minor>`` and two
capability nodes, the GPU instance's and the compute instance's. The nodes are given by
type and numbers, as NVIDIA's DRA driver gives them, so the runtime makes them without
looking for the host's node (which only nvidia-modprobe creates).
"""

from __future__ import annotations

from typing import Any

import jsonschema
from cdicheck import assert_valid_cdi

from drasil.driver.cdi.claimspecs import ClaimDevice, ClaimSpecRequest, build_claim_spec
from drasil.driver.cdi.spec import host_device_node
from drasil.driver.cdi.staticspec import build_device_spec
from drasil.driver.devices import CharDevice, Device, DeviceType

UID = "aaaaaaaa-0000-4000-8000-000000000001"
CAPS = tuple(
    CharDevice(f"/dev/nvidia-caps/nvidia-cap{n}", f"/dev/nvidia-caps/nvidia-cap{n}", 508, n)
    for n in (66, 67)
)
MIG = Device(
    name="gpu-1-mig-1g10gb-7-0",
    type=DeviceType.MIG,
    uuid="MIG-00000000-0000-4000-8000-000000000001",
    minor=1,
    attributes={},
    capacity={},
    parent_uuid="GPU-00000001",
    device_nodes=("/dev/nvidia1",),
    char_devices=CAPS,
)
WANT = [
    {"path": "/dev/nvidia1"},
    {"path": "/dev/nvidia-caps/nvidia-cap66", "type": "c", "major": 508, "minor": 66},
    {"path": "/dev/nvidia-caps/nvidia-cap67", "type": "c", "major": 508, "minor": 67},
]


def _nodes(spec: dict[str, Any]) -> list[Any]:
    (device,) = spec["devices"]
    nodes: list[Any] = device["containerEdits"]["deviceNodes"]
    return nodes


def test_a_claim_spec_gives_the_capability_nodes_by_number(
    schema_validator: jsonschema.Draft7Validator,
) -> None:
    req = ClaimSpecRequest(claim_uid=UID, namespace="ml", name="c", devices=(ClaimDevice(MIG),))
    spec = build_claim_spec(req, driver="gpu.drasil.dev")
    assert_valid_cdi(schema_validator, spec)
    assert _nodes(spec) == WANT


def test_the_static_spec_gives_them_too(schema_validator: jsonschema.Draft7Validator) -> None:
    spec = build_device_spec([MIG], driver="gpu.drasil.dev")
    assert_valid_cdi(schema_validator, spec)
    assert _nodes(spec) == WANT


def test_a_node_under_a_driver_root_keeps_its_dev_path_in_the_container() -> None:
    node = host_device_node("/run/nvidia/driver/dev/nvidia0")
    assert (node.path, node.host_path) == ("/dev/nvidia0", "/run/nvidia/driver/dev/nvidia0")
    assert host_device_node("/dev/nvidia0").host_path is None

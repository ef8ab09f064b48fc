"""A node prepares the DevicePool devices a claim holds (issue: attachable devices a
Pod can use): the device is read from its DevicePool, checked for this node (bound
here, attached), given to the container like a local GPU, and unprepared from the
checkpoint alone. The DevicePools come from an in-memory reader, the plugin's own
``PoolReader`` Protocol."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from kubelet_client import MemoryClaims, claim_json, make_preparer, ref_of, result, spec_file

from drasil.api.checkpoint import ClaimState
from drasil.api.devicepool import parse_devicepool
from drasil.driver.checkpoint import CHECKPOINT_DIR
from drasil.driver.devicepools import simulated_uuid
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.dra.reconcile import rebuild_from_specs

UID = "0b7c3f2e-8d1a-4c55-9e0f-1a2b3c4d5e6f"
OTHER = "1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f9"
ATTACHED = "drasil.dev/Attached"
POOL = "fabric"
POOL_API = "drasil.dev/v1alpha1"


class MemoryPools:
    """A PoolReader over DevicePools held in memory; counts its reads."""

    def __init__(self, *pools: dict[str, Any]) -> None:
        self.pools = {p["metadata"]["name"]: p for p in pools}
        self.reads = 0

    def get_device_pool(self, name: str) -> dict[str, Any] | None:
        self.reads += 1
        return self.pools.get(name)


def device_pool(*devices: dict[str, Any], fabric: bool = True, driver: str | None = None) -> Any:
    spec: dict[str, Any] = {"allNodes": True, "devices": list(devices)}
    if fabric:
        spec["simulatedFabric"] = {"attachSeconds": 1}
    if driver:
        spec["driver"] = driver
    meta = {"name": POOL, "uid": "6c1d0a0e-0000-4000-8000-000000000001"}
    return {
        "apiVersion": "drasil.dev/v1alpha1",
        "kind": "DevicePool",
        "metadata": meta,
        "spec": spec,
    }


def attachable(name: str, **attributes: Any) -> dict[str, Any]:
    return {
        "name": name,
        "bindsToNode": True,
        "bindingConditions": [ATTACHED],
        "attributes": {k: {"string": v} for k, v in attributes.items()},
        "capacity": {"memory": {"value": "24Gi"}},
    }


def pool_claim(
    uid: str, device: str, *, node: str = "n1", attached: bool = True, pool: str = POOL
) -> dict[str, Any]:
    """A claim allocated ``device`` of the pool, limited to ``node``, attached or not."""
    entry = result(device, pool=pool)
    entry["bindingConditions"] = [ATTACHED]
    claim = claim_json(uid, entry)
    allocation = claim["status"]["allocation"]
    allocation["nodeSelector"] = {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        ]
    }
    status = "True" if attached else "False"
    claim["status"]["devices"] = [
        {
            "driver": entry["driver"],
            "pool": pool,
            "device": device,
            "conditions": [{"type": ATTACHED, "status": status, "reason": "Attached"}],
        }
    ]
    return claim


def setup(tmp_path: Path, pools: MemoryPools, *claims: dict[str, Any]) -> Preparer:
    preparer = make_preparer(tmp_path, MemoryClaims(*claims))
    preparer.pools = pools
    return preparer


def env_of(path: Path) -> dict[str, str]:
    spec = json.loads(path.read_text())
    edits = [spec.get("containerEdits") or {}, *(d["containerEdits"] for d in spec["devices"])]
    return dict(item.split("=", 1) for e in edits for item in e.get("env", []))


def test_an_attached_fabric_device_is_prepared_as_a_simulated_gpu(tmp_path: Path) -> None:
    pools = MemoryPools(device_pool(attachable("fab-0"), attachable("fab-1")))
    claim = pool_claim(UID, "fab-1")
    preparer = setup(tmp_path, pools, claim)

    outcome = preparer.prepare(ref_of(claim))

    assert outcome.error == ""
    [device] = outcome.devices
    assert (device.pool_name, device.device_name) == (POOL, "fab-1")
    env = env_of(spec_file(tmp_path, UID))
    uuid = simulated_uuid(parse_devicepool(pools.pools[POOL]), "fab-1")
    assert uuid.startswith("GPU-")
    # The per-device contract of a local GPU, and where it came from.
    assert env["DRASIL_DEVICE_FAB_1"] == uuid
    assert env["DRASIL_DEVICE_FAB_1_POOL"] == POOL
    assert not [k for k in env if k.startswith("DRASIL_DEVICE_GPU_")]
    # Its KEP-5304 metadata carries the pool's attributes and capacity.
    [metadata] = (tmp_path / "state").rglob("*gpu*.json")
    text = metadata.read_text()
    assert '"fab-1"' in text
    assert uuid in text
    assert str(24 * 2**30) in text

    record = preparer.store.get(UID)
    assert record is not None
    assert record.state == ClaimState.PREPARE_COMPLETED
    # Unprepare needs neither the API nor the DevicePool.
    pools.pools.clear()
    assert preparer.unprepare(ref_of(claim)) == ""
    assert preparer.store.get(UID) is None
    assert not spec_file(tmp_path, UID).exists()


def test_a_pool_uuid_attribute_is_the_device_uuid(tmp_path: Path) -> None:
    uuid = "GPU-11111111-2222-3333-4444-555555555555"
    pools = MemoryPools(device_pool(attachable("fab-0", uuid=uuid), fabric=False))
    claim = pool_claim(UID, "fab-0")
    assert setup(tmp_path, pools, claim).prepare(ref_of(claim)).error == ""
    assert env_of(spec_file(tmp_path, UID))["DRASIL_DEVICE_FAB_0"] == uuid


def test_a_device_that_is_not_attached_is_refused(tmp_path: Path) -> None:
    pools = MemoryPools(device_pool(attachable("fab-0")))
    claim = pool_claim(UID, "fab-0", attached=False)
    outcome = setup(tmp_path, pools, claim).prepare(ref_of(claim))
    assert outcome.error == (
        'request "gpu": device "fab-0" of pool "fabric" is not attached: binding condition '
        "drasil.dev/Attached is not True in the claim's status.devices"
    )
    assert not spec_file(tmp_path, UID).exists()


def test_a_device_bound_to_another_node_is_refused(tmp_path: Path) -> None:
    pools = MemoryPools(device_pool(attachable("fab-0")))
    claim = pool_claim(UID, "fab-0", node="n2")
    outcome = setup(tmp_path, pools, claim).prepare(ref_of(claim))
    assert outcome.error == (
        'request "gpu": device "fab-0" of pool "fabric" is allocated to node \'n2\', '
        "not to this node (n1)"
    )


def test_a_pool_that_is_gone_or_changed_is_a_claim_error(tmp_path: Path) -> None:
    claim = pool_claim(UID, "fab-0")
    gone = setup(tmp_path / "a", MemoryPools(), claim).prepare(ref_of(claim))
    assert "the pool is neither this node's (n1) nor a DevicePool" in gone.error
    removed = MemoryPools(device_pool(attachable("fab-1")))
    outcome = setup(tmp_path / "b", removed, claim).prepare(ref_of(claim))
    assert outcome.error.endswith(": the DevicePool no longer lists the device")
    other = MemoryPools(device_pool(attachable("fab-0"), driver="other.example.com"))
    outcome = setup(tmp_path / "c", other, claim).prepare(ref_of(claim))
    assert "the DevicePool is driver other.example.com's, not gpu.drasil.dev's" in outcome.error


def test_a_plain_pool_device_lets_the_pod_start(tmp_path: Path) -> None:
    """Not node-bound, no binding conditions: prepared wherever the Pod runs."""
    plain = {"name": "remote-0", "attributes": {"type": {"string": "remote-gpu"}}}
    pools = MemoryPools(device_pool(plain, fabric=False))
    claim = claim_json(UID, result("remote-0", pool=POOL))
    outcome = setup(tmp_path, pools, claim).prepare(ref_of(claim))
    assert outcome.error == ""
    env = env_of(spec_file(tmp_path, UID))
    assert env["DRASIL_DEVICE_REMOTE_0"] == ""  # no UUID: the pool gave none
    assert env["DRASIL_DEVICE_REMOTE_0_POOL"] == POOL


def test_one_claim_cannot_hold_two_devices_of_one_name(tmp_path: Path) -> None:
    pools = MemoryPools(device_pool({"name": "gpu-0"}, fabric=False))
    claim = claim_json(UID, result("gpu-0"), result("gpu-0", pool=POOL, request="remote"))
    outcome = setup(tmp_path, pools, claim).prepare(ref_of(claim))
    assert 'devices "gpu-0" of pools "n1" and "fabric"' in outcome.error


def test_a_pool_device_is_held_once_and_apart_from_the_node_gpu_of_its_name(
    tmp_path: Path,
) -> None:
    pools = MemoryPools(device_pool({"name": "gpu-0"}, fabric=False))
    first = claim_json(UID, result("gpu-0", pool=POOL))
    second = claim_json(OTHER, result("gpu-0", pool=POOL))
    local = claim_json("2a3b4c5d-6e7f-4a8b-9c0d-e1f2a3b4c5d6", result("gpu-0"))
    preparer = setup(tmp_path, pools, first, second, local)
    assert preparer.prepare(ref_of(first)).error == ""
    # The node's gpu-0 is another device: free.
    assert preparer.prepare(ref_of(local)).error == ""
    held = preparer.prepare(ref_of(second))
    assert held.error.startswith('device "gpu-0" is already prepared for claim default/')
    assert pools.reads == 2  # one per prepare that read the claim


def test_without_a_pool_reader_pool_devices_are_not_this_nodes(tmp_path: Path) -> None:
    claim = pool_claim(UID, "fab-0")
    preparer = make_preparer(tmp_path, MemoryClaims(claim))
    outcome = preparer.prepare(ref_of(claim))
    assert 'device "fab-0" of pool "fabric" is not a device of driver' in outcome.error


def test_a_lost_checkpoint_is_rebuilt_with_the_devices_pool(tmp_path: Path) -> None:
    """A spec rebuilt into the checkpoint keeps its device apart from the node GPU of
    the same name (its ``…_POOL`` variable says which pool it came from)."""
    pools = MemoryPools(device_pool({"name": "gpu-0"}, fabric=False))
    claim = claim_json(UID, result("gpu-0", pool=POOL))
    setup(tmp_path, pools, claim).prepare(ref_of(claim))
    shutil.rmtree(tmp_path / "state" / CHECKPOINT_DIR)
    again = setup(tmp_path, pools, claim)
    again.store.load_or_quarantine()
    assert rebuild_from_specs(again) == 1
    record = again.store.get(UID)
    assert record is not None
    assert [(d.pool_name, d.device_name) for d in record.devices] == [(POOL, "gpu-0")]


class _Forbidden(Exception):
    """What the API client raises for a 403 (status and reason, as http_answer reads)."""

    status = 403
    reason = "Forbidden"


class ForbiddenPools:
    def get_device_pool(self, name: str) -> dict[str, Any] | None:
        raise _Forbidden


def test_a_plugin_that_may_not_read_the_pool_says_which_rbac_it_lacks(tmp_path: Path) -> None:
    claim = pool_claim(UID, "fab-0")
    preparer = make_preparer(tmp_path, MemoryClaims(claim))
    preparer.pools = ForbiddenPools()
    assert preparer.prepare(ref_of(claim)).error == (
        "DevicePool fabric: the plugin may not read it (403 Forbidden); its ClusterRole "
        "needs get on devicepools.drasil.dev (upgrade the chart)"
    )

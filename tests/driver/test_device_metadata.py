"""KEP-5304 device metadata: the plan's metadata, the file format, the CDI mounts and
what a container sees of them (``drasil.driver.cdi.metadata``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from drasil.driver.cdi.claimspecs import build_claim_spec
from drasil.driver.cdi.metadata import (
    ClaimMetadata,
    RequestMetadata,
    container_path,
    delete_claim_metadata,
    encode_metadata,
    list_claim_metadata,
    write_claim_metadata,
)
from drasil.driver.cdi.spec import CdiSpecError
from drasil.driver.claims.plan import (
    ClaimRef,
    NodePool,
    PreparePlan,
    metadata_attributes,
    plan_prepare,
)
from drasil.driver.devices import NUMA_NODE_ATTRIBUTE
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.simulated.nvml import simulated_library

DRIVER = "gpu.drasil.dev"
NODE = "node-a"
UID = "0b7c3f2e-8d1a-4c55-9e0f-1a2b3c4d5e6f"
REF = ClaimRef(namespace="ml", name="train", uid=UID)
ROOT = Path("/var/lib/kubelet/plugins/gpu.drasil.dev/dra-device-metadata")
BASE = "/var/run/kubernetes.io/dra-device-attributes"


def devices(profile: str, **kwargs: Any) -> NodePool:
    found = discover(simulated_library(profile, node_name=NODE), node_name=NODE, **kwargs)
    return NodePool(
        driver=DRIVER,
        pool=NODE,
        devices={d.name: d for d in found.devices},
        metadata_root=ROOT,
    )


def claim(*results: dict[str, Any], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": "ml", "name": "train", "uid": UID}
    if annotations:
        meta["annotations"] = annotations
    return {
        "metadata": meta,
        "status": {"allocation": {"devices": {"results": list(results), "config": []}}},
    }


def result(device: str, request: str = "gpu", **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": DRIVER, "pool": NODE, "device": device, **extra}


def plan(node: NodePool, *results: dict[str, Any], **kwargs: Any) -> PreparePlan:
    return plan_prepare(claim(*results, **kwargs), ref=REF, node=node)


def documents(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.decode().splitlines()]


def test_a_whole_gpu_is_described_as_published_newest_version_first() -> None:
    node = devices("h100-80gb:8")
    p = plan(node, result("gpu-5"))
    assert p.metadata is not None
    (request,) = p.metadata.requests
    newest, oldest = documents(encode_metadata(p.metadata, request, driver=DRIVER))
    assert newest["apiVersion"] == "metadata.resource.k8s.io/v1beta1"
    assert oldest["apiVersion"] == "metadata.resource.k8s.io/v1alpha1"
    assert {k: v for k, v in newest.items() if k != "apiVersion"} == {
        k: v for k, v in oldest.items() if k != "apiVersion"
    }
    assert newest["kind"] == "DeviceMetadata"
    assert newest["metadata"] == {"name": "train", "namespace": "ml", "uid": UID, "generation": 1}
    assert "podClaimName" not in newest
    (req,) = newest["requests"]
    assert req["name"] == "gpu"
    (device,) = req["devices"]
    gpu = node.devices["gpu-5"]
    assert (device["driver"], device["pool"], device["name"]) == (DRIVER, NODE, "gpu-5")
    attributes = device["attributes"]
    assert attributes["uuid"] == {"string": gpu.uuid}
    assert attributes["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert attributes["cudaComputeCapability"] == {"version": "9.0.0"}
    assert attributes["resource.kubernetes.io/pciBusID"]["string"].startswith("0000:")
    assert attributes[NUMA_NODE_ATTRIBUTE] == {"int": 1}
    # The capacity the claim gets, as an int attribute (bytes).
    assert attributes["memory"] == {"int": gpu.capacity["memory"]}
    assert len(attributes) <= 32


def test_a_mig_device_carries_its_profile_and_capacities() -> None:
    node = devices("a100-40gb-mig:1")
    name = next(n for n in node.devices if "1g5gb" in n)
    got = metadata_attributes(plan(node, result(name)).devices[0])
    assert got["profile"] == "1g.5gb"
    assert got["parentUUID"] == node.devices[name].parent_uuid
    assert got["multiprocessors"] == 14
    assert len(got) <= 32


def test_a_share_says_its_share_and_what_it_consumed() -> None:
    node = devices("h100-80gb:2", gpu_sharing="consumable")
    consumed = {"memory": "10Gi", "computePercent": "25"}
    p = plan(node, result("gpu-0", shareID="s-1", consumedCapacity=consumed))
    assert p.metadata is not None
    (request,) = p.metadata.requests
    (doc, _) = documents(encode_metadata(p.metadata, request, driver=DRIVER))
    attributes = doc["requests"][0]["devices"][0]["attributes"]
    assert attributes["shareID"] == {"string": "s-1"}
    assert attributes["memory"] == {"int": 10 * 2**30}
    assert attributes["computePercent"] == {"int": 25}


def test_each_request_gets_one_mount_on_its_first_device() -> None:
    node = devices("h100-80gb:8")
    p = plan(node, result("gpu-0", "a"), result("gpu-1", "a"), result("gpu-4", "b/full"))
    assert [d.prepared.cdi_device_ids for d in p.devices] == [
        (f"k8s.{DRIVER}/claim={UID}-gpu-0", f"k8s.{DRIVER}/claim={UID}_a"),
        (f"k8s.{DRIVER}/claim={UID}-gpu-1",),
        (f"k8s.{DRIVER}/claim={UID}-gpu-4", f"k8s.{DRIVER}/claim={UID}_b"),
    ]
    assert p.metadata is not None
    assert [r.request for r in p.metadata.requests] == ["a", "b/full"]
    spec = build_claim_spec(p.spec, driver=DRIVER)
    mounts = {d["name"]: d["containerEdits"] for d in spec["devices"] if "_" in d["name"]}
    assert mounts == {
        f"{UID}_a": {
            "mounts": [
                {
                    "hostPath": f"{ROOT}/{UID}/a.json",
                    "containerPath": f"{BASE}/resourceclaims/train/a/{DRIVER}-metadata.json",
                    "options": ["ro", "bind"],
                }
            ]
        },
        f"{UID}_b": {
            "mounts": [
                {
                    "hostPath": f"{ROOT}/{UID}/b.json",
                    "containerPath": f"{BASE}/resourceclaims/train/b/{DRIVER}-metadata.json",
                    "options": ["ro", "bind"],
                }
            ]
        },
    }
    # The subrequest stays in the file, as the allocation names it.
    (doc, _) = documents(encode_metadata(p.metadata, p.metadata.requests[1], driver=DRIVER))
    assert doc["requests"][0]["name"] == "b/full"


def test_a_claim_from_a_template_is_found_by_its_pod_claim_name() -> None:
    node = devices("h100-80gb:1")
    p = plan(node, result("gpu-0"), annotations={"resource.kubernetes.io/pod-claim-name": "gpus"})
    assert p.metadata is not None
    assert p.metadata.pod_claim_name == "gpus"
    (mount,) = p.spec.metadata
    expected = f"{BASE}/resourceclaimtemplates/gpus/gpu/{DRIVER}-metadata.json"
    assert mount.mount.container_path == expected
    (doc, _) = documents(encode_metadata(p.metadata, p.metadata.requests[0], driver=DRIVER))
    assert doc["podClaimName"] == "gpus"


@pytest.mark.parametrize(
    ("name", "pod_claim", "request_name"),
    [
        ("../etc", None, "gpu"),
        ("train", "../x", "gpu"),
        ("train", None, "a/../b"),
        ("train", None, ""),
    ],
)
def test_a_name_that_could_leave_its_directory_is_refused(
    name: str, pod_claim: str | None, request_name: str
) -> None:
    metadata = ClaimMetadata(UID, "ml", name, pod_claim, (RequestMetadata(request_name, ()),))
    with pytest.raises(CdiSpecError, match="device metadata"):
        container_path(metadata, request_name, driver=DRIVER)


def test_without_a_metadata_root_nothing_changes() -> None:
    node = devices("h100-80gb:1")
    bare = NodePool(driver=DRIVER, pool=NODE, devices=node.devices)
    p = plan(bare, result("gpu-0"))
    assert p.metadata is None
    assert p.spec.metadata == ()
    assert p.devices[0].prepared.cdi_device_ids == (f"k8s.{DRIVER}/claim={UID}-gpu-0",)


def test_files_are_written_once_and_removed_whole(tmp_path: Path) -> None:
    node = devices("h100-80gb:2")
    p = plan(node, result("gpu-0", "a"), result("gpu-1", "b"))
    assert p.metadata is not None
    write_claim_metadata(p.metadata, driver=DRIVER, root=tmp_path)
    files = sorted(p.name for p in (tmp_path / UID).iterdir())
    assert files == ["a.json", "b.json"]
    assert (tmp_path / UID / "a.json").stat().st_mode & 0o777 == 0o644
    before = (tmp_path / UID / "a.json").stat().st_mtime_ns
    (tmp_path / UID / "a.json.123.tmp").write_text("crashed write")
    write_claim_metadata(p.metadata, driver=DRIVER, root=tmp_path)
    assert (tmp_path / UID / "a.json").stat().st_mtime_ns == before  # unchanged: untouched
    assert sorted(p.name for p in (tmp_path / UID).iterdir()) == files  # temp swept
    assert list_claim_metadata(tmp_path) == [UID]
    assert delete_claim_metadata(tmp_path, UID)
    assert not delete_claim_metadata(tmp_path, UID)
    assert list_claim_metadata(tmp_path) == []

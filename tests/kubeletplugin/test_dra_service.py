"""DRAPlugin v1 and v1beta1 as kubelet calls them: a real gRPC server on a unix socket."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
from kubelet_client import (
    DEADLINE,
    KubeNames,
    MemoryClaims,
    claim_json,
    make_preparer,
    node_devices,
    result,
    serving,
    spec_file,
)

from drasil.api.kubelet.dra.v1 import dra_pb2 as v1
from drasil.api.kubelet.dra.v1 import dra_pb2_grpc as v1_grpc
from drasil.api.kubelet.dra.v1beta1 import dra_pb2 as v1beta1
from drasil.api.kubelet.dra.v1beta1 import dra_pb2_grpc as v1beta1_grpc
from drasil.driver.cdi import claimspecs
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.dra.service import ClaimWork, DRAPluginV1, DRAPluginV1beta1
from drasil.kubeletplugin.metrics import PluginMetrics

UID_GOOD = "0b7c3f2e-8d1a-4c55-9e0f-1a2b3c4d5e6f"
UID_BAD = "1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f9"
UID_SHARED = "2a3b4c5d-6e7f-4a8b-9c0d-e1f2a3b4c5d6"
VERSIONS = [
    pytest.param((v1, v1_grpc), id="v1"),
    pytest.param((v1beta1, v1beta1_grpc), id="v1beta1"),
]


@contextmanager
def plugin(
    tmp_path: Path, reader: MemoryClaims
) -> Iterator[tuple[Preparer, PluginMetrics, grpc.Channel]]:
    preparer = make_preparer(tmp_path, reader)
    metrics = PluginMetrics()
    work = ClaimWork(preparer, metrics)

    def add(server: grpc.Server) -> None:
        v1_grpc.add_DRAPluginServicer_to_server(DRAPluginV1(work), server)
        v1beta1_grpc.add_DRAPluginServicer_to_server(DRAPluginV1beta1(work), server)

    with serving(add) as (_, channel):
        yield preparer, metrics, channel


def claims_of(pb: ModuleType, *specs: tuple[str, str, str]) -> list[Any]:
    return [pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in specs]


@pytest.mark.parametrize("versions", VERSIONS)
def test_prepare_answers_every_claim_by_uid(
    tmp_path: Path, versions: tuple[ModuleType, ModuleType]
) -> None:
    pb, pb_grpc = versions
    reader = MemoryClaims(claim_json(UID_GOOD, result("gpu-1"), name="good", namespace="ml"))
    with plugin(tmp_path, reader) as (_, metrics, channel):
        stub = pb_grpc.DRAPluginStub(channel)
        response = stub.NodePrepareResources(
            pb.NodePrepareResourcesRequest(
                claims=claims_of(pb, ("ml", "good", UID_GOOD), ("ml", "missing", UID_BAD))
            ),
            timeout=DEADLINE,
        )
        assert set(response.claims) == {UID_GOOD, UID_BAD}

        bad = response.claims[UID_BAD]
        assert bad.error == "ResourceClaim ml/missing not found"
        assert list(bad.devices) == []

        good = response.claims[UID_GOOD]
        assert good.error == ""
        assert len(good.devices) == 1
        device = good.devices[0]
        assert list(device.request_names) == ["gpu"]
        assert (device.pool_name, device.device_name) == ("n1", "gpu-1")
        assert list(device.cdi_device_ids) == [
            f"k8s.gpu.drasil.dev/claim={UID_GOOD}-gpu-1",
            f"k8s.gpu.drasil.dev/claim={UID_GOOD}_gpu",  # the request's metadata mount
        ]
        if pb is v1:
            assert not device.HasField("share_id")
        assert spec_file(tmp_path, UID_GOOD).is_file()

        samples = metrics.registry.get_sample_value
        assert (
            samples("drasil_claim_operations_total", {"operation": "prepare", "result": "success"})
            == 1
        )
        assert (
            samples("drasil_claim_operations_total", {"operation": "prepare", "result": "error"})
            == 1
        )

        response = stub.NodeUnprepareResources(
            pb.NodeUnprepareResourcesRequest(
                claims=claims_of(pb, ("ml", "good", UID_GOOD), ("ml", "missing", UID_BAD))
            ),
            timeout=DEADLINE,
        )
        assert {uid: entry.error for uid, entry in response.claims.items()} == {
            UID_GOOD: "",
            UID_BAD: "",
        }
        assert not spec_file(tmp_path, UID_GOOD).exists()
        assert (
            samples(
                "drasil_claim_operations_total", {"operation": "unprepare", "result": "success"}
            )
            == 2
        )


@pytest.mark.parametrize("versions", VERSIONS)
def test_one_call_prepares_all_claims_of_a_pod(
    tmp_path: Path, versions: tuple[ModuleType, ModuleType]
) -> None:
    pb, pb_grpc = versions
    names = sorted(node_devices())
    uids = [f"{i:08x}-0000-4000-8000-000000000000" for i in range(len(names))]
    reader = MemoryClaims(
        *(
            claim_json(uid, result(name), name=f"c{i}")
            for i, (uid, name) in enumerate(zip(uids, names, strict=True))
        )
    )
    with plugin(tmp_path, reader) as (preparer, _, channel):
        stub = pb_grpc.DRAPluginStub(channel)
        request = pb.NodePrepareResourcesRequest(
            claims=claims_of(pb, *(("default", f"c{i}", uid) for i, uid in enumerate(uids)))
        )
        response = stub.NodePrepareResources(request, timeout=DEADLINE)
        assert {uid: [d.device_name for d in e.devices] for uid, e in response.claims.items()} == {
            uid: [name] for uid, name in zip(uids, names, strict=True)
        }
        assert all(e.error == "" for e in response.claims.values())
        # kubelet repeats the call after its own restart: same answer.
        assert stub.NodePrepareResources(request, timeout=DEADLINE) == response
        assert len(preparer.store.claims()) == len(uids)


def test_empty_requests_get_empty_answers(tmp_path: Path) -> None:
    with plugin(tmp_path, MemoryClaims()) as (_, _, channel):
        stub = v1_grpc.DRAPluginStub(channel)
        assert (
            stub.NodePrepareResources(v1.NodePrepareResourcesRequest(), timeout=DEADLINE).claims
            == {}
        )
        assert (
            stub.NodeUnprepareResources(v1.NodeUnprepareResourcesRequest(), timeout=DEADLINE).claims
            == {}
        )


def test_v1_reports_the_share_id_and_v1beta1_has_none(tmp_path: Path) -> None:
    reader = MemoryClaims(claim_json(UID_SHARED, result("gpu-0", share_id="s-1"), name="shared"))
    with plugin(tmp_path, reader) as (_, _, channel):
        request_v1 = v1.NodePrepareResourcesRequest(
            claims=claims_of(v1, ("default", "shared", UID_SHARED))
        )
        device = (
            v1_grpc.DRAPluginStub(channel)
            .NodePrepareResources(request_v1, timeout=DEADLINE)
            .claims[UID_SHARED]
            .devices[0]
        )
        assert device.HasField("share_id")
        assert device.share_id == "s-1"

        request_beta = v1beta1.NodePrepareResourcesRequest(
            claims=claims_of(v1beta1, ("default", "shared", UID_SHARED))
        )
        beta = (
            v1beta1_grpc.DRAPluginStub(channel)
            .NodePrepareResources(request_beta, timeout=DEADLINE)
            .claims[UID_SHARED]
            .devices[0]
        )
        assert "share_id" not in {f.name for f in beta.DESCRIPTOR.fields}
        assert (beta.device_name, list(beta.cdi_device_ids)) == (
            device.device_name,
            list(device.cdi_device_ids),
        )


def test_v1beta1_answers_carry_no_v1_only_field_on_the_wire(tmp_path: Path) -> None:
    reader = MemoryClaims(claim_json(UID_SHARED, result("gpu-0", share_id="s-1"), name="shared"))
    with plugin(tmp_path, reader) as (_, _, channel):
        request = v1beta1.NodePrepareResourcesRequest(
            claims=claims_of(v1beta1, ("default", "shared", UID_SHARED))
        )
        beta = v1beta1_grpc.DRAPluginStub(channel).NodePrepareResources(request, timeout=DEADLINE)
    # Read back as v1: a share_id (field 5) sent as an unknown field would show here.
    as_v1 = v1.NodePrepareResourcesResponse.FromString(beta.SerializeToString())
    (device,) = as_v1.claims[UID_SHARED].devices
    assert device.device_name == "gpu-0"
    assert not device.HasField("share_id")


# ---- faults that are not the claim's: every claim still gets its own answer ----------


@pytest.mark.parametrize("uid", ["", "a/b", "../evil"])
def test_unprepare_of_a_uid_no_file_can_have_answers_that_claim_alone(
    tmp_path: Path, uid: str
) -> None:
    reader = MemoryClaims(claim_json(UID_GOOD, result("gpu-1"), name="good", namespace="ml"))
    with plugin(tmp_path, reader) as (_, _metrics, channel):
        stub = v1_grpc.DRAPluginStub(channel)
        good = claims_of(v1, ("ml", "good", UID_GOOD))
        stub.NodePrepareResources(v1.NodePrepareResourcesRequest(claims=good), timeout=DEADLINE)
        both = claims_of(v1, ("ml", "good", UID_GOOD), ("ml", "evil", uid))

        response = stub.NodeUnprepareResources(
            v1.NodeUnprepareResourcesRequest(claims=both), timeout=DEADLINE
        )

        assert response.claims[UID_GOOD].error == ""
        assert response.claims[uid].error.startswith("unprepare of ResourceClaim ml/evil: ")
        assert "claimUID" in response.claims[uid].error
        assert not spec_file(tmp_path, UID_GOOD).exists()


def test_prepare_with_a_claim_name_no_claim_can_have(tmp_path: Path) -> None:
    reader = MemoryClaims(claim_json(UID_GOOD, result("gpu-1"), name="good", namespace="ml"))
    with plugin(tmp_path, reader) as (preparer, _metrics, channel):
        preparer.claims = KubeNames(reader)
        stub = v1_grpc.DRAPluginStub(channel)
        both = claims_of(v1, ("ml", "good", UID_GOOD), ("ml", "good?watch=true", UID_BAD))

        response = stub.NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=both), timeout=DEADLINE
        )

        assert response.claims[UID_GOOD].error == ""
        assert response.claims[UID_BAD].error == (
            "prepare of ResourceClaim ml/good?watch=true: ResourceClaim name "
            "'good?watch=true' is not a valid name: a DNS subdomain of at most 253 "
            "characters (lower-case letters, digits, '-', '.')"
        )
        assert preparer.store.get(UID_BAD) is None  # nothing recorded for it


def test_a_full_cdi_directory_fails_only_the_claims_that_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reader = MemoryClaims(
        claim_json(UID_GOOD, result("gpu-1"), name="good", namespace="ml"),
        claim_json(UID_BAD, result("gpu-2"), name="second", namespace="ml"),
    )
    with plugin(tmp_path, reader) as (_preparer, _metrics, channel):
        stub = v1_grpc.DRAPluginStub(channel)
        first = claims_of(v1, ("ml", "good", UID_GOOD))
        stub.NodePrepareResources(v1.NodePrepareResourcesRequest(claims=first), timeout=DEADLINE)

        def full(path: Path, data: bytes, **_: Any) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

        monkeypatch.setattr(claimspecs, "write_atomic", full)
        both = claims_of(v1, ("ml", "good", UID_GOOD), ("ml", "second", UID_BAD))

        response = stub.NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=both), timeout=DEADLINE
        )

        assert response.claims[UID_GOOD].error == ""  # prepared before: answered from state
        error = response.claims[UID_BAD].error
        assert error.startswith("prepare of ResourceClaim ml/second: ")
        assert "No space left on device" in error
        assert error.endswith("; kubelet retries the claim")


def test_an_allocation_without_our_devices_records_nothing(tmp_path: Path) -> None:
    other = result("nic-0", driver="net.example.com")
    reader = MemoryClaims(claim_json(UID_BAD, other, name="nic", namespace="ml"))
    with plugin(tmp_path, reader) as (preparer, _metrics, channel):
        stub = v1_grpc.DRAPluginStub(channel)
        response = stub.NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=claims_of(v1, ("ml", "nic", UID_BAD))),
            timeout=DEADLINE,
        )
        assert response.claims[UID_BAD].error == (
            "the claim's allocation has no device of driver gpu.drasil.dev"
        )
        assert preparer.store.get(UID_BAD) is None

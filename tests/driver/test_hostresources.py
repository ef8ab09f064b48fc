"""Host resources with a GPU (``--host-resources-per-gpu``): parsing, which devices
carry them, how slices publish and compare them, and a server that drops them."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from drasil.driver.devices import Device, DeviceType
from drasil.driver.hostresources import (
    HostResourcesError,
    parse_host_resources,
    with_host_resources,
)
from drasil.driver.slices.build import build_slices
from drasil.driver.slices.plan import comparable
from drasil.driver.slices.publisher import PoolPublisher, _without
from drasil.kubeletplugin.options import OptionsError, parse_options


def test_parse_names_and_amounts() -> None:
    assert parse_host_resources("") == {}
    assert parse_host_resources(" cpu=8, memory=32Gi ,hugepages-2Mi=1Gi") == {
        "cpu": "8",
        "memory": "32Gi",
        "hugepages-2Mi": "1Gi",
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nvidia.com/gpu=1", "'nvidia.com/gpu' is not a node-allocatable resource; allowed: cpu"),
        ("pods=3", "'pods' is not a node-allocatable resource"),
        ("cpu", "'cpu' is not <resource>=<amount>"),
        ("cpu=0", "cpu: '0' is not a positive amount"),
        ("memory=-1Gi", "memory: '-1Gi' is not a positive amount"),
        ("cpu=lots", "cpu: "),
        ("cpu=1,cpu=2", "cpu is given twice"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(text: str, message: str) -> None:
    with pytest.raises(HostResourcesError, match="--host-resources-per-gpu: ") as err:
        parse_host_resources(text)
    assert message in str(err.value)


def _device(name: str, kind: DeviceType, *, shared: bool = False) -> Device:
    return Device(
        name=name,
        type=kind,
        uuid=f"GPU-{name}",
        minor=0,
        attributes={"type": kind.value},
        capacity={"memory": 80 * 2**30},
        allow_multiple_allocations=shared,
    )


def test_only_whole_gpus_one_claim_holds_carry_them() -> None:
    devices = [
        _device("gpu-0", DeviceType.GPU),
        _device("gpu-1", DeviceType.GPU, shared=True),
        _device("gpu-2-mig-1g.10gb-0", DeviceType.MIG),
        _device("amdgpu-0", DeviceType.AMDGPU),
        _device("amdgpu-1-cpx-0", DeviceType.AMDGPU_PARTITION),
    ]
    per_gpu = {"cpu": "8", "memory": "32Gi"}
    carried = {d.name: dict(d.host_resources) for d in with_host_resources(devices, per_gpu)}
    assert carried == {
        "gpu-0": per_gpu,
        "gpu-1": {},
        "gpu-2-mig-1g.10gb-0": {},
        "amdgpu-0": per_gpu,
        "amdgpu-1-cpx-0": {},
    }
    assert with_host_resources(devices, {}) == devices


def _slices(per_gpu: dict[str, str]) -> list[dict[str, Any]]:
    devices = with_host_resources([_device("gpu-0", DeviceType.GPU)], per_gpu)
    return build_slices(
        driver="gpu.drasil.dev",
        pool="n1",
        node_name="n1",
        devices=devices,
        generation=1,
        owner=None,
    )


def test_slices_publish_an_overhead_per_pod_compared_by_value() -> None:
    [published] = _slices({"memory": "32Gi", "cpu": "8"})
    [device] = published["spec"]["devices"]
    assert device["nodeAllocatableResources"] == {
        "cpu": {"overhead": {"perPod": "8"}},
        "memory": {"overhead": {"perPod": "32Gi"}},
    }
    [same] = _slices({"cpu": "8000m", "memory": str(32 * 2**30)})
    [other] = _slices({"cpu": "4", "memory": "32Gi"})
    assert comparable(same) == comparable(published)
    assert comparable(other) != comparable(published)


class _Dropping:
    """Answers writes as an API server with the feature gate off stores them."""

    def __init__(self) -> None:
        self.writes: list[dict[str, Any]] = []

    def list_slices(self, *, driver: str, pool: str) -> list[dict[str, Any]]:
        return [dict(w, metadata={**w["metadata"], "resourceVersion": "1"}) for w in self.writes]

    def create_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        stored = _without(obj, {"nodeAllocatableResources"})
        self.writes.append(stored)
        return stored


def test_a_field_the_server_drops_is_named_once_and_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = _Dropping()
    publisher = PoolPublisher(server, driver="gpu.drasil.dev", pool="n1")  # type: ignore[arg-type]
    desired = _slices({"cpu": "8"})
    with caplog.at_level(logging.WARNING):
        assert publisher.publish(desired).writes == 1
        # The next publish finds the server's slices equal: no write loop.
        assert publisher.publish(desired).writes == 0
    assert publisher.dropped == {"nodeAllocatableResources"}
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert getattr(warning, "featureGate", "") == "DRANodeAllocatableResources"


def test_the_plugin_option_and_its_env() -> None:
    opts = parse_options(["--node-name=n1"], {"HOST_RESOURCES_PER_GPU": "cpu=2,memory=8Gi"})
    assert dict(opts.host_resources_per_gpu) == {"cpu": "2", "memory": "8Gi"}
    assert dict(parse_options(["--node-name=n1"], {}).host_resources_per_gpu) == {}
    with pytest.raises(OptionsError, match=r"--host-resources-per-gpu: 'nvidia\.com/gpu' is not"):
        parse_options(["--node-name=n1", "--host-resources-per-gpu=nvidia.com/gpu=1"], {})

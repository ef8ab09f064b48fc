"""The controller's InvalidDeviceConfig Events for a sharing strategy drasil would not
apply: MPS for a request with admin access (MPS on every other GPU and MIG device is
applied, shared or allocated whole); the claim and its Pods hear it at creation, before
any node prepares the claim."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from drasil.controller.controller import Controller
from drasil.controller.metrics import ControllerMetrics
from drasil.controller.options import parse_options
from drasil.driver.kubeapi import KubeApi

DRIVER = "gpu.drasil.dev"
API = "resource.drasil.dev/v1beta1"
MPS_ON_AN_ADMIN_REQUEST = (
    'spec.devices.config[0].opaque.parameters.sharing.strategy: unsupported value "MPS" '
    "for a device of an admin-access request: such a request sits beside the claim that "
    'holds the device and takes no sharing of its own; allowed values are "Exclusive", '
    '"TimeSlicing" (or no config for that request)'
)


def gpu_slice(name: str, *, shared: bool) -> dict[str, Any]:
    device: dict[str, Any] = {"name": "gpu-0"}
    if shared:
        device["allowMultipleAllocations"] = True
    return {
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
            "nodeName": name,
            "devices": [{"name": "mig-0"}, device],
        },
    }


def claim(kind: str, strategy: str = "MPS", *, admin: bool = False) -> dict[str, Any]:
    parameters = {"apiVersion": API, "kind": kind, "sharing": {"strategy": strategy}}
    exactly = {"deviceClassName": DRIVER, **({"adminAccess": True} if admin else {})}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "job", "namespace": "team-a", "uid": "uid-job"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": exactly}],
                "config": [
                    {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": parameters}}
                ],
            }
        },
    }


POD = {
    "metadata": {"name": "trainer", "namespace": "team-a", "uid": "uid-pod"},
    "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": "job"}]},
}


def controller(monkeypatch: pytest.MonkeyPatch, posted: list[dict[str, Any]]) -> Controller:
    configuration = client.Configuration()
    configuration.host = "https://127.0.0.1:6443"
    options = parse_options(["--kubeconfig=/dev/null"], env={})
    c = Controller(
        api=KubeApi(client.ApiClient(configuration)), options=options, metrics=ControllerMetrics()
    )
    c.view.put_pod(POD)
    monkeypatch.setattr(c.api, "post_event", lambda **event: posted.append(event) or True)
    return c


def test_mps_for_an_admin_access_request_is_an_event(monkeypatch: pytest.MonkeyPatch) -> None:
    posted: list[dict[str, Any]] = []
    c = controller(monkeypatch, posted)
    c.view.put_slice(gpu_slice("node-a", shared=False))

    assert c.configs.check(claim("GpuConfig", admin=True)) == [MPS_ON_AN_ADMIN_REQUEST]
    assert [(e["involved"]["kind"], e["reason"]) for e in posted] == [
        ("ResourceClaim", "InvalidDeviceConfig"),
        ("Pod", "InvalidDeviceConfig"),
    ]
    assert posted[0]["message"] == MPS_ON_AN_ADMIN_REQUEST
    assert posted[1]["message"] == f"ResourceClaim job: {MPS_ON_AN_ADMIN_REQUEST}"
    assert c.configs.check(claim("GpuConfig", "TimeSlicing", admin=True)) == []


def test_mps_for_whole_gpus_and_mig_devices_is_no_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the cluster publishes: MPS runs for devices allocated whole as for shares."""
    posted: list[dict[str, Any]] = []
    c = controller(monkeypatch, posted)
    for shared in (False, True):
        c.view.put_slice(gpu_slice("node-a", shared=shared))
        assert c.configs.check(claim("GpuConfig")) == []
        assert c.configs.check(claim("MigDeviceConfig")) == []
    assert posted == []

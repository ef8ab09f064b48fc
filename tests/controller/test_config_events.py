"""The controller's InvalidDeviceConfig Events for a sharing strategy drasil would not
apply: MPS for a MIG device always, and for a GPU while the cluster publishes no GPU
that can be shared (``--gpu-sharing consumable``); the claim and its Pods hear it at
creation, before any node prepares the claim."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from drasil.controller.controller import Controller
from drasil.controller.metrics import ControllerMetrics
from drasil.controller.options import parse_options
from drasil.controller.state import ClusterView
from drasil.driver.kubeapi import KubeApi

DRIVER = "gpu.drasil.dev"
API = "resource.drasil.dev/v1beta1"
MPS_ON_A_WHOLE_GPU = (
    'spec.devices.config[0].opaque.parameters.sharing.strategy: unsupported value "MPS" '
    "for a whole GPU: drasil runs no MPS daemon for one yet, so its containers would share "
    'it without MPS; allowed values are "Exclusive", "TimeSlicing"; MPS applies to shares '
    "of a consumable GPU (--gpu-sharing consumable, docs/sharing.md); no GPU in this "
    "cluster is consumable"
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


def claim(kind: str, strategy: str = "MPS") -> dict[str, Any]:
    parameters = {"apiVersion": API, "kind": kind, "sharing": {"strategy": strategy}}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "job", "namespace": "team-a", "uid": "uid-job"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}],
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


def test_mps_for_a_gpu_of_a_cluster_without_consumable_gpus_is_an_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    posted: list[dict[str, Any]] = []
    c = controller(monkeypatch, posted)
    c.view.put_slice(gpu_slice("node-a", shared=False))

    assert c.configs.check(claim("GpuConfig")) == [MPS_ON_A_WHOLE_GPU]
    assert [(e["involved"]["kind"], e["reason"]) for e in posted] == [
        ("ResourceClaim", "InvalidDeviceConfig"),
        ("Pod", "InvalidDeviceConfig"),
    ]
    assert posted[0]["message"] == MPS_ON_A_WHOLE_GPU
    assert posted[1]["message"] == f"ResourceClaim job: {MPS_ON_A_WHOLE_GPU}"


def test_mps_for_a_gpu_is_left_to_prepare_where_a_gpu_may_be_a_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    posted: list[dict[str, Any]] = []
    c = controller(monkeypatch, posted)
    # No slice of the driver seen yet (the controller just started): nothing is known.
    assert c.configs.check(claim("GpuConfig")) == []
    c.view.put_slice(gpu_slice("node-a", shared=False))
    c.view.put_slice(gpu_slice("node-b", shared=True))
    assert c.configs.check(claim("GpuConfig")) == []
    assert posted == []


def test_mps_for_a_mig_device_is_an_event_where_no_device_is_shared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    posted: list[dict[str, Any]] = []
    c = controller(monkeypatch, posted)
    c.view.put_slice(gpu_slice("node-b", shared=False))

    (problem,) = c.configs.check(claim("MigDeviceConfig"))
    assert problem.startswith(
        'spec.devices.config[0].opaque.parameters.sharing.strategy: unsupported value "MPS" '
        "for a MIG device: drasil runs no MPS daemon for one yet"
    )
    assert problem.endswith("no GPU in this cluster is consumable")
    assert c.configs.check(claim("MigDeviceConfig", "TimeSlicing")) == []
    # Where devices are shared (MIG placements too, in dynamic MIG), prepare decides.
    c.view.put_slice(gpu_slice("node-b", shared=True))
    assert c.configs.check(claim("MigDeviceConfig")) == []


def test_the_view_knows_whether_a_gpu_may_be_shared() -> None:
    view = ClusterView(driver=DRIVER)
    assert view.may_share_gpus()  # nothing seen: unknown, so not ruled out
    view.put_slice(gpu_slice("node-a", shared=False))
    assert not view.may_share_gpus()
    view.put_slice(gpu_slice("node-b", shared=True))
    view.put_slice({**gpu_slice("other", shared=False), "spec": {"driver": "nic.example.com"}})
    assert view.may_share_gpus()
    view.put_slice(gpu_slice("node-b", shared=False))  # the node went back to exclusive
    assert not view.may_share_gpus()
    view.put_slice(gpu_slice("node-b", shared=True))
    view.drop_slice(gpu_slice("node-b", shared=True))
    assert not view.may_share_gpus()
    view.drop_slice(gpu_slice("node-a", shared=False))
    assert view.may_share_gpus()

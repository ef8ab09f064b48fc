"""The controller keeps DeviceTaintRules from its watch and its Unsatisfiable Event
names the rule that taints the devices a claim could use."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes import client

from drasil.controller.controller import Controller
from drasil.controller.metrics import ControllerMetrics
from drasil.controller.options import parse_options
from drasil.driver.kubeapi import KubeApi

DRIVER = "gpu.drasil.dev"
CLASS = {
    "metadata": {"name": DRIVER},
    "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
}
SLICE = {
    "metadata": {"name": "node-a-gpus"},
    "spec": {
        "driver": DRIVER,
        "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
        "nodeName": "node-a",
        "devices": [{"name": "gpu-3"}],
    },
}
RULE = {
    "metadata": {"name": "drain-gpu-3"},
    "spec": {
        "deviceSelector": {"driver": DRIVER, "pool": "node-a", "device": "gpu-3"},
        "taint": {"key": "drasil.dev/drain", "effect": "NoSchedule"},
    },
}
CLAIM = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaim",
    "metadata": {"name": "job", "namespace": "team-a", "uid": "uid-job"},
    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
}
POD = {
    "metadata": {"name": "trainer", "namespace": "team-a", "uid": "uid-pod"},
    "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": "job"}]},
}


def _controller(monkeypatch: pytest.MonkeyPatch, posted: list[dict[str, Any]]) -> Controller:
    configuration = client.Configuration()
    configuration.host = "https://127.0.0.1:6443"
    options = parse_options(["--kubeconfig=/dev/null"], env={})
    controller = Controller(
        api=KubeApi(client.ApiClient(configuration)), options=options, metrics=ControllerMetrics()
    )
    controller.view.put_slice(SLICE)
    controller.view.put_class(CLASS)
    controller.view.put_claim(CLAIM)
    controller.view.put_pod(POD)
    monkeypatch.setattr(controller.api, "get_claim", lambda namespace, name, **_: CLAIM)
    monkeypatch.setattr(controller.api, "get_pod", lambda namespace, name: POD)
    monkeypatch.setattr(controller.api, "list_nodes", lambda: None)
    monkeypatch.setattr(controller.api, "post_event", lambda **event: posted.append(event) or True)
    return controller


def test_the_event_names_the_rule_until_it_is_deleted(monkeypatch: pytest.MonkeyPatch) -> None:
    posted: list[dict[str, Any]] = []
    controller = _controller(monkeypatch, posted)
    asyncio.run(controller.on_taint_rule({"type": "ADDED", "object": RULE}))

    message = controller.explanations.explain(("team-a", "job"))

    assert message is not None
    assert message.endswith("gpu-3 tainted by DeviceTaintRule drain-gpu-3 (NoSchedule)")
    assert [e["involved"]["kind"] for e in posted] == ["ResourceClaim", "Pod"]

    asyncio.run(controller.on_taint_rule({"type": "DELETED", "object": RULE}))
    assert controller.explanations.explain(("team-a", "job")) is None

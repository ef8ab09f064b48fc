"""The controller's Events on a pending claim carry the explanation's counter wording."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from drasil.controller.controller import Controller
from drasil.controller.events import UNSATISFIABLE
from drasil.controller.metrics import ControllerMetrics
from drasil.controller.options import parse_options
from drasil.driver.kubeapi import KubeApi

DRIVER = "gpu.drasil.dev"
CLASS = {
    "metadata": {"name": DRIVER},
    "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
}


def _slice(name: str, body: dict[str, Any]) -> dict[str, Any]:
    pool = {"name": "node-a", "generation": 1, "resourceSliceCount": 2}
    spec = {"driver": DRIVER, "pool": pool, "nodeName": "node-a", **body}
    return {"metadata": {"name": name}, "spec": spec}


def _placement(start: int) -> dict[str, Any]:
    slices = {f"memory-slice-{i}": {"value": "1"} for i in range(start, start + 4)}
    return {
        "name": f"gpu-0-mig-3g40gb-at-{start}",
        "attributes": {"type": {"string": "mig"}, "profile": {"string": "3g.40gb"}},
        "consumesCounters": [{"counterSet": "gpu-0-counters", "counters": slices}],
    }


SLICES = [
    _slice(
        "counters",
        {
            "sharedCounters": [
                {
                    "name": "gpu-0-counters",
                    "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(8)},
                }
            ]
        },
    ),
    _slice("devices", {"devices": [_placement(0), _placement(4), _placement(2)]}),
]


def _claim(name: str, holds: tuple[str, ...] = ()) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "team-a", "uid": f"uid-{name}"},
        "spec": {
            "devices": {"requests": [{"name": "mig", "exactly": {"deviceClassName": DRIVER}}]}
        },
    }
    if holds:
        results = [
            {"request": "mig", "driver": DRIVER, "pool": "node-a", "device": d} for d in holds
        ]
        obj["status"] = {"allocation": {"devices": {"results": results}}}
    return obj


def _controller() -> Controller:
    configuration = client.Configuration()
    configuration.host = "https://127.0.0.1:6443"
    options = parse_options(["--kubeconfig=/dev/null"], env={})
    api = KubeApi(client.ApiClient(configuration))
    return Controller(api=api, options=options, metrics=ControllerMetrics())


def test_the_unsatisfiable_event_names_counters_and_their_holder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The one free placement (at 2) overlaps both held ones; train-1 holds 0-3 and 4-7.
    holder = _claim("train-1", holds=("gpu-0-mig-3g40gb-at-0", "gpu-0-mig-3g40gb-at-4"))
    job = _claim("job")
    pod = {
        "metadata": {"name": "trainer", "namespace": "team-a", "uid": "uid-pod"},
        "spec": {"resourceClaims": [{"name": "mig", "resourceClaimName": "job"}]},
    }
    controller = _controller()
    for obj in SLICES:
        controller.view.put_slice(obj)
    controller.view.put_class(CLASS)
    controller.view.put_claim(holder)
    controller.view.put_claim(job)
    controller.view.put_pod(pod)
    posted: list[dict[str, Any]] = []
    monkeypatch.setattr(controller.api, "get_claim", lambda namespace, name, **_: job)
    monkeypatch.setattr(controller.api, "get_pod", lambda namespace, name: pod)
    monkeypatch.setattr(controller.api, "list_nodes", lambda: None)
    monkeypatch.setattr(controller.api, "post_event", lambda **event: posted.append(event) or True)

    message = controller.explanations.explain(("team-a", "job"))

    assert message == (
        'request "mig": 3 devices of gpu.drasil.dev; 3 pass class gpu.drasil.dev; '
        "2 allocated to team-a/train-1; 1 blocked by shared counters: gpu-0: placements "
        "of 3g.40gb need memory slices 2\u20135, held by claim team-a/train-1"
    )
    assert [(e["reason"], e["involved"]["kind"]) for e in posted] == [
        (UNSATISFIABLE, "ResourceClaim"),
        (UNSATISFIABLE, "Pod"),
    ]
    assert posted[1]["message"] == f"ResourceClaim job: {message}"

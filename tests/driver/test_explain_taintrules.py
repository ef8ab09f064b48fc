"""DeviceTaintRules in explanations: the rule's taint blocks like a slice taint, named
after the rule (``gpu-3 tainted by DeviceTaintRule drain-gpu-3 (NoSchedule)``)."""

from __future__ import annotations

from typing import Any

import pytest

from drasil.driver.explain.claims import ClaimExplanation, explain_claim, render_table
from drasil.driver.explain.fromapi import list_taint_rules
from drasil.driver.kubeapi import ApiError

DRIVER = "gpu.drasil.dev"
GPU_CLASS = {
    "metadata": {"name": DRIVER},
    "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
}


def device(index: int, **extra: Any) -> dict[str, Any]:
    return {"name": f"gpu-{index}", "attributes": {"index": {"int": index}}, **extra}


def resource_slice(pool: str, devices: list[dict[str, Any]]) -> dict[str, Any]:
    pool_ref = {"name": pool, "generation": 1, "resourceSliceCount": 1}
    spec = {"driver": DRIVER, "pool": pool_ref, "nodeName": pool, "devices": devices}
    return {"metadata": {"name": f"{pool}-slice"}, "spec": spec}


def claim(requests: list[dict[str, Any]]) -> dict[str, Any]:
    meta = {"name": "job", "namespace": "default", "uid": "uid-job"}
    return {"metadata": meta, "spec": {"devices": {"requests": requests}}}


def exactly(*selectors: str, **extra: Any) -> dict[str, Any]:
    cel = [{"cel": {"expression": s}} for s in selectors]
    return {"name": "gpu", "exactly": {"deviceClassName": DRIVER, "selectors": cel, **extra}}


ONLY_GPU_3 = f'device.attributes["{DRIVER}"].index == 3'
DRAIN = {"key": "drasil.dev/drain", "effect": "NoSchedule"}


def rule(name: str, selector: dict[str, Any] | None, taint: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {"taint": taint}
    if selector is not None:
        spec["deviceSelector"] = selector
    return {"metadata": {"name": name}, "spec": spec}


def four_gpus(pool: str = "node-a") -> list[dict[str, Any]]:
    return [resource_slice(pool, [device(i) for i in range(4)])]


def explain(
    target: dict[str, Any], rules: list[dict[str, Any]], slices: list[dict[str, Any]] | None = None
) -> ClaimExplanation:
    return explain_claim(
        target,
        slices=slices if slices is not None else four_gpus(),
        claims=[target],
        classes=[GPU_CLASS],
        driver=DRIVER,
        taint_rules=rules,
    )


DRAIN_GPU_3 = rule("drain-gpu-3", {"driver": DRIVER, "pool": "node-a", "device": "gpu-3"}, DRAIN)


def test_a_rule_on_the_only_matching_gpu_is_named() -> None:
    result = explain(claim([exactly(ONLY_GPU_3)]), [DRAIN_GPU_3])

    assert result.unsatisfiable
    assert result.message().endswith(
        f"1 passes selector {ONLY_GPU_3}; gpu-3 tainted by DeviceTaintRule drain-gpu-3 (NoSchedule)"
    )
    assert "gpu-3 tainted by DeviceTaintRule drain-gpu-3 (NoSchedule)" in render_table(result)


def test_a_toleration_of_the_rules_taint_lets_the_device_through() -> None:
    toleration = {"key": "drasil.dev/drain", "operator": "Exists", "effect": "NoSchedule"}
    request = exactly(ONLY_GPU_3, tolerations=[toleration])

    assert not explain(claim([request]), [DRAIN_GPU_3]).unsatisfiable


def test_selector_fields_must_all_match() -> None:
    other_pool = rule("other-pool", {"pool": "node-b", "device": "gpu-3"}, DRAIN)
    other_driver = rule("other-driver", {"driver": "nic.example.com"}, DRAIN)
    no_selector = rule("no-selector", None, DRAIN)  # selects nothing
    pending = claim([exactly(ONLY_GPU_3)])

    assert not explain(pending, [other_pool, other_driver, no_selector]).unsatisfiable


def test_an_empty_selector_taints_every_device_and_names_a_few() -> None:
    result = explain(claim([exactly()]), [rule("drain-all", {}, DRAIN)])

    assert result.message().endswith(
        "gpu-0, gpu-1, gpu-2 and 1 more tainted by DeviceTaintRule drain-all (NoSchedule)"
    )


def test_a_rule_with_effect_none_does_not_block() -> None:
    note = rule("note", {"device": "gpu-3"}, {"key": "note", "effect": "None"})

    assert not explain(claim([exactly(ONLY_GPU_3)]), [note]).unsatisfiable


def test_the_slices_own_taint_is_named_before_a_rule() -> None:
    taint = {"key": "gpu.drasil.dev/unhealthy", "value": "true", "effect": "NoSchedule"}
    slices = [resource_slice("node-a", [device(3, taints=[taint])])]

    text = explain(claim([exactly()]), [DRAIN_GPU_3], slices).message()

    assert text.endswith("1 blocked by taint gpu.drasil.dev/unhealthy=true:NoSchedule")
    assert "DeviceTaintRule" not in text


def test_no_eviction_rule_blocks_scheduling_too() -> None:
    evict = rule("evict-gpu-3", {"device": "gpu-3"}, {"key": "k", "effect": "NoExecute"})

    text = explain(claim([exactly(ONLY_GPU_3)]), [evict]).message()

    assert text.endswith("gpu-3 tainted by DeviceTaintRule evict-gpu-3 (NoExecute)")


class _Lists:
    """The one KubeApi call fromapi lists with; devicetaintrules answer ``status``."""

    def __init__(self, status: int | None) -> None:
        self.status = status

    def list_resources(self, plural: str, **_: Any) -> Any:
        if self.status is not None:
            raise ApiError(status=self.status, reason="test")
        return [DRAIN_GPU_3]


@pytest.mark.parametrize(("status", "found"), [(None, [DRAIN_GPU_3]), (403, []), (404, [])])
def test_the_cli_reads_rules_and_does_without_them_when_it_may_not(
    status: int | None, found: list[dict[str, Any]]
) -> None:
    # 403: the user's RBAC lacks them; 404: a cluster before 1.37 does not serve v1.
    api = _Lists(status)

    assert list_taint_rules(api) == found  # type: ignore[arg-type]


def test_other_api_errors_are_not_hidden() -> None:
    with pytest.raises(ApiError):
        list_taint_rules(_Lists(500))  # type: ignore[arg-type]

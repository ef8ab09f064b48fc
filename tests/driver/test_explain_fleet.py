"""One prepared fleet (inventory and usage) serves many pending claims' explanations."""

from __future__ import annotations

from test_explain import (
    DRIVER,
    GPU_CLASS,
    H200,
    claim,
    device,
    exactly,
    explain,
    held,
    resource_slice,
    sixteen_with_two_h200,
)

from drasil.driver.explain.claims import explain_claim, prepare_fleet
from drasil.driver.explain.inventory import build_usage, usage_of


def test_a_prepared_fleet_explains_every_pending_claim_as_a_fresh_one_would() -> None:
    slices = sixteen_with_two_h200()
    train = claim("train-0", [exactly()], results=held("node-a", "gpu-0", "gpu-1"))
    pending = [claim("job", [exactly("gpu", H200)]), claim("big", [exactly(count=15)])]
    everyone = [train, *pending]
    fleet = prepare_fleet(slices=slices, claims=everyone, driver=DRIVER)

    for target in pending:
        shared = explain_claim(
            target, slices=(), claims=(), classes=[GPU_CLASS], driver=DRIVER, fleet=fleet
        )
        assert shared.message() == explain(target, slices, [train]).message()
    assert shared.message().endswith("2 allocated to default/train-0; 14 free, 15 needed")


def test_an_allocated_claim_does_not_count_its_own_devices_as_held() -> None:
    slices = [resource_slice("node-a", [device("gpu-0"), device("gpu-1")])]
    mine = claim("mine", [exactly()], results=held("node-a", "gpu-0"))
    fleet = prepare_fleet(slices=slices, claims=[mine], driver=DRIVER)

    result = explain_claim(
        mine, slices=slices, claims=[mine], classes=[GPU_CLASS], driver=DRIVER, fleet=fleet
    )

    assert not result.unsatisfiable
    assert result.requests[0].held == {}


def test_usage_from_results_is_the_usage_from_claims() -> None:
    train = claim("train-0", [exactly()], results=held("node-a", "gpu-0", "gpu-1"))
    admin = claim("admin", [exactly()], results=held("node-a", "gpu-2", adminAccess=True))
    idle = claim("idle", [exactly()])
    claims = [train, admin, idle]
    holdings = [
        ("default/train-0", tuple(held("node-a", "gpu-0", "gpu-1"))),
        ("default/admin", tuple(held("node-a", "gpu-2", adminAccess=True))),
    ]

    usage = usage_of(holdings)

    assert usage == build_usage(claims, driver=DRIVER)
    assert usage.holders == {
        ("node-a", "gpu-0"): ("default/train-0",),
        ("node-a", "gpu-1"): ("default/train-0",),
    }
    fleet = prepare_fleet(slices=sixteen_with_two_h200(), claims=(), driver=DRIVER, usage=usage)
    assert fleet.usage is usage


def test_a_fleet_evaluates_each_selector_once_per_device() -> None:
    slices = sixteen_with_two_h200()
    fleet = prepare_fleet(slices=slices, claims=(), driver=DRIVER)
    devices = len(fleet.inventory.devices)
    gpu = GPU_CLASS["spec"]["selectors"][0]["cel"]["expression"]

    first = explain_claim(
        claim("job", [exactly("gpu", H200)]),
        slices=(),
        claims=(),
        classes=[GPU_CLASS],
        driver=DRIVER,
        fleet=fleet,
    )
    selected = {expression: dict(m) for expression, m in fleet.inventory.selected.items()}
    again = explain_claim(
        claim("other", [exactly("gpu", H200)]),
        slices=(),
        claims=(),
        classes=[GPU_CLASS],
        driver=DRIVER,
        fleet=fleet,
    )

    assert len(selected[gpu]) == devices  # every device went through the class
    assert len(selected[H200]) == devices  # and (all being GPUs) through the selector
    assert fleet.inventory.selected == selected  # the second claim evaluated nothing
    assert again.message() == first.message().replace("default/job", "default/other")
    assert first.message() == explain(claim("job", [exactly("gpu", H200)]), slices).message()

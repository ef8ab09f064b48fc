"""Explaining claims on shared GPUs (capacity left, request policies) and the
alternatives of ``firstAvailable`` requests, on slices the real builder writes."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from test_explain import DRIVER, GPU_CLASS, claim, exactly, explain, held

from drasil.driver.devices import CapacityPolicy, Device, DeviceType
from drasil.driver.explain.claims import render_table
from drasil.driver.explain.inventory import amount_text
from drasil.driver.slices.build import build_slices

GIB = 2**30
SHARED_CLASS = {
    "metadata": {"name": "shared.drasil.dev"},
    "spec": {
        "selectors": [
            {
                "cel": {
                    "expression": f'device.attributes["{DRIVER}"].type == "gpu" && '
                    "device.allowMultipleAllocations"
                }
            }
        ]
    },
}
CLASSES = [GPU_CLASS, SHARED_CLASS]


def gpu(minor: int, *, shared: bool = True, memory: int = 80 * GIB) -> Device:
    """A whole GPU as ``--gpu-sharing consumable`` publishes it (or exclusive)."""
    policies = {
        "memory": CapacityPolicy(default=GIB, minimum=GIB, step=GIB, maximum=memory),
        "computePercent": CapacityPolicy(default=0, minimum=0, step=1, maximum=100),
    }
    return Device(
        name=f"gpu-{minor}",
        type=DeviceType.GPU,
        uuid=f"GPU-{minor}",
        minor=minor,
        attributes={"type": "gpu", "index": minor},
        capacity={"memory": memory, "computePercent": 100} if shared else {"memory": memory},
        allow_multiple_allocations=shared,
        capacity_policies=policies if shared else {},
    )


def pool(*devices: Device, name: str = "node-a") -> list[dict[str, Any]]:
    return build_slices(
        driver=DRIVER, pool=name, devices=devices, node_name=name, generation=1, owner=None
    )


def share(
    name: str, device: str, *, memory: str, compute: str = "0", pool_name: str = "node-a"
) -> dict[str, Any]:
    """Another claim holding a share of ``device``."""
    consumed = {"memory": memory, "computePercent": compute}
    results = held(pool_name, device, shareID=f"share-{name}", consumedCapacity=consumed)
    return claim(name, [exactly(deviceClassName="shared.drasil.dev")], results=results)


def wants(**requests: str) -> dict[str, Any]:
    named = {k.replace("_", ""): v for k, v in requests.items()}
    capacity = {"requests": named} if named else None
    extra = {"capacity": capacity} if capacity else {}
    return claim("job", [exactly(deviceClassName="shared.drasil.dev", **extra)])


# -- capacity -------------------------------------------------------------------------


def test_the_request_is_rounded_up_to_the_policy_step() -> None:
    slices = pool(gpu(0))
    other = share("a", "gpu-0", memory="78Gi")

    assert not explain(wants(memory="1536Mi"), slices, [other], CLASSES).unsatisfiable
    too_big = explain(wants(memory="2560Mi"), slices, [other], CLASSES)

    assert too_big.unsatisfiable
    assert "gpu-0 has 2Gi of memory left; request needs 3Gi" in too_big.message()


def test_capacities_the_request_does_not_name_take_their_default() -> None:
    slices = pool(gpu(0))
    full = share("a", "gpu-0", memory="80Gi")
    busy = share("b", "gpu-0", memory="1Gi", compute="100")

    nothing = explain(wants(), slices, [full], CLASSES)
    compute = explain(wants(memory="1Gi", computePercent="10"), slices, [busy], CLASSES)

    assert "gpu-0 has 0 of memory left; request needs 1Gi" in nothing.message()
    assert "gpu-0 has 0 of computePercent left; request needs 10" in compute.message()
    # computePercent defaults to 0: a memory-only share still fits beside it.
    assert not explain(wants(memory="8Gi"), slices, [busy], CLASSES).unsatisfiable


def test_many_devices_are_grouped_with_the_most_left_named() -> None:
    slices = pool(*(gpu(i) for i in range(8)))
    others = [share(f"c{i}", f"gpu-{i}", memory="72Gi") for i in range(8)]
    others[1] = share("c1", "gpu-1", memory="68Gi")

    result = explain(wants(memory="20Gi"), slices, others, CLASSES)

    assert "8 devices: most memory left 12Gi on gpu-1; request needs 20Gi" in result.message()
    table = render_table(result)
    assert "8  without the requested capacity: 8 devices: most memory left 12Gi" in table


def test_a_request_above_the_policy_maximum_says_so() -> None:
    slices = pool(gpu(0), gpu(1, memory=40 * GIB))

    result = explain(wants(memory="100Gi"), slices, [], CLASSES)

    assert (
        "2 devices: at most 80Gi of memory per allocation on gpu-0; request asks 100Gi"
    ) in result.message()


def test_an_exclusive_device_compares_its_size() -> None:
    slices = pool(gpu(0, shared=False))

    result = explain(claim("job", [exactly(capacity={"requests": {"memory": "100Gi"}})]), slices)

    assert "gpu-0 has 80Gi of memory; request needs 100Gi" in result.message()


def test_a_capacity_the_device_lacks() -> None:
    slices = pool(gpu(0), gpu(1))

    result = explain(wants(cores="4"), slices, [], CLASSES)

    assert "2 devices have no capacity cores" in result.message()


def test_shared_devices_are_not_counted_as_held() -> None:
    slices = pool(gpu(0))
    others = [share("a", "gpu-0", memory="8Gi"), share("b", "gpu-0", memory="8Gi")]

    result = explain(wants(memory=f"{64}Gi"), slices, others, CLASSES)

    assert not result.unsatisfiable


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (Decimal(12 * GIB), "12Gi"),
        (Decimal(1536 * 2**20), "1536Mi"),
        (Decimal(25), "25"),
        (Decimal(0), "0"),
        (Decimal("0.5"), "0.5"),
        (Decimal("0.0000005"), "0.0000005"),  # plain, as quantities are written
    ],
)
def test_amount_text(value: Decimal, text: str) -> None:
    assert amount_text(value) == text


# -- firstAvailable -------------------------------------------------------------------

H200 = f'device.attributes["{DRIVER}"].index == 7'


def first_available(*subs: dict[str, Any]) -> dict[str, Any]:
    return {"name": "gpu", "firstAvailable": list(subs)}


def sub(name: str, *selectors: str, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "deviceClassName": DRIVER, **extra}
    if selectors:
        out["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    return out


def test_pending_alternatives_are_explained_in_order() -> None:
    slices = pool(*(gpu(i, shared=False) for i in range(2)))
    taken = claim("a", [exactly()], results=held("node-a", "gpu-0"))
    pending = claim("job", [first_available(sub("h200", H200), sub("h100", count=2))])

    result = explain(pending, slices, [taken])

    assert result.message() == (
        f'request "gpu": alternative "h200": 0 pass selector {H200}; '
        'alternative "h100": 1 allocated to default/a; 1 free, 2 needed'
    )
    table = render_table(result)
    assert "gpu/h200" in table
    assert "gpu/h100" in table


def test_a_fitting_alternative_is_named_in_the_summary() -> None:
    slices = pool(*(gpu(i, shared=False) for i in range(2)))
    pending = claim("job", [first_available(sub("h200", H200), sub("h100"))])

    result = explain(pending, slices)

    assert not result.unsatisfiable
    expected = (
        f'request "gpu": alternative "h200": 0 pass selector {H200}; '
        'alternative "h100": 2 free, 1 needed (the first that fits: "h100")'
    )
    assert result.alternatives() == [expected]
    assert expected in result.summary()
    assert render_table(result).count(expected) == 1


def test_an_allocated_claim_names_the_alternative_taken() -> None:
    slices = pool(*(gpu(i, shared=False) for i in range(2)))
    results = held("node-a", "gpu-1", request="gpu/h100")
    allocated = claim("job", [first_available(sub("h200", H200), sub("h100"))], results=results)

    result = explain(allocated, slices)

    assert result.summary() == (
        'claim default/job is allocated. request "gpu": the scheduler took alternative '
        '"h100" (gpu-1 of pool node-a)'
    )
    assert result.summary() in render_table(result)

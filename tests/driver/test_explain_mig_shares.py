"""Explaining claims on shares of MIG placements (dynamic MIG with consumable sharing).

The slices are those the node publishes for one simulated H100 (real discovery, real
slice builder): every placement shareable by memory, drawing its counters once
however many shares it holds, as kube-scheduler (1.37) counts them.
"""

from __future__ import annotations

from typing import Any

from mig_slices import DRIVER, GPU_CLASS, MIG_CLASS

from drasil.driver.explain.claims import ClaimExplanation, explain_claim
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.simulated.nvml import simulated_library
from drasil.driver.slices.build import build_slices

NODE = "node-a"
SMALL_0 = "gpu-0-mig-1g10gb-at-0"
ATTRIBUTE = f'device.attributes["{DRIVER}"]'


def shared_h100() -> list[dict[str, Any]]:
    lib = simulated_library("h100-80gb:1", node_name=NODE)
    found = discover(lib, node_name=NODE, mig_mode="dynamic", gpu_sharing="consumable")
    return build_slices(
        driver=DRIVER,
        pool=NODE,
        devices=found.devices,
        node_name=NODE,
        counter_sets=found.counter_sets,
        generation=1,
        owner=None,
    )


def mig(profile: str, start: int, *, memory: str | None = None) -> dict[str, Any]:
    selector = f'{ATTRIBUTE}.profile == "{profile}" && {ATTRIBUTE}.placementStart == {start}'
    spec: dict[str, Any] = {
        "deviceClassName": "mig.drasil.dev",
        "selectors": [{"cel": {"expression": selector}}],
    }
    if memory is not None:
        spec["capacity"] = {"requests": {"memory": memory}}
    return {"name": "mig", "exactly": spec}


def claim(name: str, request: dict[str, Any], *, holds: str = "", memory: str = "") -> Any:
    obj: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [request]}},
    }
    if holds:
        result = {
            "request": "mig",
            "driver": DRIVER,
            "pool": NODE,
            "device": holds,
            "shareID": f"share-{name}",
            "consumedCapacity": {"memory": memory, "computePercent": "0"},
        }
        obj["status"] = {"allocation": {"devices": {"results": [result]}}}
    return obj


def explain(target: dict[str, Any], *others: dict[str, Any]) -> ClaimExplanation:
    return explain_claim(
        target,
        slices=shared_h100(),
        claims=[target, *others],
        classes=[MIG_CLASS, GPU_CLASS],
        driver=DRIVER,
    )


def test_a_second_share_fits_beside_the_first_without_more_counters() -> None:
    first = claim("train", mig("1g.10gb", 0), holds=SMALL_0, memory="4Gi")
    result = explain(claim("job", mig("1g.10gb", 0, memory="4Gi")), first)
    assert not result.unsatisfiable, result.message()


def test_a_share_larger_than_what_is_left_names_the_placement_and_its_memory() -> None:
    first = claim("train", mig("1g.10gb", 0), holds=SMALL_0, memory="8Gi")
    result = explain(claim("job", mig("1g.10gb", 0, memory="4Gi")), first)
    assert result.unsatisfiable
    # 9984 MiB less the 8Gi share: what the scheduler compares (the capacity, not the
    # policy's whole-GiB maximum).
    assert f"{SMALL_0} has 1792Mi of memory left; request needs 4Gi" in result.message()


def test_a_share_above_the_placement_size_says_its_maximum() -> None:
    result = explain(claim("job", mig("1g.10gb", 0, memory="12Gi")))
    assert result.unsatisfiable
    assert f"{SMALL_0} allows at most 9Gi of memory per allocation; request asks 12Gi" in (
        result.message()
    )


def test_an_overlapping_placement_is_blocked_by_the_shared_one() -> None:
    first = claim("train", mig("1g.10gb", 0), holds=SMALL_0, memory="2Gi")
    result = explain(claim("job", mig("2g.20gb", 0, memory="2Gi")), first)
    assert result.unsatisfiable
    assert (
        "gpu-0: placements of 2g.20gb need memory slice 0, held by claim ml/train"
        in result.message()
    )


def test_engines_cannot_be_asked_of_a_share() -> None:
    request = mig("1g.10gb", 0, memory="2Gi")
    request["exactly"]["capacity"]["requests"]["decoders"] = "1"
    result = explain(claim("job", request))
    assert result.unsatisfiable
    assert "decoders" in result.message()

"""Explanations that know shared counters (partitionable devices, dynamic MIG)."""

# The messages write slice ranges with an en dash ("memory slices 4\u20137"), as the
# issue's wording has them; the expected texts here must spell them the same.
# ruff: noqa: RUF001

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from mig_slices import DRIVER, GPU_CLASS, MIG_CLASS, device_class, h100_slices, placement_name

from drasil.driver.discovery.backends import discover_node, no_nvidia_gpus
from drasil.driver.explain import jointcounters
from drasil.driver.explain.claims import ClaimExplanation, explain_claim, render_table
from drasil.driver.explain.counters import CounterBook, listing
from drasil.driver.explain.inventory import amount_text, build_inventory, build_usage
from drasil.driver.explain.requests import CountersOutOfTime, check_counters
from drasil.driver.simulated.amdsysfs import write_simulated_tree
from drasil.driver.slices.build import build_slices

PROFILE = f'device.attributes["{DRIVER}"].profile'


def claim(
    name: str,
    requests: list[dict[str, Any]],
    *,
    namespace: str = "default",
    holds: tuple[str, ...] = (),
    pool: str = "node-a",
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}"},
        "spec": {"devices": {"requests": requests}},
    }
    if holds:
        results = [{"request": "r", "driver": DRIVER, "pool": pool, "device": d} for d in holds]
        obj["status"] = {"allocation": {"devices": {"results": results}}}
    return obj


def mig(name: str, profile: str | None = None, **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"deviceClassName": "mig.drasil.dev", **extra}
    if profile is not None:
        spec["selectors"] = [{"cel": {"expression": f'{PROFILE} == "{profile}"'}}]
    return {"name": name, "exactly": spec}


def gpu(name: str = "gpu") -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": DRIVER}}


def at(profile: str, start: int, minor: int = 2) -> str:
    return placement_name(minor, profile, start)


def explain(
    target: dict[str, Any],
    others: list[dict[str, Any]] = (),  # type: ignore[assignment]
    slices: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> ClaimExplanation:
    return explain_claim(
        target,
        slices=slices if slices is not None else h100_slices(),
        claims=[target, *others],
        classes=[MIG_CLASS, GPU_CLASS],
        driver=DRIVER,
        **kwargs,
    )


FUNNEL_3G = (
    'request "mig": 19 devices of gpu.drasil.dev; 18 pass class mig.drasil.dev; '
    f'2 pass selector {PROFILE} == "3g.40gb"'
)


# --- one request ---------------------------------------------------------------------


def test_the_issue_example_names_the_slices_and_their_holder() -> None:
    slices_4_to_7 = (at("1g.20gb", 4), at("1g.20gb", 6))
    train = claim("train-1", [mig("r")], namespace="team-a", holds=slices_4_to_7)
    evaluation = claim("eval-0", [mig("r")], namespace="team-b", holds=(at("3g.40gb", 0),))

    result = explain(claim("job", [mig("mig", "3g.40gb")]), [train, evaluation])

    assert result.unsatisfiable
    assert result.message() == (
        f"{FUNNEL_3G}; 1 allocated to team-b/eval-0; 1 blocked by shared counters: "
        "gpu-2: placements of 3g.40gb need memory slices 4–7, held by claim team-a/train-1"
    )


def test_placements_blocked_by_different_holders_are_summarized() -> None:
    x = claim("x", [mig("r")], namespace="a", holds=(at("4g.40gb", 0),))
    y = claim("y", [mig("r")], namespace="a", holds=(at("1g.20gb", 4), at("1g.20gb", 6)))

    result = explain(claim("job", [mig("mig", "3g.40gb")]), [x, y])

    assert result.message() == (
        f"{FUNNEL_3G}; 2 blocked by shared counters: gpu-2: placements of 3g.40gb at 0 and 4 "
        "need memory slices 0–3 and 4–7, held by claims a/x and a/y"
    )


def test_only_the_missing_slices_and_their_holder_are_named() -> None:
    small = claim("small", [mig("r")], holds=(at("1g.10gb", 6),))

    result = explain(claim("job", [mig("mig", "3g.40gb", count=2)]), [small])

    assert result.message() == (
        f"{FUNNEL_3G}; 1 blocked by shared counters: gpu-2: placements of 3g.40gb need "
        "memory slice 6, held by claim default/small; 1 free, 2 needed"
    )


def test_the_full_gpu_is_named_as_a_device() -> None:
    train = claim("train-1", [mig("r")], namespace="team-a", holds=(at("3g.40gb", 4),))

    result = explain(claim("job", [gpu()]), [train])

    assert result.message() == (
        'request "gpu": 19 devices of gpu.drasil.dev; 1 passes class gpu.drasil.dev; '
        "1 blocked by shared counters: gpu-2: device gpu-2 needs memory slices 4–7, "
        "held by claim team-a/train-1"
    )


def test_a_held_full_gpu_blocks_every_placement_with_one_holder() -> None:
    whole = claim("whole", [gpu()], holds=("gpu-2",))

    result = explain(claim("job", [mig("mig", "1g.10gb")]), [whole])

    assert result.requests[0].short_counters == (
        (
            7,
            "gpu-2: placements of 1g.10gb need memory slices 0–6, held by claim default/whole",
        ),
    )


def test_free_placements_satisfy_the_request() -> None:
    small = claim("small", [mig("r")], holds=(at("1g.10gb", 6),))

    assert not explain(claim("job", [mig("mig", "3g.40gb")]), [small]).unsatisfiable


def test_admin_access_holders_draw_no_counters() -> None:
    watcher = claim("watch", [gpu()], holds=("gpu-2",))
    watcher["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True

    assert not explain(claim("job", [mig("mig", "3g.40gb")]), [watcher]).unsatisfiable


def test_render_table_has_a_row_per_counter_set_and_profile() -> None:
    x = claim("x", [mig("r")], namespace="a", holds=(at("4g.40gb", 0),))

    table = render_table(explain(claim("job", [mig("mig", "3g.40gb", count=2)]), [x]))

    assert (
        "mig            1  short of counters: gpu-2: placements of 3g.40gb need memory "
        "slices 0–3, held by claim a/x"
    ) in table.splitlines()
    assert "mig            1  free (2 needed)" in table.splitlines()


def test_sets_of_several_pools_name_their_pool() -> None:
    slices = h100_slices("node-a") + h100_slices("node-b")
    a = claim("a", [gpu()], holds=("gpu-2",), pool="node-a")
    b = claim("b", [gpu()], holds=("gpu-2",), pool="node-b")

    result = explain(claim("job", [mig("mig", "7g.80gb")]), [a, b], slices=slices)

    assert result.requests[0].short_counters == (
        (
            2,
            "node-a/gpu-2 and node-b/gpu-2: placements of 7g.80gb need memory slices 0–7, "
            "held by claims default/a and default/b",
        ),
    )


def test_sets_blocked_alike_share_one_text_and_others_keep_their_own() -> None:
    slices = h100_slices(minors=(0, 1, 2, 3))
    whole = claim("whole", [gpu()], holds=("gpu-0", "gpu-1", "gpu-2"))
    part = claim("part", [mig("r")], holds=(at("1g.10gb", 5, minor=3),))

    result = explain(claim("job", [mig("mig", "7g.80gb")]), [whole, part], slices=slices)

    assert result.requests[0].short_counters == (
        (
            3,
            "gpu-0, gpu-1 and gpu-2: placements of 7g.80gb need memory slices 0–7, "
            "held by claim default/whole",
        ),
        (1, "gpu-3: placements of 7g.80gb need memory slice 5, held by claim default/part"),
    )


# --- generic counters (any driver) -----------------------------------------------------


def counter_slices(
    devices: list[dict[str, Any]], counter_sets: list[dict[str, Any]], *, pool: str = "node-a"
) -> list[dict[str, Any]]:
    """A pool of two slices: the counter sets, then the devices."""

    def one(body: dict[str, Any], index: int) -> dict[str, Any]:
        pool_ref = {"name": pool, "generation": 1, "resourceSliceCount": 2}
        spec = {"driver": DRIVER, "pool": pool_ref, "nodeName": pool, **body}
        return {"metadata": {"name": f"{pool}-{index}"}, "spec": spec}

    return [one({"sharedCounters": counter_sets}, 0), one({"devices": devices}, 1)]


def fabric_device(name: str, **draws: Any) -> dict[str, Any]:
    counters = {counter: {"value": str(value)} for counter, value in draws.items()}
    return {
        "name": name,
        "attributes": {"type": {"string": "gpu"}},
        "consumesCounters": [{"counterSet": "fabric", "counters": counters}],
    }


FABRIC = {"name": "fabric", "counters": {"bandwidth": {"value": "100"}, "lanes": {"value": "8"}}}


def test_generic_counters_read_needed_and_left() -> None:
    slices = counter_slices(
        [fabric_device("dev-a", bandwidth=60, lanes=2), fabric_device("dev-b", bandwidth=50)],
        [FABRIC],
    )
    holder = claim("b", [gpu()], holds=("dev-b",))

    result = explain(claim("job", [gpu()]), [holder], slices=slices)

    assert result.message().endswith(
        "1 blocked by shared counters: fabric: device dev-a needs 60 bandwidth (50 left), "
        "held by claim default/b"
    )


def test_a_device_drawing_more_than_the_set_has_says_so() -> None:
    slices = counter_slices([fabric_device("dev-a", bandwidth="160")], [FABRIC])

    result = explain(claim("job", [gpu()]), slices=slices)

    assert result.message().endswith(
        "1 blocked by shared counters: fabric: device dev-a needs 160 bandwidth (100 left), "
        "more than the counter set has"
    )


@pytest.mark.parametrize(
    ("value", "text"),
    [("40Gi", "40Gi"), ("1536", "1536"), ("0.5", "0.5"), ("2048Mi", "2Gi")],
)
def test_amounts_read_as_quantities(value: str, text: str) -> None:
    from drasil.api.quantity import parse_quantity

    assert amount_text(parse_quantity(value)) == text


def test_listing_is_bounded() -> None:
    assert listing(["a"]) == "a"
    assert listing(["a", "b"]) == "a and b"
    assert listing(["a", "b", "c"]) == "a, b and c"
    assert listing([str(i) for i in range(7)], limit=4) == "0, 1, 2, 3 and 3 more"


# --- hostile input ---------------------------------------------------------------------


def _unusable(slices: list[dict[str, Any]]) -> dict[str, tuple[str, ...]]:
    result = explain(claim("job", [gpu()]), slices=slices)
    assert result.unsatisfiable
    return dict(result.requests[0].unusable)


def test_a_missing_counter_set_makes_the_device_unusable() -> None:
    slices = counter_slices([fabric_device("dev-a", bandwidth=1)], [])

    result = explain(claim("job", [gpu()]), slices=slices)

    assert result.message().endswith(
        "device dev-a unusable: counter set fabric does not exist in pool node-a"
    )


OF_BANDWIDTH = "of bandwidth from counter set fabric"


@pytest.mark.parametrize(
    ("draw", "counter_set", "why"),
    [
        ("lots", FABRIC, f"it draws an invalid quantity 'lots' {OF_BANDWIDTH}"),
        ("-1", FABRIC, f"it draws a negative quantity '-1' {OF_BANDWIDTH}"),
        ("1e999", FABRIC, f"it draws an invalid quantity '1e999' {OF_BANDWIDTH}"),
        (
            "1",
            {"name": "fabric", "counters": {"bandwidth": {"value": "-5"}}},
            "counter bandwidth of set fabric is a negative quantity '-5'",
        ),
        (
            "1",
            {"name": "fabric", "counters": {"bandwidth": {"value": None}}},
            "counter bandwidth of set fabric is an invalid quantity 'None'",
        ),
        (
            "1",
            {"name": "fabric", "counters": {"lanes": {"value": "8"}}},
            "counter set fabric has no counter bandwidth",
        ),
        (
            "1",
            {"name": "fabric", "counters": ["bandwidth"]},
            "counter set fabric of pool node-a has no map of counters",
        ),
    ],
)
def test_broken_counters_make_the_device_unusable(
    draw: str, counter_set: dict[str, Any], why: str
) -> None:
    slices = counter_slices([fabric_device("dev-a", bandwidth=draw)], [counter_set])

    assert _unusable(slices) == {why: ("dev-a",)}


def test_a_counter_set_defined_twice_makes_its_devices_unusable() -> None:
    devices = [fabric_device("dev-a", bandwidth=1), fabric_device("dev-b", bandwidth=1)]
    slices = counter_slices(devices, [FABRIC, copy.deepcopy(FABRIC)])

    result = explain(claim("job", [gpu()]), slices=slices)

    why = "counter set fabric is defined 2 times in pool node-a"
    assert result.message().endswith(f"2 devices unusable: {why}")
    assert (
        f"gpu            2  unusable (dev-a and dev-b): {why}" in render_table(result).splitlines()
    )


@pytest.mark.parametrize(
    "consumes",
    [{"counterSet": "fabric"}, "fabric", [["fabric"]], [{"counterSet": "fabric", "counters": 7}]],
)
def test_malformed_draws_never_crash(consumes: Any) -> None:
    dev = {"name": "dev-a", "attributes": {"type": {"string": "gpu"}}, "consumesCounters": consumes}

    unusable = _unusable(counter_slices([dev], [FABRIC]))

    assert list(unusable.values()) == [("dev-a",)]


def test_thousands_of_counters_are_not_read_and_the_explanation_says_so() -> None:
    huge = {"name": "fabric", "counters": {f"c{i}": {"value": "1"} for i in range(5000)}}
    slices = counter_slices([fabric_device("dev-a", c0=1)], [huge])

    result = explain(claim("job", [gpu()]), slices=slices)

    assert not result.unsatisfiable
    assert result.cut_short == (
        'request "gpu": did not check the shared counters of device dev-a of pool node-a: '
        "counter set fabric of pool node-a has 5000 counters, more than the 64 explain reads"
    )
    assert result.summary().startswith("could not explain claim default/job: ")


def test_a_draw_on_thousands_of_counters_is_not_read() -> None:
    draws = {f"c{i}": 1 for i in range(5000)}
    slices = counter_slices([fabric_device("dev-a", **draws)], [FABRIC])

    result = explain(claim("job", [gpu()]), slices=slices)

    assert "it draws 5000 counters from counter set fabric" in result.cut_short


# --- the requests together -------------------------------------------------------------


def test_two_3g_and_one_4g_fit_alone_but_not_together_on_one_h100() -> None:
    job = claim("job", [mig("x", "3g.40gb"), mig("y", "3g.40gb"), mig("z", "4g.40gb")])

    result = explain(job)

    assert [e.problem for e in result.requests] == [None, None, None]
    assert result.problems == (
        "requests x, y, z fit alone but not together: no choice of the 3 devices they need "
        'stays within the shared counters those draw on; with 2 placed, request "z" finds '
        'gpu-2: placements of 4g.40gb need memory slices 0–3, held by request "x" of this '
        "claim",
    )
    assert result.problems[0] in render_table(result)


def test_the_search_finds_the_placements_that_fit_together() -> None:
    # The first 3g.40gb tried (at 0) overlaps the 4g.40gb; the one at 4 does not.
    assert not explain(claim("job", [mig("x", "3g.40gb"), mig("z", "4g.40gb")])).unsatisfiable


def test_one_request_for_several_devices_is_checked_as_a_whole() -> None:
    either = f'{PROFILE} == "7g.80gb" || {PROFILE} == "4g.40gb"'
    request = {
        "name": "big",
        "exactly": {
            "deviceClassName": "mig.drasil.dev",
            "count": 2,
            "selectors": [{"cel": {"expression": either}}],
        },
    }

    result = explain(claim("job", [request]))

    assert result.problems[0].startswith(
        'request "big": no choice of the 2 devices it needs stays within the shared counters '
        'those draw on; with 1 placed, request "big" finds gpu-2: placements of'
    )


def test_counters_other_claims_hold_count_in_the_joint_check() -> None:
    # Slices 0 and 2 are taken: x can only be 3g.40gb at 4, z only 2g.20gb at 4.
    small = claim("small", [mig("r")], holds=(at("1g.10gb", 0), at("1g.10gb", 2)))
    job = claim("job", [mig("x", "3g.40gb"), mig("z", "2g.20gb")])

    result = explain(job, [small])

    assert [len(e.free) for e in result.requests] == [1, 1]
    assert result.problems == (
        "requests x, z fit alone but not together: no choice of the 2 devices they need "
        'stays within the shared counters those draw on; with 1 placed, request "z" finds '
        'gpu-2: placements of 2g.20gb need memory slices 4–5, held by request "x" of this '
        "claim",
    )


def test_two_gpus_give_room_for_both() -> None:
    job = claim("job", [mig("x", "3g.40gb"), mig("y", "3g.40gb"), mig("z", "4g.40gb")])

    assert not explain(job, slices=h100_slices(minors=(2, 3))).unsatisfiable


def test_a_search_past_its_steps_makes_the_explanation_incomplete(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(jointcounters, "MAX_STEPS", 3)
    job = claim("job", [mig("x", "3g.40gb"), mig("y", "3g.40gb"), mig("z", "4g.40gb")])

    result = explain(job)

    assert not result.unsatisfiable
    assert result.cut_short == (
        "stopped checking whether requests x, y, z fit their shared counters together "
        "(3 devices were tried); whether they do is not known"
    )


def test_checking_counters_past_the_deadline_stops() -> None:
    slices = h100_slices()
    result = explain(claim("job", [gpu()]), slices=slices)
    book = CounterBook(build_inventory(slices, driver=DRIVER), build_usage([], driver=DRIVER))

    with pytest.raises(CountersOutOfTime) as stopped:
        check_counters(result.requests[0].free, book, deadline=0.0)

    assert stopped.value.text(2.0) == "stopped after 2 s checking the shared counters of 1 devices"


# --- AMD dynamic partitions ------------------------------------------------------------


def mi300x_slices(tmp_path: Path) -> list[dict[str, Any]]:
    """The slices a node with one MI300X publishes in ``--amd-partition-mode dynamic``."""
    tree = tmp_path / "sys"
    write_simulated_tree([("mi300x", 1)], tree, node_name="node-a")
    found = discover_node(no_nvidia_gpus(), tree, node_name="node-a", amd_partition_mode="dynamic")
    return build_slices(
        driver=DRIVER,
        pool="node-a",
        devices=found.devices,
        node_name="node-a",
        counter_sets=found.counter_sets,
        generation=1,
        owner=None,
    )


AMD_PARTITION_CLASS = device_class("amdgpu-partition.drasil.dev", "amdgpu-partition")
MODE = f'device.attributes["{DRIVER}"].computePartition'


def test_amd_partitions_name_the_dies_and_their_holder(tmp_path: Path) -> None:
    held = claim("train", [gpu()], namespace="team-a", holds=("amdgpu-1-cpx-0", "amdgpu-1-cpx-4"))
    selector = [{"cel": {"expression": f'{MODE} == "DPX"'}}]
    request = {
        "name": "half",
        "exactly": {"deviceClassName": "amdgpu-partition.drasil.dev", "selectors": selector},
    }
    job = claim("job", [request])

    result = explain_claim(
        job,
        slices=mi300x_slices(tmp_path),
        claims=[job, held],
        classes=[AMD_PARTITION_CLASS],
        driver=DRIVER,
    )

    assert result.unsatisfiable
    assert result.message().endswith(
        "2 blocked by shared counters: amdgpu-1: DPX partitions need XCDs 0 and 4, "
        "held by claim team-a/train"
    )

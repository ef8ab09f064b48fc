"""Dynamic MIG discovery: placement devices over counter sets, and the counters are exact.

Exact means: for any set of placement devices of one GPU, the fake NVML can create
all their GPU instances (in some order, from an empty GPU) exactly when their counter
consumptions together fit the GPU's counter set. The scheduler only sees counters,
prepare only meets NVML; if the two disagreed, claims would be allocated devices that
cannot be cut, or devices that could be cut would never be allocated.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from contextlib import suppress
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drasil.driver.devices import CounterSet, Device, DeviceType
from drasil.driver.nvidia.nodedevices import DiscoveryResult, discover
from drasil.driver.nvidia.nvml import (
    NvmlInsufficientResources,
    NvmlNotSupported,
    NvmlResetRequired,
    Placement,
)
from drasil.driver.nvidia.partitions import placement_device_name
from drasil.driver.simulated.gpus import simulated_gpus
from drasil.driver.simulated.nvml import FakeNvml, simulated_library
from drasil.driver.slices.build import build_slices
from drasil.driver.slices.validate import (
    MAX_CONSUMED_COUNTER_SETS,
    MAX_CONSUMED_COUNTERS_PER_SLICE,
    MAX_COUNTER_SETS_PER_SLICE,
    MAX_COUNTERS_PER_SET,
    MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS,
)

MiB = 2**20
MODELS = ["a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "b200"]


def mig_on(lib: FakeNvml) -> FakeNvml:
    """Every GPU in MIG mode, as an operator leaves an Ampere GPU for dynamic MIG
    (``nvidia-smi -mig 1`` and a GPU reset)."""
    lib.init()
    for index in range(lib.device_count()):
        with suppress(NvmlResetRequired, NvmlNotSupported):
            lib.device_set_mig_mode(lib.device_handle_by_index(index), True)
        lib.reset_gpu(index)
    lib.shutdown()
    return lib


def dynamic(spec: str, *, lib: FakeNvml | None = None) -> DiscoveryResult:
    lib = lib or mig_on(simulated_library(spec, node_name="n"))
    return discover(lib, node_name="n", mig_mode="dynamic")


def test_h100_devices_names_and_counters() -> None:
    result = dynamic("h100-80gb:1,l4:1")
    names = [d.name for d in result.devices]
    assert names[0] == "gpu-0"
    assert names[-1] == "gpu-1"  # the L4 as today
    assert len(names) == 1 + (7 + 7 + 4 + 3 + 2 + 1 + 1) + 1
    assert "gpu-0-mig-3g40gb-at-4" in names
    assert "gpu-0-mig-1g10gbme-at-0" in names
    assert "gpu-0-mig-1g20gb-at-6" in names
    (counter_set,) = result.counter_sets
    assert counter_set == CounterSet(
        name="gpu-0-counters",
        counters={
            **{f"memory-slice-{i}": 1 for i in range(8)},
            "memory": 80 * 2**30,
            "multiprocessors": 132,
            "copy-engines": 8,
            "decoders": 7,
            "jpeg-engines": 7,
            "ofa-engines": 1,
        },
    )
    assert not result.skipped


def test_full_gpu_consumes_everything_and_keeps_its_attributes() -> None:
    static = discover(simulated_library("h100-80gb:1", node_name="n"), node_name="n")
    result = dynamic("h100-80gb:1")
    full = result.devices[0]
    assert full.attributes == static.devices[0].attributes
    assert full.capacity == static.devices[0].capacity
    (use,) = full.consumes_counters
    assert use.counter_set == "gpu-0-counters"
    assert dict(use.counters) == dict(result.counter_sets[0].counters)
    assert full.mig_placement is None


def test_placement_device() -> None:
    result = dynamic("h100-80gb:1")
    full = result.devices[0]
    device = next(d for d in result.devices if d.name == "gpu-0-mig-3g40gb-at-4")
    assert device.type is DeviceType.MIG
    assert device.uuid == ""
    assert "uuid" not in device.attributes
    expected = {k: v for k, v in full.attributes.items() if k != "uuid"}
    expected |= {"type": "mig", "parentUUID": full.uuid, "profile": "3g.40gb"}
    expected |= {"placementStart": 4, "placementSize": 4}
    assert dict(device.attributes) == expected
    assert dict(device.capacity) == {
        "memory": 40448 * MiB,
        "multiprocessors": 60,
        "copyEngines": 3,
        "decoders": 3,
        "encoders": 0,
        "jpegEngines": 3,
        "ofaEngines": 0,
    }
    assert device.parent_uuid == full.uuid
    placement = device.mig_placement
    assert placement is not None
    assert (placement.parent_uuid, placement.parent_minor) == (full.uuid, 0)
    assert (placement.profile, placement.profile_id) == ("3g.40gb", 9)
    assert (placement.start, placement.size) == (4, 4)
    (use,) = device.consumes_counters
    assert dict(use.counters) == {
        "memory-slice-4": 1,
        "memory-slice-5": 1,
        "memory-slice-6": 1,
        "memory-slice-7": 1,
        "memory": 40448 * MiB,
        "multiprocessors": 60,
        "copy-engines": 3,
        "decoders": 3,
        "jpeg-engines": 3,
    }


def test_zero_counters_are_left_out() -> None:
    result = dynamic("a100-40gb:1")
    counters = result.counter_sets[0].counters
    assert "encoders" not in counters
    small = next(d for d in result.devices if d.name == "gpu-0-mig-1g5gb-at-0")
    assert set(small.consumes_counters[0].counters) == {
        "memory-slice-0",
        "memory",
        "multiprocessors",
        "copy-engines",
    }


def test_mig_mode_and_existing_instances_do_not_change_what_is_published() -> None:
    lib = simulated_library("a100-40gb-mig:1", node_name="n")
    with_instances = dynamic("", lib=lib)
    plain = dynamic("a100-40gb:1")
    assert [d.name for d in with_instances.devices] == [d.name for d in plain.devices]
    assert with_instances.counter_sets == plain.counter_sets


def test_an_ampere_gpu_is_cut_on_demand_only_where_mig_mode_is_on() -> None:
    # Turning MIG mode on or off needs a reset there, which drasil never does.
    off = dynamic("", lib=simulated_library("a100-40gb:1,h100-80gb:1", node_name="n"))
    names = [d.name for d in off.devices]
    assert "gpu-0" in names
    assert not any(n.startswith("gpu-0-mig-") for n in names)
    assert "gpu-1" in names
    assert any(n.startswith("gpu-1-mig-") for n in names)
    assert [c.name for c in off.counter_sets] == ["gpu-1-counters"]
    on = dynamic("a100-40gb:1,h100-80gb:1")
    names = [d.name for d in on.devices]
    assert "gpu-0" not in names  # a whole-GPU claim would need MIG mode off
    assert "gpu-0-mig-3g20gb-at-4" in names
    assert "gpu-1" in names


def test_static_mode_is_unchanged() -> None:
    result = discover(
        simulated_library("a100-40gb-mig:1,h100-80gb:1", node_name="n"), node_name="n"
    )
    assert result.counter_sets == ()
    assert all(not d.consumes_counters and d.mig_placement is None for d in result.devices)
    assert [d.name for d in result.devices][-1] == "gpu-1"


def test_a_gpu_whose_profiles_cannot_be_read_is_skipped() -> None:
    lib = simulated_library("h100-80gb:2", node_name="n")
    lib.fail_next("gpu_instance_profiles")
    result = dynamic("", lib=lib)
    assert [s.index for s in result.skipped] == [0]
    assert [c.name for c in result.counter_sets] == ["gpu-1-counters"]
    assert not any(d.name.startswith("gpu-0") for d in result.devices)


def test_unknown_mig_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="mig_mode"):
        discover(simulated_library("l4:1", node_name="n"), node_name="n", mig_mode="auto")


def test_placement_device_names() -> None:
    assert placement_device_name(parent_minor=3, profile="1g.10gb+me", start=6) == (
        "gpu-3-mig-1g10gbme-at-6"
    )


# ---- the counters are exact --------------------------------------------------------------


@cache
def _placements(model: str) -> tuple[Device, ...]:
    """The placement devices of one GPU of ``model`` (the full GPU is a 7g as well)."""
    return tuple(d for d in dynamic(f"{model}:1").devices if d.mig_placement is not None)


@cache
def _totals(model: str) -> dict[str, int]:
    return dict(dynamic(f"{model}:1").counter_sets[0].counters)


def counters_fit(model: str, devices: Sequence[Device]) -> bool:
    used: Counter[str] = Counter()
    for device in devices:
        used.update(device.consumes_counters[0].counters)
    totals = _totals(model)
    return all(value <= totals.get(name, 0) for name, value in used.items())


def nvml_creates_all(model: str, devices: Sequence[Device]) -> bool:
    """Whether a fresh GPU creates every instance; tries every order for the small sets
    (NVML's own checks do not depend on order; this test does not assume so)."""
    orders = itertools.permutations(devices) if len(devices) <= 3 else [devices]
    return any(_creates_in_order(model, order) for order in orders)


def _creates_in_order(model: str, devices: Sequence[Device]) -> bool:
    lib = mig_on(FakeNvml(simulated_gpus(f"{model}:1", node_name="n")))
    gpu = lib.device_handle_by_index(0)
    for device in devices:
        placement = device.mig_placement
        assert placement is not None
        try:
            created = lib.create_gpu_instance(
                gpu, placement.profile_id, Placement(placement.start, placement.size)
            )
            lib.create_compute_instance(gpu, created.gpu_instance_id)
        except NvmlInsufficientResources:
            return False
    return True


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_counters_are_exact_for_all_small_sets(model: str, size: int) -> None:
    devices = _placements(model)
    for chosen in itertools.combinations(devices, size):
        fits = counters_fit(model, chosen)
        assert nvml_creates_all(model, chosen) == fits, [d.name for d in chosen]


@settings(max_examples=300, deadline=None)
@given(model=st.sampled_from(MODELS), data=st.data())
def test_counters_are_exact_for_larger_sets(model: str, data: st.DataObject) -> None:
    devices = _placements(model)
    chosen = data.draw(
        st.lists(st.sampled_from(devices), min_size=4, max_size=9, unique_by=lambda d: d.name)
    )
    assert nvml_creates_all(model, chosen) == counters_fit(model, chosen)


@settings(max_examples=200, deadline=None)
@given(model=st.sampled_from(MODELS), data=st.data())
def test_counters_are_exact_for_sets_that_fill_the_gpu(model: str, data: st.DataObject) -> None:
    # Random sets mostly overlap; greedily packed ones are the interesting fits.
    devices = list(data.draw(st.permutations(_placements(model))))
    chosen: list[Device] = []
    for device in devices:
        if counters_fit(model, [*chosen, device]):
            chosen.append(device)
    assert nvml_creates_all(model, chosen)
    extra = data.draw(st.sampled_from(devices))
    if extra not in chosen:
        assert not nvml_creates_all(model, [*chosen, extra])


def test_the_full_gpu_excludes_every_placement() -> None:
    result = dynamic("h100-80gb:1")
    full, *migs = result.devices
    for mig in migs:
        assert not counters_fit("h100-80gb", [full, mig])


# ---- slices ----------------------------------------------------------------------------------


def _slices(result: DiscoveryResult) -> list[dict[str, object]]:
    return build_slices(
        driver="gpu.drasil.dev",
        pool="n",
        devices=result.devices,
        node_name="n",
        counter_sets=result.counter_sets,
        generation=1,
        owner=None,
    )


@pytest.mark.parametrize("spec", ["h100-80gb:8", "b200:8,l4:2", "a100-40gb:16"])
def test_dynamic_slices_build_and_keep_every_limit(spec: str) -> None:
    result = dynamic(spec)
    slices = _slices(result)  # build_slices validates every slice
    counter_slices = [s["spec"] for s in slices if "sharedCounters" in s["spec"]]  # type: ignore[index,operator]
    device_slices = [s["spec"] for s in slices if "devices" in s["spec"]]  # type: ignore[index,operator]
    assert sum(len(s["sharedCounters"]) for s in counter_slices) == len(result.counter_sets)
    for spec_ in counter_slices:
        assert len(spec_["sharedCounters"]) <= MAX_COUNTER_SETS_PER_SLICE
        for counter_set in spec_["sharedCounters"]:
            assert len(counter_set["counters"]) <= MAX_COUNTERS_PER_SET
    published = [d for s in device_slices for d in s["devices"]]
    assert len(published) == len(result.devices)
    for spec_ in device_slices:
        assert len(spec_["devices"]) <= MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS
        consumed = sum(
            len(use["counters"]) for d in spec_["devices"] for use in d.get("consumesCounters", ())
        )
        assert consumed <= MAX_CONSUMED_COUNTERS_PER_SLICE
        for device in spec_["devices"]:
            assert len(device.get("consumesCounters", ())) <= MAX_CONSUMED_COUNTER_SETS


def test_eight_h100s() -> None:
    result = dynamic("h100-80gb:8")
    assert len(result.counter_sets) == 8
    assert len(result.devices) == 8 * 26
    slices = _slices(result)
    assert len(slices) == 1 + 4  # 8 counter sets in one slice, 208 devices by 64

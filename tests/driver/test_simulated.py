"""The simulated backend: profile specs, deterministic fake hardware, fault injection."""

from __future__ import annotations

import inspect
import re

import pytest

from drasil.driver.nvidia.nodedevices import mig_profile_name
from drasil.driver.nvidia.nvml import (
    EVENT_TYPE_XID_CRITICAL_ERROR,
    NO_INSTANCE,
    DeviceAttributes,
    NvmlLibrary,
    NvmlNotFound,
    NvmlNotSupported,
    NvmlQueryError,
    NvmlUnavailable,
)
from drasil.driver.nvidia.nvmladapter import PynvmlLibrary
from drasil.driver.simulated.gpucatalog import PROFILES, MiB
from drasil.driver.simulated.gpus import ProfileSpecError, parse_profile_spec, simulated_gpus
from drasil.driver.simulated.nvml import FakeNvml, simulated_library

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def test_spec_syntax() -> None:
    assert parse_profile_spec("h100-80gb:8") == [("h100-80gb", 8)]
    assert parse_profile_spec("h100-80gb:4, l4:2") == [("h100-80gb", 4), ("l4", 2)]
    assert parse_profile_spec("l4") == [("l4", 1)]


def test_unknown_profile_names_the_available_ones() -> None:
    with pytest.raises(ProfileSpecError) as err:
        parse_profile_spec("h100:8")
    assert str(err.value) == (
        'unknown profile "h100"; available: a100-40gb, a100-40gb-mig, a100-80gb, '
        "a100-80gb-mig, b200, b200-mig, h100-80gb, h100-80gb-mig, h200-141gb, "
        "h200-141gb-mig, l4"
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("h100-80gb:x", 'bad count "x" for profile "h100-80gb"'),
        ("h100-80gb:0", 'bad count 0 for profile "h100-80gb": must be 1 to 64'),
        ("h100-80gb:65", 'bad count 65 for profile "h100-80gb": must be 1 to 64'),
        ("h100-80gb:40,l4:30", "asks for 70 GPUs; at most 64"),
        ("", "empty profile spec"),
        (" , ", "empty profile spec"),
    ],
)
def test_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ProfileSpecError, match=re.escape(message)):
        simulated_library(spec, node_name="n")


def test_hardware_is_a_function_of_spec_and_node() -> None:
    first = simulated_gpus("h100-80gb:4,l4:4", node_name="node-a")
    again = simulated_gpus("h100-80gb:4,l4:4", node_name="node-a")
    other = simulated_gpus("h100-80gb:4,l4:4", node_name="node-b")
    assert first == again
    assert {g.uuid for g in first}.isdisjoint(g.uuid for g in other)
    assert all(re.fullmatch(f"GPU-{UUID}", g.uuid) for g in first)
    assert len({g.uuid for g in first}) == 8
    assert len({g.pci_bus_id for g in first}) == 8
    assert [g.numa_node for g in first] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.model.product_name for g in first[3:5]] == ["NVIDIA H100 80GB HBM3", "NVIDIA L4"]


def test_mig_uuids_and_layout() -> None:
    gpus = simulated_gpus("a100-40gb-mig:2", node_name="n")
    migs = [m for g in gpus for m in g.migs]
    assert len(migs) == 8
    assert all(re.fullmatch(f"MIG-{UUID}", m.uuid) for m in migs)
    assert len({m.uuid for m in migs}) == 8


@pytest.mark.parametrize("name", sorted(n for n in PROFILES if PROFILES[n].mig_layout))
def test_mig_layouts_fit_their_gpu(name: str) -> None:
    model = PROFILES[name]
    assert sum(m.profile.gpu_slices for m in model.mig_layout) <= 7
    assert sum(m.profile.memory_mib for m in model.mig_layout) <= model.memory_mib
    assert len({m.gpu_instance_id for m in model.mig_layout}) == len(model.mig_layout)


@pytest.mark.parametrize("name", sorted(n for n in PROFILES if PROFILES[n].mig_layout))
def test_mig_profile_names_match_their_numbers(name: str) -> None:
    # The catalog names profiles as nvidia-smi does; discovery derives the name from
    # the numbers alone, so the two must agree.
    model = PROFILES[name]
    for instance in model.mig_layout:
        p = instance.profile
        facts = DeviceAttributes(
            multiprocessor_count=p.multiprocessors,
            copy_engine_count=p.copy_engines,
            decoder_count=p.decoders,
            encoder_count=p.encoders,
            jpeg_count=p.jpeg_engines,
            ofa_count=p.ofa_engines,
            gpu_instance_slice_count=p.gpu_slices,
            compute_instance_slice_count=p.gpu_slices,
            memory_size_mib=p.memory_mib,
        )
        assert mig_profile_name(facts, parent_memory=model.memory_mib * MiB) == p.name


def test_fake_and_adapter_implement_the_protocol() -> None:
    members = {
        name
        for name, _ in inspect.getmembers(NvmlLibrary, inspect.isfunction)
        if not name.startswith("_")
    }
    assert "event_set_wait" in members
    for cls in (FakeNvml, PynvmlLibrary):
        missing = {m for m in members if not callable(getattr(cls, m, None))}
        assert not missing, (cls.__name__, missing)
    lib: NvmlLibrary = simulated_library("l4:1", node_name="n")
    lib.init()
    assert lib.device_count() == 1


def test_fake_answers_like_nvml() -> None:
    lib = simulated_library("l4:1,a100-40gb-mig:1", node_name="n")
    lib.init()
    l4, a100 = lib.device_handle_by_index(0), lib.device_handle_by_index(1)
    with pytest.raises(NvmlNotSupported):
        lib.device_mig_mode(l4)
    assert lib.device_mig_mode(a100).current
    assert lib.device_max_mig_device_count(a100) == 7
    mig = lib.device_mig_device_handle_by_index(a100, 0)
    with pytest.raises(NvmlNotFound):
        lib.device_mig_device_handle_by_index(a100, 4)
    assert lib.device_uuid(lib.device_parent_handle(mig)) == lib.device_uuid(a100)
    assert lib.device_uuid(mig).startswith("MIG-")
    assert lib.device_nodes(0) == ()
    assert lib.pcie_root("0000:19:00.0") == "pci0000:18"
    with pytest.raises(NvmlQueryError):
        lib.device_gpu_instance_id(a100)


def test_fault_injection() -> None:
    lib = simulated_library("h100-80gb:2", node_name="n")
    lib.init()
    lib.fail_device(1, call="device_name", message="boom")
    assert lib.device_name(lib.device_handle_by_index(0)) == "NVIDIA H100 80GB HBM3"
    with pytest.raises(NvmlQueryError, match="boom"):
        lib.device_name(lib.device_handle_by_index(1))
    with pytest.raises(ValueError, match="not an NvmlLibrary method"):
        lib.fail_device(0, call="device_nmae")
    lib.fail_init("Driver Not Loaded")
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        lib.init()
    lib.clear_faults()
    lib.init()
    assert lib.device_name(lib.device_handle_by_index(1)) == "NVIDIA H100 80GB HBM3"


def test_xid_events_reach_registered_event_sets() -> None:
    lib = simulated_library("a100-40gb-mig:2", node_name="n")
    lib.init()
    gpu0 = lib.device_handle_by_index(0)
    events = lib.event_set_create()
    lib.device_register_events(gpu0, EVENT_TYPE_XID_CRITICAL_ERROR, events)
    assert lib.event_set_wait(events, 0) is None
    assert lib.inject_xid(1, 79) == 0  # GPU 1 is not registered
    assert lib.inject_xid(0, 48, mig=2) == 1
    event = lib.event_set_wait(events, 1000)
    assert event is not None
    assert (event.event_type, event.event_data) == (EVENT_TYPE_XID_CRITICAL_ERROR, 48)
    assert lib.device_uuid(event.device) == lib.device_uuid(gpu0)
    assert event.gpu_instance_id == 9
    assert event.compute_instance_id == 0
    lib.inject_xid(0, 79)
    event = lib.event_set_wait(events, 1000)
    assert event is not None
    assert event.gpu_instance_id == NO_INSTANCE
    lib.event_set_free(events)
    assert lib.inject_xid(0, 79) == 0

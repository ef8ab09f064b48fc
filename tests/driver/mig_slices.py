"""Hand-made ResourceSlices of one H100 in ``--mig-mode dynamic``, for explain tests.

The shapes drasil publishes (docs/design.md): a counter set ``gpu-<minor>-counters``
with ``memory-slice-0``..``memory-slice-7`` (1 each) and the GPU's engines; the full
GPU ``gpu-<minor>`` drawing all of it; one device per MIG placement drawing its memory
slices and its own share of the rest. Built with the real slice builder, so the
tests read what the node plugin would write.
"""

from __future__ import annotations

from typing import Any

from drasil.driver.devices import CounterConsumption, CounterSet, Device, DeviceType
from drasil.driver.slices.build import build_slices

DRIVER = "gpu.drasil.dev"
GIB = 2**30
MULTIPROCESSORS = 132
# profile: (memory slices, starts, multiprocessors)
H100_PROFILES: dict[str, tuple[int, tuple[int, ...], int]] = {
    "1g.10gb": (1, (0, 1, 2, 3, 4, 5, 6), 16),
    "1g.20gb": (2, (0, 2, 4, 6), 16),
    "2g.20gb": (2, (0, 2, 4), 32),
    "3g.40gb": (4, (0, 4), 60),
    "4g.40gb": (4, (0,), 64),
    "7g.80gb": (8, (0,), 132),
}


def device_class(name: str, device_type: str) -> dict[str, Any]:
    expression = f'device.attributes["{DRIVER}"].type == "{device_type}"'
    return {
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


MIG_CLASS = device_class("mig.drasil.dev", "mig")
GPU_CLASS = device_class(DRIVER, "gpu")


def placement_name(minor: int, profile: str, start: int) -> str:
    return f"gpu-{minor}-mig-{profile.replace('.', '')}-at-{start}"


def _slices(size: int, start: int) -> dict[str, int]:
    return {f"memory-slice-{i}": 1 for i in range(start, start + size)}


def h100_devices(minor: int) -> tuple[CounterSet, list[Device]]:
    uuid = f"GPU-{minor:08d}"
    counter_set = f"gpu-{minor}-counters"
    everything = {**_slices(8, 0), "memory": 80 * GIB, "multiprocessors": MULTIPROCESSORS}
    full = Device(
        name=f"gpu-{minor}",
        type=DeviceType.GPU,
        uuid=uuid,
        minor=minor,
        attributes={"type": "gpu", "uuid": uuid, "productName": "NVIDIA H100 80GB HBM3"},
        capacity={"memory": 80 * GIB},
        consumes_counters=(CounterConsumption(counter_set, everything),),
    )
    devices = [full]
    for profile, (size, starts, sms) in H100_PROFILES.items():
        for start in starts:
            draw = {**_slices(size, start), "memory": size * 10 * GIB, "multiprocessors": sms}
            devices.append(
                Device(
                    name=placement_name(minor, profile, start),
                    type=DeviceType.MIG,
                    uuid="",
                    minor=minor,
                    attributes={
                        "type": "mig",
                        "profile": profile,
                        "placementStart": start,
                        "placementSize": size,
                        "parentUUID": uuid,
                    },
                    capacity={"memory": size * 10 * GIB, "multiprocessors": sms},
                    consumes_counters=(CounterConsumption(counter_set, draw),),
                )
            )
    return CounterSet(counter_set, everything), devices


def h100_slices(node: str = "node-a", minors: tuple[int, ...] = (2,)) -> list[dict[str, Any]]:
    """The pool of ``node`` with one dynamic-MIG H100 per minor."""
    counter_sets: list[CounterSet] = []
    devices: list[Device] = []
    for minor in minors:
        counter_set, own = h100_devices(minor)
        counter_sets.append(counter_set)
        devices += own
    return build_slices(
        driver=DRIVER,
        pool=node,
        devices=devices,
        node_name=node,
        counter_sets=counter_sets,
        generation=1,
        owner=None,
    )

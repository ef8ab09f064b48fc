"""Cost of explaining one pending claim: 3 selectors against 1,000 published devices.

Setup: simulated nodes of several GPU profiles (full GPUs and MIG layouts) discovered
and published into ResourceSlices exactly as the node plugin does, cut to 1,000
devices. One explain evaluates every selector of the claim (its class's and its own)
against every device, so it can report how many devices pass each stage.

Measured for ``drasil.driver.cel.selectors``: the first explain in a fresh process (including
celpy's parser construction), a cold explain (compile + convert every device +
evaluate), a warm one (compiled selectors and converted devices cached, as in the
controller), and each part alone. For comparison, plain ``celpy`` the naive way
(parse and convert for every evaluation) and celpy at its best (parsed once,
converted once). celpy has no Kubernetes library, so it gets the few functions these
selectors call, backed by drasil's own Quantity and Semver; the match counts of both
must agree.

``python -m bench.explain`` writes bench/results/explain.json and prints it.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import celpy
from celpy import celtypes
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError

from drasil.api.limits import allow_nesting
from drasil.driver.cel.selectors import (
    CelDeviceCache,
    clear_compile_cache,
    compile_selector,
)
from drasil.driver.cel.values import Quantity, Semver
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.objects import JsonDict
from drasil.driver.simulated.nvml import simulated_library
from drasil.driver.slices.build import build_slices

DRIVER = "gpu.drasil.dev"
DEVICES = 1000
# Node profiles in turn; the MIG layouts put 3-4 devices on each GPU.
PROFILES = ("h100-80gb:8", "a100-80gb:8", "l4:8", "a100-40gb-mig:8", "h100-80gb-mig:8")
SELECTORS = (
    # The DeviceClass gpu.drasil.dev, then two claim selectors.
    'device.attributes["gpu.drasil.dev"].type == "gpu"',
    'device.capacity["gpu.drasil.dev"].memory.compareTo(quantity("40Gi")) >= 0',
    'device.attributes["gpu.drasil.dev"].cudaComputeCapability.isGreaterThan(semver("8.0.0"))'
    ' && device.attributes["gpu.drasil.dev"].productName.lowerAscii().contains("h100")',
)
ROUNDS = 15


def published_slices(count: int = DEVICES) -> list[JsonDict]:
    """ResourceSlices of simulated nodes holding exactly ``count`` devices."""
    slices: list[JsonDict] = []
    total = 0
    for index, node, profile in _nodes():
        devices = discover(simulated_library(profile, node_name=node), node_name=node).devices
        devices = devices[: count - total]
        for obj in build_slices(
            driver=DRIVER, pool=node, devices=devices, node_name=node, generation=1, owner=None
        ):
            # What the API server adds: the cache keys on these.
            obj["metadata"].update(
                uid=f"uid-{index}-{obj['metadata']['name']}", resourceVersion="1"
            )
            slices.append(obj)
        total += len(devices)
        if total >= count:
            return slices
    raise AssertionError("unreachable")


def _nodes() -> Iterator[tuple[int, str, str]]:
    index = 0
    while True:
        yield index, f"node-{index}", PROFILES[index % len(PROFILES)]
        index += 1


def explain(slices: Sequence[JsonDict], cache: CelDeviceCache) -> list[int]:
    """What one claim explanation does: every selector on every device, counted."""
    selectors = [compile_selector(s) for s in SELECTORS]
    counts = [0] * len(selectors)
    for obj in slices:
        for device in cache.devices(obj):
            for i, selector in enumerate(selectors):
                if selector.evaluate(device).matched:
                    counts[i] += 1
    return counts


def _ms(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return (time.perf_counter() - start) * 1000


def _median_ms(action: Callable[[], object], rounds: int = ROUNDS) -> float:
    return statistics.median(_ms(action) for _ in range(rounds))


def measure_drasil(slices: Sequence[JsonDict]) -> dict[str, Any]:
    def cold() -> list[int]:
        clear_compile_cache()
        return explain(slices, CelDeviceCache())

    first = _ms(cold)
    warm_cache = CelDeviceCache()
    counts = explain(slices, warm_cache)
    devices = [d for obj in slices for d in warm_cache.devices(obj)]
    selectors = [compile_selector(s) for s in SELECTORS]

    def evaluate_all() -> None:
        for device in devices:
            for selector in selectors:
                selector.evaluate(device)

    def compile_all() -> None:
        clear_compile_cache()
        for expression in SELECTORS:
            compile_selector(expression)

    evaluations = len(devices) * len(selectors)
    evaluate_ms = _median_ms(evaluate_all)
    convert_ms = _median_ms(lambda: [CelDeviceCache().devices(obj) for obj in slices])
    return {
        "matches": counts,
        "explain_first_in_process_ms": first,
        "explain_cold_ms": _median_ms(cold),
        "explain_warm_ms": _median_ms(lambda: explain(slices, warm_cache)),
        "compile_3_selectors_ms": _median_ms(compile_all),
        "convert_devices_ms": convert_ms,
        "evaluate_all_ms": evaluate_ms,
        "per_evaluation_us": evaluate_ms * 1000 / evaluations,
        "per_device_conversion_us": convert_ms * 1000 / len(devices),
    }


# --- plain celpy -------------------------------------------------------------------

CELPY_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quantity": lambda text: Quantity.parse(str(text)),
    "semver": lambda text: Semver.parse(str(text)),
    "compareTo": lambda a, b: celtypes.IntType(a.compare(b)),
    "isGreaterThan": lambda a, b: celtypes.BoolType(a.compare(b) == 1),
    "lowerAscii": lambda text: celtypes.StringType(str(text).lower()),
}


def celpy_device(device: Mapping[str, Any], driver: str) -> Any:
    """A ResourceSlice device as celpy values, shaped like upstream's ``device``."""
    attributes: dict[str, dict[str, Any]] = {}
    for name, attribute in (device.get("attributes") or {}).items():
        domain, _, ident = name.rpartition("/")
        value = attribute.get("int", attribute.get("bool", attribute.get("string")))
        if value is None:
            value = Semver.parse(attribute["version"])
        attributes.setdefault(domain or driver, {})[ident] = value
    capacity: dict[str, dict[str, Any]] = {}
    for name, entry in (device.get("capacity") or {}).items():
        domain, _, ident = name.rpartition("/")
        capacity.setdefault(domain or driver, {})[ident] = Quantity.parse(entry["value"])
    return celtypes.MapType(
        {
            celtypes.StringType("driver"): celtypes.StringType(driver),
            celtypes.StringType("attributes"): _celpy_map(attributes),
            celtypes.StringType("capacity"): _celpy_map(capacity),
        }
    )


def _celpy_map(domains: Mapping[str, Mapping[str, Any]]) -> Any:
    converted = celtypes.MapType()
    for domain, values in domains.items():
        inner = celtypes.MapType()
        for key, value in values.items():
            plain = isinstance(value, bool | int | str)
            inner[celtypes.StringType(key)] = json_to_cel(value) if plain else value
        converted[celtypes.StringType(domain)] = inner
    return converted


def _celpy_matches(program: Any, activation: Mapping[str, Any]) -> bool:
    try:
        result = program.evaluate(activation)
    except CELEvalError:
        return False
    return isinstance(result, celtypes.BoolType) and bool(result)


def _devices_of(slices: Sequence[JsonDict]) -> Iterator[tuple[Mapping[str, Any], str]]:
    for obj in slices:
        for device in obj["spec"].get("devices", ()):
            yield device, obj["spec"]["driver"]


def _celpy_environment() -> Any:
    """A celpy Environment, without the side effect of its constructor: it sets the
    process's recursion limit to 2500, lowering the one drasil's entry points raise
    (``drasil.api.limits.allow_nesting``) for everything that runs after it."""
    limit = sys.getrecursionlimit()
    env = celpy.Environment()
    sys.setrecursionlimit(max(limit, sys.getrecursionlimit()))
    return env


def naive_celpy_explain(slices: Sequence[JsonDict]) -> list[int]:
    """The naive way: parse every selector and convert the device for each evaluation."""
    env = _celpy_environment()
    counts = [0] * len(SELECTORS)
    for device, driver in _devices_of(slices):
        for i, expression in enumerate(SELECTORS):
            program = env.program(env.compile(expression), functions=CELPY_FUNCTIONS)
            if _celpy_matches(program, {"device": celpy_device(device, driver)}):
                counts[i] += 1
    return counts


def measure_celpy(slices: Sequence[JsonDict]) -> dict[str, Any]:
    counts: list[int] = []
    naive_ms = _ms(lambda: counts.extend(naive_celpy_explain(slices)))
    env = _celpy_environment()
    programs = [env.program(env.compile(e), functions=CELPY_FUNCTIONS) for e in SELECTORS]
    activations = [{"device": celpy_device(d, driver)} for d, driver in _devices_of(slices)]

    def evaluate_all() -> None:
        for activation in activations:
            for program in programs:
                _celpy_matches(program, activation)

    evaluations = len(activations) * len(programs)
    evaluate_ms = _median_ms(evaluate_all, rounds=3)
    return {
        "naive": {
            "matches": counts,
            "explain_ms": naive_ms,
            "per_evaluation_us": naive_ms * 1000 / evaluations,
        },
        "compiled_once_converted_once": {
            "evaluate_all_ms": evaluate_ms,
            "per_evaluation_us": evaluate_ms * 1000 / evaluations,
        },
    }


def run(devices: int = DEVICES) -> dict[str, Any]:
    slices = published_slices(devices)
    devices = sum(len(obj["spec"].get("devices", ())) for obj in slices)  # as published
    drasil = measure_drasil(slices)
    plain = measure_celpy(slices)
    if drasil["matches"] != plain["naive"]["matches"]:
        raise AssertionError(f"drasil {drasil['matches']} != celpy {plain['naive']['matches']}")
    return {
        "devices": devices,
        "slices": len(slices),
        "nodes": len({obj["spec"]["nodeName"] for obj in slices}),
        "selectors": list(SELECTORS),
        "evaluations_per_explain": devices * len(SELECTORS),
        "drasil": drasil,
        "celpy": plain,
        "speedup": {
            "explain_cold_vs_naive_celpy": plain["naive"]["explain_ms"] / drasil["explain_cold_ms"],
            "evaluation_vs_celpy_compiled_once": plain["compiled_once_converted_once"][
                "per_evaluation_us"
            ]
            / drasil["per_evaluation_us"],
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }


def main() -> None:
    allow_nesting()  # as the controller and the CLI, which compile the same selectors
    result = run()
    out = Path(__file__).parent / "results" / "explain.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

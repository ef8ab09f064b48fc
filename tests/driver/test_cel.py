"""Device selectors evaluated as kube-scheduler evaluates them: a table of expressions.

Each row is an expression and what it must give against one device: ``True`` or
``False`` (matched or not, without error), ``Err("…")`` (an evaluation error whose
message contains the text) or ``Compile("…")`` (rejected when compiled). Rows quote
the upstream DRA docs, the Kubernetes CEL library docs and drasil's own attributes.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from drasil.driver.cel.compiler import MAX_NESTING
from drasil.driver.cel.selectors import (
    CelCompileError,
    CelDeadlineExceeded,
    CelDevice,
    CelDeviceCache,
    SelectorResult,
    compile_selector,
    scheduler_error,
    slice_devices,
)
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.simulated.nvml import simulated_library
from drasil.driver.slices.build import build_slices

DRIVER = "gpu.drasil.dev"


@dataclass(frozen=True)
class Err:
    """An evaluation error whose message contains ``text``."""

    text: str


@dataclass(frozen=True)
class Compile:
    """A compile error whose message contains ``text``."""

    text: str


Expected = bool | Err | Compile


def _slice_devices(profile: str) -> dict[str, CelDevice]:
    result = discover(simulated_library(profile, node_name="node-a"), node_name="node-a")
    slices = build_slices(
        driver=DRIVER,
        pool="node-a",
        devices=result.devices,
        node_name="node-a",
        generation=1,
        owner=None,
    )
    return {d.name: d for s in slices for d in slice_devices(s)}


SIMULATED = _slice_devices("h100-80gb:2,a100-40gb-mig:1")
H100 = SIMULATED["gpu-0"]
MIG = SIMULATED["gpu-2-mig-1g5gb-9-0"]

# The example device of the CELDeviceSelector API docs (resource.k8s.io/v1).
DOCS_DEVICE = CelDevice.from_json(
    {
        "name": "docs",
        "attributes": {
            "model": {"string": "LATEST-GPU-MODEL"},
            "ext.example.com/family": {"string": "gpu"},
            "someBool": {"bool": True},
            "anotherBool": {"bool": True},
        },
        "capacity": {"modules": {"value": "4"}},
    },
    driver="dra.example.com",
)
# The device of the DRA concept page's claim examples (kubernetes.io).
WEBSITE_DEVICE = CelDevice.from_json(
    {
        "name": "gpu-0",
        "attributes": {"type": {"string": "gpu"}},
        "capacity": {"memory": {"value": "64Gi"}},
    },
    driver="driver.example.com",
)

UPSTREAM_DOCS: list[tuple[str, Expected]] = [
    ('device.driver == "dra.example.com"', True),
    ('device.attributes["dra.example.com"].model == "LATEST-GPU-MODEL"', True),
    ('device.attributes["ext.example.com"].family == "gpu"', True),
    ('device.capacity["dra.example.com"].modules == quantity("4")', True),
    (
        'cel.bind(dra, device.attributes["dra.example.com"], dra.someBool && dra.anotherBool)',
        True,
    ),
    # "If an unknown prefix is used as a lookup … an empty map will be returned."
    ('device.attributes["unknown.example.com"].size() == 0', True),
    ('device.capacity["unknown.example.com"] == {}', True),
    # "Any reference to an unknown field will cause an evaluation error."
    ('device.attributes["dra.example.com"].unknown == 1', Err("no such key: unknown")),
    ('has(device.attributes["dra.example.com"].unknown)', False),
    ("device.allowMultipleAllocations == false", True),
]

WEBSITE_DOCS: list[tuple[str, Expected]] = [
    ('device.attributes["driver.example.com"].type == "gpu"', True),
    ('device.capacity["driver.example.com"].memory.compareTo(quantity("10Gi")) >= 0', True),
    (
        'device.attributes["driver.example.com"].type == "gpu" && '
        'device.capacity["driver.example.com"].memory.compareTo(quantity("64Gi")) >= 0',
        True,
    ),
    ('device.capacity["driver.example.com"].memory.compareTo(quantity("80Gi")) >= 0', False),
]

DRASIL_ATTRIBUTES: list[tuple[str, Expected]] = [
    # The DeviceClasses of docs/design.md#names.
    ('device.attributes["gpu.drasil.dev"].type == "gpu"', True),
    ('device.attributes["gpu.drasil.dev"].type == "mig"', False),
    ('device.driver == "gpu.drasil.dev"', True),
    ('device.attributes["gpu.drasil.dev"].productName == "NVIDIA H100 80GB HBM3"', True),
    ('device.attributes["gpu.drasil.dev"].index == 0', True),
    ('device.attributes["resource.kubernetes.io"].pciBusID == "0000:19:00.0"', True),
    ('device.attributes["resource.kubernetes.io"].pcieRoot.startsWith("pci0000:")', True),
    ('device.capacity["gpu.drasil.dev"].memory == quantity("80Gi")', True),
    ('device.capacity["gpu.drasil.dev"].memory.isGreaterThan(quantity("40Gi"))', True),
    ('device.capacity["gpu.drasil.dev"].memory.asInteger() == 85899345920', True),
    # Version attributes are semver values.
    (
        'device.attributes["gpu.drasil.dev"].cudaComputeCapability.isGreaterThan(semver("8.0.0"))',
        True,
    ),
    (
        'device.attributes["gpu.drasil.dev"].cudaComputeCapability.isLessThan(semver("9.0.0"))',
        False,
    ),
    ('device.attributes["gpu.drasil.dev"].cudaComputeCapability == semver("9.0.0")', True),
    ('device.attributes["gpu.drasil.dev"].cudaComputeCapability.major() >= 9', True),
    ('device.attributes["gpu.drasil.dev"].cudaComputeCapability.minor() == 0', True),
    (
        'device.attributes["gpu.drasil.dev"].driverVersion.compareTo(semver("570.0.0")) > 0',
        True,
    ),
    ('device.attributes["gpu.drasil.dev"].driverVersion.patch() == 5', True),
    ('device.attributes["gpu.drasil.dev"].cudaDriverVersion.isLessThan(semver("13.0.1"))', True),
    # Upstream's Semver.Equal rejects other types: comparing with a string is an error.
    (
        'device.attributes["gpu.drasil.dev"].cudaComputeCapability == "9.0.0"',
        Err("no such overload"),
    ),
    ('"9.0.0" == device.attributes["gpu.drasil.dev"].cudaComputeCapability', False),
    # has() guards keep full GPUs out of MIG selectors without errors.
    ('has(device.attributes["gpu.drasil.dev"].profile)', False),
    (
        'has(device.attributes["gpu.drasil.dev"].profile) && '
        'device.attributes["gpu.drasil.dev"].profile == "1g.5gb"',
        False,
    ),
    ('device.attributes["gpu.drasil.dev"].profile == "1g.5gb"', Err("no such key: profile")),
    (
        'device.attributes["gpu.drasil.dev"].profile == "1g.5gb"',
        Err("Consider using CEL optional chaining (?), has() macro, or orValue()"),
    ),
    ('has(device.attributes["gpu.drasil.dev"].nope.deeper)', Err("no such key: nope")),
    ('device.capacity["gpu.drasil.dev"].multiprocessors > 0', Err("no such key")),
    ('"gpu.drasil.dev" in device.attributes', True),
    ('"other.example.com" in device.attributes', False),
    ('"uuid" in device.attributes["gpu.drasil.dev"]', True),
    ('device.attributes["gpu.drasil.dev"].exists(name, name == "uuid")', True),
    ('device.attributes["gpu.drasil.dev"].all(name, name.size() > 0)', True),
]

MIG_ATTRIBUTES: list[tuple[str, Expected]] = [
    ('device.attributes["gpu.drasil.dev"].type == "mig"', True),
    ('device.attributes["gpu.drasil.dev"].profile == "1g.5gb"', True),
    ('device.capacity["gpu.drasil.dev"].memory == quantity("4864Mi")', True),
    ('device.capacity["gpu.drasil.dev"].multiprocessors.compareTo(quantity("14")) == 0', True),
    ('device.attributes["gpu.drasil.dev"].parentUUID.startsWith("GPU-")', True),
    (
        'has(device.attributes["gpu.drasil.dev"].profile) && '
        'device.attributes["gpu.drasil.dev"].profile.split(".")[0] == "1g"',
        True,
    ),
]

ERROR_ABSORPTION: list[tuple[str, Expected]] = [
    # cel-go's && and || ignore an error when the other side decides the result.
    ('false && device.attributes["gpu.drasil.dev"].missing', False),
    ('device.attributes["gpu.drasil.dev"].missing && false', False),
    ('device.attributes["gpu.drasil.dev"].missing || true', True),
    ('device.attributes["gpu.drasil.dev"].missing && true', Err("no such key: missing")),
    ('true && "yes"', Err("no such overload")),
    ("1 / 0 == 1 || true", True),
    ("[1, 0].all(x, 1 / x > 0)", Err("division by zero")),
    ("[1, 0].exists(x, 1 / x > 0)", True),
    ('device.attributes["gpu.drasil.dev"].index == 0 ? true : 1 / 0 == 1', True),
    ('"x" ? true : false', Err("no such overload")),
]

STRINGS: list[tuple[str, Expected]] = [
    ('device.attributes["gpu.drasil.dev"].productName.lowerAscii().contains("h100")', True),
    (
        'device.attributes["gpu.drasil.dev"].productName.upperAscii() == "NVIDIA H100 80GB HBM3"',
        True,
    ),
    ('"ÄbC".lowerAscii() == "Äbc"', True),
    (
        'device.attributes["gpu.drasil.dev"].productName.split(" ") == '
        '["NVIDIA", "H100", "80GB", "HBM3"]',
        True,
    ),
    ('"a,b,c".split(",", 2) == ["a", "b,c"]', True),
    ('"a,b,c".split(",", 0) == []', True),
    ('"abc".split("") == ["a", "b", "c"]', True),
    ('device.attributes["gpu.drasil.dev"].productName.indexOf("H100") == 7', True),
    ('"hello".indexOf("l", 3) == 3', True),
    ('"hello".indexOf("z") == -1', True),
    ('"hello".indexOf("l", 9)', Err("index out of range: 9")),
    ('"hello".lastIndexOf("l") == 3', True),
    ('"hello".lastIndexOf("l", 2) == 2', True),
    ('"NVIDIA L4".endsWith("L4")', True),
    ('"NVIDIA L4".startsWith("AMD")', False),
    ('device.attributes["gpu.drasil.dev"].productName.matches("^NVIDIA (H|A)100")', True),
    ('matches("GPU-1234", "^GPU-[0-9]+$")', True),
    ('"abc".matches("(")', Err("error parsing regexp")),
    ('"héllo".size() == 5', True),
    ('size("abc") == 3', True),
    ('"hello".charAt(1) == "e"', True),
    ('"hello".substring(1, 3) == "el"', True),
    ('"hello".substring(3, 1)', Err("invalid substring range")),
    ('"a-b-c".replace("-", "_") == "a_b_c"', True),
    ('"a-b-c".replace("-", "_", 1) == "a_b-c"', True),
    ('"  x ".trim() == "x"', True),
    ('["a", "b"].join("/") == "a/b"', True),
    ('"abc 123".find("[0-9]+") == "123"', True),
    ('"1, 2, 3".findAll("[0-9]+") == ["1", "2", "3"]', True),
    ('"abc".contains(1)', Err("no such overload")),
    ('"a" + "b" == "ab"', True),
    ('"a" < "b"', True),
    ('"a" < 1', Err("no such overload")),
]

QUANTITIES: list[tuple[str, Expected]] = [
    # Exact arithmetic: a float would say 0.1 + 0.2 != 0.3.
    ('quantity("0.1").add(quantity("0.2")) == quantity("0.3")', True),
    ('quantity("1Gi").sub(quantity("1G")).asInteger() == 73741824', True),
    ('quantity("50k").add(20).sub(quantity("100k")).sub(-50000).asInteger() == 20', True),
    ('quantity("50k").add(quantity("20")) == quantity("50.02k")', True),
    ('quantity("50k").sub(20) == quantity("49980")', True),
    (
        'quantity("9999999999999999999999999999999999999G").add(1).sub(1) == '
        'quantity("9999999999999999999999999999999999999G")',
        True,
    ),
    ('quantity("9999999999999999999999999999999999999G").isInteger()', False),
    (
        'quantity("9999999999999999999999999999999999999G").asInteger()',
        Err("cannot convert value to integer"),
    ),
    ('quantity("500m").isInteger()', False),
    ('quantity("1000m").asInteger() == 1', True),
    ('quantity("50.703k").asApproximateFloat() == 50703.0', True),
    ('quantity("200M").compareTo(quantity("0.2G")) == 0', True),
    ('quantity("50M").compareTo(quantity("50Mi")) == -1', True),
    ('quantity("50Mi").isGreaterThan(quantity("50M"))', True),
    ('quantity("50M").isLessThan(quantity("100M"))', True),
    ('quantity("200M") == quantity("0.2G") && quantity("0.2G") == quantity("200M")', True),
    ('quantity("200M") == quantity("0.3G")', False),
    ('quantity("1e3") == quantity("1k")', True),
    ('sign(quantity("-1Gi")) == -1 && sign(quantity("0")) == 0 && sign(quantity("1m")) == 1', True),
    ('isQuantity("20Mi")', True),
    ('isQuantity("20Mo")', False),
    ('isQuantity("10Mm")', False),
    ('isQuantity(" 1")', False),
    ('quantity("10Mo")', Err("quantities must match the regular expression")),
    ('quantity("10Mm") == quantity("1")', Err("unable to parse quantity's suffix")),
    # Upstream quantities have no ordering operators: users call compareTo.
    ('quantity("1") < quantity("2")', Err("no such overload")),
    ('quantity("1") == "1"', False),
    ('quantity("1").add("1")', Err("no such overload")),
]

SEMVERS: list[tuple[str, Expected]] = [
    (
        'semver("1.2.3").major() == 1 && semver("1.2.3").minor() == 2 && '
        'semver("1.2.3").patch() == 3',
        True,
    ),
    ('semver("1.2.3").compareTo(semver("2.0.0")) == -1', True),
    ('semver("1.2.3").compareTo(semver("0.1.2")) == 1', True),
    ('semver("1.0.0-alpha").isLessThan(semver("1.0.0"))', True),
    ('semver("1.0.0-alpha.1").isLessThan(semver("1.0.0-alpha.beta"))', True),
    ('semver("1.0.0-rc.2").isLessThan(semver("1.0.0-rc.10"))', True),
    ('semver("1.0.0+build.1") == semver("1.0.0+build.2")', True),
    ('isSemver("1.0.0") && !isSemver("v1.0") && !isSemver("hello")', True),
    ('isSemver("v1.0", true) && semver("01.01.01", true) == semver("1.1.1")', True),
    ('semver("1.2")', Err("No Major.Minor.Patch elements found")),
    ('semver("01.2.3")', Err("Major number must not contain leading zeroes")),
    ('semver("1.2.3") < semver("1.2.4")', Err("no such overload")),
]

LANGUAGE: list[tuple[str, Expected]] = [
    ("1 == 1.0 && 1u == 1 && 2 > 1.5", True),
    ("1 + 2 * 3 == 7 && 7 / 2 == 3 && -7 / 2 == -3 && -7 % 3 == -1", True),
    ("9223372036854775807 + 1 > 0", Err("integer overflow")),
    ("1 + 1u == 2", Err("no such overload")),
    ("1.0 / 0.0 > 1e308", True),
    ("[1, 2, 3].map(x, x * 2) == [2, 4, 6]", True),
    ("[1, 2, 3].map(x, x > 1, x * 10) == [20, 30]", True),
    ("[1, 2, 3].filter(x, x % 2 == 1) == [1, 3]", True),
    ("[1, 2, 3].exists_one(x, x == 2)", True),
    ("{'a': 1}.a == 1 && {'a': 1}['a'] == 1", True),
    ("{'a': 1}.b == 1", Err("no such key: b")),
    ("[1, 2][5] == 1", Err("index out of range: 5")),
    ("2 in [1, 2] && !(3 in [1, 2])", True),
    ("cel.bind(x, 2, cel.bind(y, 3, x * y)) == 6", True),
    ("[1, 2].all(device, device > 0)", True),
    ('int("42") == 42 && string(42) == "42" && double("1.5") == 1.5', True),
    ('string(true) == "true" && bool("false") == false', True),
    ("[3, 1, 2].sum() == 6 && [3, 1, 2].min() == 1 && [3, 1, 2].max() == 3", True),
    ("[1, 2, 3].isSorted() && ![2, 1].isSorted()", True),
    ('["a", "b"].indexOf("b") == 1', True),
    ("sets.contains([1, 2, 3], [2, 3]) && sets.intersects([1], [1, 5])", True),
    ("sets.equivalent([1, 2], [2, 1, 1])", True),
    ("dyn(1) == 1", True),
    # Optional values: .? and [?] with orValue/hasValue.
    ('device.attributes["gpu.drasil.dev"].?profile.orValue("none") == "none"', True),
    ('device.attributes["gpu.drasil.dev"].?type.orValue("none") == "gpu"', True),
    ('device.attributes["gpu.drasil.dev"][?"profile"].hasValue()', False),
    (
        'device.attributes["gpu.drasil.dev"].?profile.value() == "x"',
        Err("optional.none() dereference"),
    ),
    ("optional.of(1).or(optional.none()).value() == 1", True),
    ("optional.none().orValue(7) == 7", True),
    ('device.attributes["gpu.drasil.dev"].type', Err("could not be converted to bool")),
    ("null == null && !(1 == null)", True),
    ('device.attributes["gpu.drasil.dev"].cudaComputeCapability == null', False),
    ("[1, 2][?5].hasValue()", False),
    ("{'a': {'b': 1}}.?a.b.orValue(0) == 1 && {'a': {}}.?a.b.orValue(0) == 0", True),
    ('.device.driver == "gpu.drasil.dev"', True),
    # Comments and strings containing ".?" are left alone.
    ('"a.?b" == "a.?b" // .? in a comment', True),
    ("r'\\d' == '\\\\d' && b'ab' == bytes('ab')", True),
]

COMPILE_ERRORS: list[tuple[str, Expected]] = [
    ("device.foo == 1", Compile("undefined field 'foo'")),
    ("has(device.foo)", Compile("undefined field 'foo'")),
    ("gpu == 1", Compile("undeclared reference to 'gpu'")),
    ('device.attributes["gpu.drasil.dev"].type ==', Compile("<input>:1:44: Syntax error")),
    ('device.attributes["gpu.drasil.dev"].type = "gpu"', Compile("Syntax error")),
    (
        'device.attributes["gpu.drasil.dev"].type.frobnicate()',
        Compile("undeclared reference to 'frobnicate'"),
    ),
    ("frobnicate(device)", Compile("undeclared reference to 'frobnicate'")),
    ('"a".split()', Compile("found no matching overload for 'split'")),
    ('quantity("1").sign() == 1', Compile("write sign(q)")),
    ("1 + 1", Compile("must evaluate to bool or the unknown type, not int")),
    ("has(device)", Compile("invalid argument to has() macro")),
    ("[1].all(1, true)", Compile("variable name must be a simple identifier")),
    ("Foo{a: 1}", Compile("message construction is not supported")),
    ('device.driver == "a" && $', Compile("<input>:1:25: Syntax error: unexpected character '$'")),
    ("[1].all(device, .device > 0)", Compile("shadowed by a macro variable")),
    ("99999999999999999999 > 0", Compile("integer literal out of range")),
]


def _rows(device: CelDevice, rows: list[tuple[str, Expected]], group: str) -> list[Any]:
    return [pytest.param(device, e, want, id=f"{group}: {e}") for e, want in rows]


ALL_ROWS = [
    *_rows(DOCS_DEVICE, UPSTREAM_DOCS, "api-docs"),
    *_rows(WEBSITE_DEVICE, WEBSITE_DOCS, "dra-docs"),
    *_rows(H100, DRASIL_ATTRIBUTES, "h100"),
    *_rows(MIG, MIG_ATTRIBUTES, "mig"),
    *_rows(H100, ERROR_ABSORPTION, "errors"),
    *_rows(H100, STRINGS, "strings"),
    *_rows(H100, QUANTITIES, "quantity"),
    *_rows(H100, SEMVERS, "semver"),
    *_rows(H100, LANGUAGE, "language"),
    *_rows(H100, COMPILE_ERRORS, "compile"),
]


@pytest.mark.parametrize(("device", "expression", "expected"), ALL_ROWS)
def test_selector(device: CelDevice, expression: str, expected: Expected) -> None:
    if isinstance(expected, Compile):
        with pytest.raises(CelCompileError) as caught:
            compile_selector(expression)
        assert expected.text in str(caught.value)
        return
    result = compile_selector(expression).evaluate(device)
    if isinstance(expected, Err):
        assert not result.matched
        assert result.error is not None, f"expected an error, got {result}"
        assert expected.text in result.error
    else:
        assert result == SelectorResult(matched=expected), result.error


def test_compile_errors_point_at_the_expression() -> None:
    with pytest.raises(CelCompileError) as caught:
        compile_selector('device.attributes["gpu.drasil.dev"].tpye.x == 1 && gpu')
    err = caught.value
    assert (err.line, err.column) == (1, 52)
    assert str(err) == (
        "compilation failed: ERROR: <input>:1:52: undeclared reference to 'gpu' (in container '')\n"
        ' | device.attributes["gpu.drasil.dev"].tpye.x == 1 && gpu\n'
        " | " + "." * 51 + "^"
    )


def test_compile_once_per_expression() -> None:
    expression = 'device.attributes["gpu.drasil.dev"].index >= 0'
    assert compile_selector(expression) is compile_selector(expression)
    with pytest.raises(CelCompileError) as first:
        compile_selector("nope")
    with pytest.raises(CelCompileError) as second:
        compile_selector("nope")
    assert first.value is second.value


def test_bad_version_attribute_fails_every_selector_like_upstream() -> None:
    device = CelDevice.from_json(
        {"name": "bad", "attributes": {"driverVersion": {"version": "580.95"}}},
        driver=DRIVER,
    )
    result = compile_selector("true").evaluate(device)
    assert result == SelectorResult(
        matched=False,
        error=(
            "attribute driverVersion: parse semantic version: No Major.Minor.Patch elements found"
        ),
    )


def test_qualified_names_and_own_domain() -> None:
    device = CelDevice.from_json(
        {
            "name": "d",
            "attributes": {"a": {"int": 1}, "other.example.com/a": {"bool": False}},
            "capacity": {"example.net/slots": {"value": "3"}},
            "allowMultipleAllocations": True,
        },
        driver="x.example.com",
    )
    selector = compile_selector(
        'device.attributes["x.example.com"].a == 1 && '
        'device.attributes["other.example.com"].a == false && '
        'device.capacity["example.net"].slots == quantity("3") && '
        "device.allowMultipleAllocations"
    )
    assert selector.evaluate(device).matched


def _slice(resource_version: str, product: str) -> Mapping[str, Any]:
    return {
        "metadata": {"name": "s", "uid": "uid-1", "resourceVersion": resource_version},
        "spec": {
            "driver": DRIVER,
            "devices": [{"name": "gpu-0", "attributes": {"productName": {"string": product}}}],
        },
    }


def test_device_cache_converts_once_per_resource_version() -> None:
    cache = CelDeviceCache()
    first = cache.devices(_slice("1", "NVIDIA L4"))
    assert cache.devices(_slice("1", "ignored: same version")) is first
    updated = cache.devices(_slice("2", "NVIDIA H200"))
    selector = compile_selector('device.attributes["gpu.drasil.dev"].productName == "NVIDIA H200"')
    assert [selector.evaluate(d).matched for d in (*first, *updated)] == [False, True]


def test_device_cache_drops_least_recently_used() -> None:
    cache = CelDeviceCache(max_slices=1)
    first = cache.devices(_slice("1", "a"))
    other = dict(_slice("1", "b"), metadata={"uid": "uid-2", "resourceVersion": "1"})
    cache.devices(other)
    assert cache.devices(_slice("1", "a")) is not first


def test_device_cache_can_be_cleared() -> None:
    cache = CelDeviceCache()
    first = cache.devices(_slice("1", "a"))
    assert len(cache) == 1

    cache.clear()

    assert len(cache) == 0
    assert cache.devices(_slice("1", "a")) is not first


def test_every_simulated_device_converts() -> None:
    gpu_class = compile_selector('device.attributes["gpu.drasil.dev"].type == "gpu"')
    mig_class = compile_selector('device.attributes["gpu.drasil.dev"].type == "mig"')
    for device in SIMULATED.values():
        assert device.error is None
        assert gpu_class.evaluate(device).matched != mig_class.evaluate(device).matched


def test_scheduler_error_wording() -> None:
    assert (
        scheduler_error(
            owner="class gpu.drasil.dev",
            index=0,
            device_id="gpu.drasil.dev/node-a/gpu-0",
            error="boom",
        )
        == "class gpu.drasil.dev: selector #0 on device gpu.drasil.dev/node-a/gpu-0: "
        "CEL runtime error: boom"
    )


# --- hostile selectors: nesting and cost --------------------------------------------

DEEP = 250  # what cel-go's parser accepts, so what the API server may store


def _deep(shape: str, n: int) -> str:
    return {
        "parens": "(" * n + "true" + ")" * n,
        "not": "!" * (n - n % 2) + "true",
        "negate": "-" * (n - n % 2) + "1 > 0",
        "add": " + ".join(["1"] * n) + " > 0",
        "and": " && ".join(["true"] * n),
        "or": " || ".join(["false"] * n) + " || true",
        "list": "[" * n + "1" + "]" * n + " != []",
        "method": "device.driver" + ".lowerAscii()" * n + " != ''",
        "index": "[" * n + "1" + "]" * n + "[0]" * n + " == 1",
        "call": "int(" * n + "1" + ")" * n + " == 1",
        "relation": "true == " * n + "true",
    }[shape]


SHAPES = ["parens", "not", "negate", "add", "and", "or", "list", "method", "index", "call"]


def _in_thread(work: Any) -> Any:
    # The controller explains in worker threads: their stack is what must suffice.
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(work()))
    thread.start()
    thread.join()
    return result[0]


@pytest.mark.parametrize("shape", [*SHAPES, "relation"])
def test_nesting_the_api_server_accepts_compiles_and_evaluates(shape: str) -> None:
    device = CelDevice.from_json({"name": "gpu-0"}, driver=DRIVER)
    expression = _deep(shape, DEEP)

    result = _in_thread(lambda: compile_selector(expression).evaluate(device))

    assert result == SelectorResult(matched=True)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s not in ("parens", "and", "or")])
def test_deeper_nesting_is_a_compile_error_naming_the_limit(shape: str) -> None:
    expression = _deep(shape, 5_000)  # ~10 KiB, the API server's size limit

    def compile_it() -> str:
        try:
            compile_selector(expression)
        except CelCompileError as err:
            return err.detail
        return "compiled"

    assert _in_thread(compile_it) == f"expression nests deeper than {MAX_NESTING} levels"


def test_importing_the_compiler_leaves_the_recursion_limit_alone() -> None:
    # Raising it is each process's own choice where it starts (allow_nesting), not a
    # side effect of an import.
    check = (
        "import sys; before = sys.getrecursionlimit(); "
        "import drasil.driver.cel.selectors; print(sys.getrecursionlimit() == before)"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], check=False, capture_output=True, text=True
    )
    assert done.stdout.strip() == "True", done.stderr


def _nested_exists(levels: int) -> str:
    attributes = f'device.attributes["{DRIVER}"]'
    body = "v0 == 'none'"
    for level in range(levels):
        body = f"{attributes}.exists(v{level}, {body})"
    return body


def _wide_device() -> CelDevice:
    attributes = {f"a{i}": {"int": i} for i in range(32)}
    return CelDevice.from_json({"name": "gpu-0", "attributes": attributes}, driver=DRIVER)


def test_cost_past_the_runtime_limit_fails_like_the_scheduler() -> None:
    # 32^4 iterations: over the API server's per-evaluation cost limit of 1,000,000.
    result = compile_selector(_nested_exists(4)).evaluate(_wide_device())

    assert result == SelectorResult(
        matched=False, error="operation cancelled: actual cost limit exceeded"
    )


def test_cost_within_the_limit_evaluates() -> None:
    assert compile_selector(_nested_exists(2)).evaluate(_wide_device()) == SelectorResult(False)


def test_a_deadline_stops_a_costly_evaluation() -> None:
    with pytest.raises(CelDeadlineExceeded):
        compile_selector(_nested_exists(3)).evaluate(_wide_device(), deadline=0.0)

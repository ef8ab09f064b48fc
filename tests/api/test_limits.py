"""The input limits (drasil.api.limits): hostile configs and quantities are refused
quickly, with a ConfigError/QuantityError that names the path and the limit.

One regression test per defect of issue 14 (items 1, 2, 3 and 9), at the API layer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from typing import Any

import pytest

from drasil.api.config import API_VERSION, GpuConfig, decode_config
from drasil.api.documents import ConfigError, load_documents, load_json
from drasil.api.limits import (
    MAX_BYTES,
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_INTEGER_DIGITS,
    MAX_PARAMETERS_BYTES,
    MAX_QUANTITY_CHARS,
    MAX_VALUES,
    QUANTITY_EXPONENTS,
)
from drasil.api.quantity import QuantityError, QuantityRangeError, parse_quantity

PINNED = "sharing.mps.defaultPinnedDeviceMemoryLimit"


@contextmanager
def quick(seconds: float = 1.0) -> Iterator[None]:
    """The block must finish within ``seconds`` (the defects took 30 s and more)."""
    start = time.monotonic()
    yield
    elapsed = time.monotonic() - start
    assert elapsed < seconds, f"took {elapsed:.2f}s"


def gpu(sharing: Any = None) -> dict[str, Any]:
    config: dict[str, Any] = {"apiVersion": API_VERSION, "kind": "GpuConfig"}
    if sharing is not None:
        config["sharing"] = sharing
    return config


def pinned(limit: object) -> dict[str, Any]:
    return gpu({"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": limit}})


def nested(depth: int) -> Any:
    """``depth`` lists inside one another, built without recursion."""
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def decode_error(raw: Any) -> ConfigError:
    with quick(), pytest.raises(ConfigError) as caught:
        decode_config(raw)
    return caught.value


# --- item 1: deep nesting ----------------------------------------------------------


@pytest.mark.parametrize("form", ["mapping", "json", "yaml-flow", "yaml-block"])
def test_deep_nesting_is_refused_not_a_recursion_error(form: str) -> None:
    # About 3,000 levels in about 6 KB: once a RecursionError in the controller's watch.
    depth = 3000
    if form == "mapping":
        raw: Any = gpu(nested(depth))
    elif form == "json":
        raw = json.dumps(gpu("PLACEHOLDER")).replace('"PLACEHOLDER"', "[" * depth + "]" * depth)
    elif form == "yaml-flow":
        raw = f"apiVersion: {API_VERSION}\nkind: GpuConfig\nsharing: " + "[" * depth
    else:
        raw = "".join(f"{' ' * level}- \n" for level in range(0, 2 * 90, 2))
    assert not isinstance(raw, str) or len(raw) <= MAX_PARAMETERS_BYTES
    error = decode_error(raw)
    assert "nested too deeply" in str(error)
    assert f"at most {MAX_DEPTH} levels" in str(error)
    assert error.issues[0].value == MAX_DEPTH


@pytest.mark.parametrize("encode", [None, json.dumps], ids=["mapping", "json"])
def test_depth_limit_is_exact(encode: Any) -> None:
    # The config object is level 1; sharing level 2; MAX_DEPTH levels pass, one more fails.
    def config(depth: int) -> Any:
        document = gpu(nested(depth - 1))
        return encode(document) if encode else document

    with pytest.raises(ConfigError) as within_limit:
        decode_config(config(MAX_DEPTH))
    assert "nested too deeply" not in str(within_limit.value)  # sharing must be an object
    error = decode_error(config(MAX_DEPTH + 1))
    assert "nested too deeply" in str(error)


DEPTH_FORMS = {
    "json-arrays": lambda depth: "[" * depth + "]" * depth,
    "json-objects": lambda depth: '{"a": ' * (depth - 1) + "{}" + "}" * (depth - 1),
    "yaml-flow": lambda depth: "a: " + "[" * (depth - 1) + "]" * (depth - 1),
    "yaml-block": lambda depth: "".join(f"{'  ' * level}a:\n" for level in range(depth)),
}


@pytest.mark.parametrize("form", DEPTH_FORMS)
def test_depth_limit_of_text_is_exact(form: str) -> None:
    text = DEPTH_FORMS[form]
    loads = [load_documents, load_json] if form.startswith("json") else [load_documents]
    for load in loads:
        load(text(MAX_DEPTH))
        with pytest.raises(ConfigError, match="nested too deeply"):
            load(text(MAX_DEPTH + 1))


def test_deep_mapping_error_names_the_path() -> None:
    error = decode_error(gpu({"strategy": "MPS", "mps": {"x": nested(MAX_DEPTH)}}))
    (issue,) = error.issues
    assert issue.path.startswith("sharing.mps.x[0][0]")
    assert (
        str(issue)
        == f"{issue.path}: nested too deeply: at most {MAX_DEPTH} levels of objects and lists"
    )


def test_yaml_depth_error_names_line_and_column() -> None:
    with pytest.raises(ConfigError) as caught:
        load_documents("a:\n  b: " + "[" * 40)
    # The scanner stops at the first "[" past the limit: column 6 opens the first.
    assert str(caught.value) == (
        f"nested too deeply (line 2, column {6 + MAX_DEPTH}): "
        f"at most {MAX_DEPTH} levels of objects and lists"
    )
    with pytest.raises(ConfigError) as caught:
        load_documents("a:\n  b: " + "{a: " * 40)
    # The composer counts the block mappings a and b too: the 31st "{" is level 33.
    assert "(line 2, column 126)" in str(caught.value)


def test_json_depth_check_ignores_brackets_in_strings() -> None:
    text = json.dumps({**gpu(), "note": "[" * 100})
    error = decode_error(text)
    assert [issue.path for issue in error.issues] == ["note"]  # an unknown field, not depth


def test_a_config_that_contains_itself_is_refused() -> None:
    cycle: dict[str, Any] = {"strategy": "MPS"}
    cycle["mps"] = cycle
    assert "nested too deeply" in str(decode_error(gpu(cycle)))


# --- item 2: quantities ------------------------------------------------------------


@pytest.mark.parametrize("limit", ["1e999999", "1e5000", "1E+99", "9.3e18", "9223372036854775808"])
def test_huge_memory_limit_is_out_of_range_at_once(limit: str) -> None:
    # "1e999999" took ~30 s (a million-digit int); "1e5000" passed and failed later.
    error = decode_error(pinned(limit))
    (issue,) = error.issues
    assert str(issue) == (
        f'{PINNED}: "{limit}" is out of range: at most {MAX_BYTES} bytes (8Ei - 1)'
    )
    assert (issue.path, issue.value) == (PINNED, limit)
    assert f"<={MAX_BYTES}" in issue.allowed


@pytest.mark.parametrize("limit", [MAX_BYTES + 1, 10**19])
def test_huge_integer_memory_limit_is_out_of_range(limit: int) -> None:
    (issue,) = decode_error(pinned(limit)).issues
    assert str(issue) == f"{PINNED}: {limit} is out of range: at most {MAX_BYTES} bytes (8Ei - 1)"


@pytest.mark.parametrize("limit", [MAX_BYTES, str(MAX_BYTES), "8Ei", "7Ei", "8191Pi"])
def test_memory_limit_up_to_the_int64_bound(limit: object) -> None:
    if limit == "8Ei":  # 2**63: one byte too many
        assert "out of range" in str(decode_error(pinned(limit)))
        return
    config = decode_config(pinned(limit))
    assert config.sharing.mps is not None
    assert config.sharing.mps.default_pinned_device_memory_limit == parse_quantity(str(limit))


def test_memory_limit_longer_than_a_quantity_may_be() -> None:
    limit = "1" + "0" * MAX_QUANTITY_CHARS
    (issue,) = decode_error(pinned(limit)).issues
    assert issue.path == PINNED
    assert f"at most {MAX_QUANTITY_CHARS} characters" in str(issue)


def test_tiny_memory_limit_is_below_the_minimum() -> None:
    (issue,) = decode_error(pinned("1e-999999")).issues
    assert "at least 1Mi" in str(issue)


@pytest.mark.parametrize(
    "text", ["1e999999", "1e-999999", "-1e999999", "1e64", "1e-65", "0.1e65", "1" * 60 + "Ei"]
)
def test_quantity_out_of_range_is_refused_from_the_text(text: str) -> None:
    with quick(0.1), pytest.raises(QuantityRangeError) as caught:
        parse_quantity(text)
    first, stop = QUANTITY_EXPONENTS.start, QUANTITY_EXPONENTS.stop
    assert caught.value.too_large == (f"1e{stop}" in str(caught.value))
    assert f"1e{stop}" in str(caught.value) or f"1e{first}" in str(caught.value)
    assert str(caught.value).startswith(f"{text!r} is out of range")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1e63", Decimal(10) ** 63),
        ("9.99e63", Decimal("9.99e63")),
        ("1e-64", Decimal("1e-64")),
        ("0e999999", Decimal(0)),
        ("0.000Ei", Decimal(0)),
        (
            "9999999999999999999999999999999999999G",
            Decimal("9999999999999999999999999999999999999e9"),
        ),
        # 32 digits: the default Decimal context (28 digits) would round it.
        ("12345678901234567890123456789.5Ki", Decimal("12641975194864197519486419752448")),
    ],
)
def test_quantities_within_range_are_exact(text: str, value: Decimal) -> None:
    assert parse_quantity(text) == value


def test_quantity_text_length_is_bounded() -> None:
    assert parse_quantity("0" * (MAX_QUANTITY_CHARS - 1) + "1") == 1
    with quick(0.1), pytest.raises(QuantityError, match=f"at most {MAX_QUANTITY_CHARS} characters"):
        parse_quantity("0" * MAX_QUANTITY_CHARS + "1")
    with pytest.raises(QuantityError, match=f"at most {MAX_QUANTITY_CHARS}"):
        parse_quantity("1" * 100_000)


@pytest.mark.parametrize("value", [None, 5, 1.5, b"1Gi", ["1Gi"]])
def test_quantity_of_something_else_is_a_quantity_error(value: Any) -> None:
    with pytest.raises(QuantityError, match="is not a quantity"):
        parse_quantity(value)


# --- item 3: bad input escapes only as ConfigError -----------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        gpu() | {"kind": ["GpuConfig"]},
        gpu() | {"kind": {}},
        "kind: [GpuConfig]",
        "kind: {}",
        '{"kind": {"a": 1}}',
    ],
    ids=["list", "object", "yaml-list", "yaml-object", "json-object"],
)
def test_kind_of_the_wrong_type_is_an_unsupported_kind(raw: Any) -> None:
    error = decode_error(raw)
    kind = next(issue for issue in error.issues if issue.path == "kind")
    assert kind.allowed == ("GpuConfig", "MigDeviceConfig", "VfioDeviceConfig")
    assert "unsupported value" in kind.message


@pytest.mark.parametrize(
    "raw",
    [
        '{"kind": %s}' % ("9" * 5000),
        "kind: " + "9" * 5000,
        "kind: -" + "9" * 5000,
        gpu() | {"kind": 10**5000},
        pinned(-(10**5000)),
    ],
    ids=["json", "yaml", "yaml-negative", "mapping", "mapping-negative"],
)
def test_long_integers_are_refused_before_conversion(raw: Any) -> None:
    error = decode_error(raw)
    assert f"at most {MAX_INTEGER_DIGITS} digits" in str(error)


def test_integer_digits_limit_is_exact() -> None:
    longest = "9" * MAX_INTEGER_DIGITS
    assert load_json(f"[{longest}, -{longest}]") == [int(longest), -int(longest)]
    assert load_documents(f"[{longest}, -{longest}]") == [[int(longest), -int(longest)]]
    for text in (f"[{longest}9]", f"[-{longest}9]"):
        for load in (load_json, load_documents):
            with pytest.raises(ConfigError, match="too long"):
                load(text)


def test_long_integer_in_a_mapping_names_its_path() -> None:
    (issue,) = decode_error(gpu({"strategy": "MPS", "mps": {"x": [10**100]}})).issues
    assert (
        str(issue) == f"sharing.mps.x[0]: integer is too long: at most {MAX_INTEGER_DIGITS} digits"
    )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"\xff\xfe", "config is not UTF-8: invalid start byte at byte 0"),
        (b"kind: \xc3\x28", "config is not UTF-8: invalid continuation byte at byte 6"),
        ("kind: \ud800", "text is not valid Unicode: surrogates not allowed at character 6"),
    ],
)
def test_text_that_is_not_unicode(raw: Any, expected: str) -> None:
    assert str(decode_error(raw)) == expected
    with pytest.raises(ConfigError, match=expected):
        load_documents(raw)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({1: "x"}, "invalid key of type int: a key must be a string"),
        (gpu({"strategy": {None: 1}}), "sharing.strategy: invalid key of type NoneType"),
        (gpu({"strategy": b"MPS"}), "sharing.strategy: invalid value of type bytes"),
        (gpu({"strategy": {"MPS"}}), "sharing.strategy: invalid value of type set"),
        (gpu({"strategy": Decimal(1)}), "sharing.strategy: invalid value of type Decimal"),
        (None, "a config must be an object with apiVersion and kind"),
        ([{1: 2}], "[0]: invalid key of type int"),
    ],
)
def test_mappings_hold_json_values_only(raw: Any, expected: str) -> None:
    assert str(decode_error(raw)).startswith(expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a: 2024-13-45", None),  # a date PyYAML could not build: a string, as in kubectl
        ("a: !!float abc", "invalid YAML: invalid number 'abc' (line 1, column 4)"),
        ("a: !!int abc", "invalid YAML: invalid integer 'abc' (line 1, column 4)"),
        ("a: !!bool abc", "invalid YAML: invalid boolean 'abc' (line 1, column 4)"),
        ("a: !!map abc", "invalid YAML: expected a mapping (line 1, column 4)"),
        ("a: !!timestamp x", None),
        ("a: !!python/object:os.system x", "invalid YAML: could not determine a constructor"),
        ("a: b\x00", "invalid YAML: unacceptable character #x0000"),
    ],
)
def test_yaml_that_pyyaml_mishandles_is_a_config_error(text: str, expected: str | None) -> None:
    if expected is None:
        (document,) = load_documents(text)
        assert isinstance(document["a"], str)
        return
    with pytest.raises(ConfigError) as caught:
        load_documents(text)
    assert str(caught.value).startswith(expected)


@pytest.mark.parametrize("value", [None, 5, ["kind: GpuConfig"], {"kind": "GpuConfig"}])
def test_load_documents_of_something_that_is_not_text(value: Any) -> None:
    with pytest.raises(ConfigError, match="expected text"):
        load_documents(value)


# --- item 9: YAML alias bombs ------------------------------------------------------

BILLION_LAUGHS = "\n".join(
    [f"apiVersion: {API_VERSION}", "kind: GpuConfig", "sharing:", '  a0: &a0 ["lol", "lol"]']
    + [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
)


@pytest.mark.parametrize("as_bytes", [False, True])
def test_alias_bomb_text_is_refused_before_it_is_built(as_bytes: bool) -> None:
    # Once 45 s and 3.9 GB: pydantic expanded 2 * 9**9 "lol"s.
    raw = BILLION_LAUGHS.encode() if as_bytes else BILLION_LAUGHS
    assert len(raw) < MAX_PARAMETERS_BYTES
    assert str(decode_error(raw)) == (
        "YAML anchors and aliases (&name, *name) are not allowed (line 4, column 7): "
        "write each value out"
    )


@pytest.mark.parametrize("text", ["a: &x 1\nb: 2\n", "a: 1\nb: *x\n", "a: &x [1]\nb:\n  <<: *x\n"])
def test_any_anchor_or_alias_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="anchors and aliases"):
        load_documents(text)


def test_shared_references_count_each_time() -> None:
    shared: Any = ["lol"] * 10
    for _ in range(20):
        shared = [shared] * 10  # 10**21 values if expanded, 24 levels deep
    error = decode_error(gpu({"strategy": "MPS", "mps": {"x": shared}}))
    assert str(error).startswith(f"config is too large: more than {MAX_VALUES} values")


def test_values_limit_is_exact() -> None:
    # The config object, its 3 keys, sharing's key: 5 values before the list's items.
    def config(items: int) -> dict[str, Any]:
        return gpu({"x": [0] * items})

    with pytest.raises(ConfigError) as within_limit:
        decode_config(config(MAX_VALUES - 5))
    assert "too large" not in str(within_limit.value)
    assert "too large" in str(decode_error(config(MAX_VALUES - 4)))


# --- sizes -------------------------------------------------------------------------


def test_file_size_limit() -> None:
    text = "#" * MAX_FILE_BYTES
    assert load_documents(text) == []
    with quick(), pytest.raises(ConfigError, match=r"too large .*at most 1048576 bytes \(1 MiB\)"):
        load_documents(text + "#")


def test_valid_configs_decode_as_before() -> None:
    config = decode_config(pinned("4Gi"))
    assert isinstance(config, GpuConfig)
    assert config.sharing.mps is not None
    assert config.sharing.mps.default_pinned_device_memory_limit == 4 * 2**30
    assert decode_config(json.dumps(pinned(2**20))) == decode_config(pinned("1Mi"))

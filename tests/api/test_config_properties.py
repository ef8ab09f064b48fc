"""Properties of the config and quantity API for ANY input (hypothesis).

Whatever they are given (JSON-like values of any shape and depth, text, bytes, YAML
made of its special characters, quantities with huge exponents), ``decode_config``,
``load_documents``, ``load_json`` and ``parse_quantity`` return a result or raise
their typed error (ConfigError / QuantityError), each example within the deadline.
Runs are reproducible (a fixed seed, no example database) and bounded in size.
"""

from __future__ import annotations

import contextlib
import json
from datetime import timedelta
from decimal import Decimal
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drasil.api.config import API_VERSION, GpuConfig, MigDeviceConfig, OpaqueConfig, decode_config
from drasil.api.documents import ConfigError, load_documents, load_json
from drasil.api.limits import MAX_BYTES, QUANTITY_EXPONENTS
from drasil.api.quantity import QuantityError, format_bytes, parse_quantity

BOUNDED = settings(
    max_examples=200,
    deadline=timedelta(milliseconds=500),
    derandomize=True,  # the same examples on every run: `make test` is deterministic
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# --- strategies --------------------------------------------------------------------

WORDS = [
    API_VERSION,
    "GpuConfig",
    "MigDeviceConfig",
    "Exclusive",
    "TimeSlicing",
    "MPS",
    "Default",
    "Long",
    "0",
    "GPU-1234-abcd",
    "MIG-ab12",
]
FIELDS = [
    "apiVersion",
    "kind",
    "sharing",
    "strategy",
    "mps",
    "timeSlicing",
    "interval",
    "defaultActiveThreadPercentage",
    "defaultPinnedDeviceMemoryLimit",
    "defaultPerDevicePinnedMemoryLimit",
]
SUFFIXES = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "k", "M", "G", "T", "P", "E"]

integers = st.one_of(
    st.integers(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.sampled_from([2**20, MAX_BYTES, MAX_BYTES + 1, 10**19, -(2**63)]),
    st.sampled_from([4300, 5000]).map(lambda digits: 10**digits),  # past Python's int limit
)
mantissas = st.from_regex(r"[+-]?([0-9]{1,30}(\.[0-9]{0,30})?|\.[0-9]{1,30})", fullmatch=True)
exponent_quantities = st.builds(
    lambda mantissa, e, exponent: f"{mantissa}{e}{exponent}",
    mantissas,
    st.sampled_from(["e", "E", "e+", "e-", "E-"]),
    st.integers(min_value=0, max_value=10**7),
)
quantity_texts = st.one_of(
    st.builds(lambda m, suffix: m + suffix, mantissas, st.sampled_from(SUFFIXES)),
    exponent_quantities,
    st.sampled_from(["1e999999", "1e5000", "8Ei", "7Ei", "1Mi", "1Ki", "0e99999", "1e-999999"]),
    st.text(max_size=80),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    integers,
    st.floats(),
    st.text(max_size=20),
    st.sampled_from(WORDS),
    quantity_texts,
)
keys = st.one_of(st.sampled_from(FIELDS + WORDS), st.text(max_size=12))


def json_like(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=6), st.dictionaries(keys, children, max_size=6)
        ),
        max_leaves=40,
    )


json_values = json_like(scalars)
# Values every JSON and YAML writer can write: no int past Python's conversion limit.
plain_values = json_like(scalars.filter(lambda v: not isinstance(v, int) or abs(v) < 10**4000))


def nest(value: Any, depth: int, *, in_lists: bool) -> Any:
    for _ in range(depth):
        value = [value] if in_lists else {"a": value}
    return value


deep_values = st.builds(nest, json_values, st.integers(0, 3000), in_lists=st.booleans())


def config_like(
    values: st.SearchStrategy[Any], ints: st.SearchStrategy[int] = integers
) -> st.SearchStrategy[dict[str, Any]]:
    """Dictionaries shaped like configs, with ``values`` wherever a wrong one may be."""
    memory_limits = st.one_of(quantity_texts, ints, values)
    mps_blocks = st.fixed_dictionaries(
        {},
        optional={
            "defaultActiveThreadPercentage": st.one_of(st.integers(-5, 105), values),
            "defaultPinnedDeviceMemoryLimit": memory_limits,
            "defaultPerDevicePinnedMemoryLimit": st.one_of(
                st.dictionaries(st.sampled_from(["0", "7", "GPU-1", "MIG-2", "x"]), memory_limits),
                values,
            ),
        },
    )
    sharing_blocks = st.fixed_dictionaries(
        {},
        optional={
            "strategy": st.one_of(st.sampled_from(["Exclusive", "TimeSlicing", "MPS"]), values),
            "mps": st.one_of(mps_blocks, values),
            "timeSlicing": st.one_of(
                st.fixed_dictionaries({}, optional={"interval": st.sampled_from(WORDS)}), values
            ),
        },
    )
    return st.fixed_dictionaries(
        {
            "apiVersion": st.one_of(st.just(API_VERSION), values),
            "kind": st.one_of(st.sampled_from(["GpuConfig", "MigDeviceConfig"]), values),
        },
        optional={"sharing": st.one_of(sharing_blocks, values), "extra": values},
    )


memory_limits = st.one_of(quantity_texts, integers, json_values)
configs = config_like(st.one_of(json_values, deep_values))
# Writable by every JSON and YAML writer: no int past Python's conversion limit.
plain_configs = config_like(plain_values, st.integers(-(10**40), 10**40))
documents = st.one_of(configs, json_values, deep_values)

# Text made of YAML's special characters and constructs: anchors, aliases, tags, merge
# keys, flow and block collections, directives, documents.
YAML_PIECES = [
    *"[]{}:,-?&*!|>'\"#%@` \n\t",
    "a",
    "0",
    "1e999",
    "9" * 30,
    ".inf",
    "2024-13-45",
    "&a ",
    "*a ",
    "<<: ",
    "!!int ",
    "!!float ",
    "!!bool ",
    "!!map ",
    "!!seq ",
    "!!str ",
    "!!binary ",
    "!!timestamp ",
    "!!set ",
    "!!omap ",
    "!!python/object:os.system ",
    "!local ",
    "%YAML 1.1\n",
    "---\n",
    "...\n",
    "kind: ",
    "apiVersion: ",
    "sharing:\n  ",
    "\\x",
    "\ufeff",
]
yaml_soup = st.lists(st.sampled_from(YAML_PIECES), max_size=60).map("".join)
texts = st.one_of(
    st.text(max_size=200),
    yaml_soup,
    plain_values.map(json.dumps),
    plain_configs.map(lambda config: json.dumps(config, ensure_ascii=False)),
    plain_configs.map(lambda config: yaml.safe_dump(config, allow_unicode=True)),
    st.integers(0, 3000).map(lambda depth: "a: " + "[" * depth + "]" * depth),
    st.integers(0, 3000).map(lambda depth: '{"a": ' + "[" * depth + "]" * depth + "}"),
)
raw_inputs = st.one_of(
    texts, texts.map(lambda text: text.encode(errors="surrogatepass")), st.binary()
)


def outcome(raw: Any) -> OpaqueConfig | ConfigError:
    """``decode_config(raw)``'s config, or its ConfigError; anything else fails the test."""
    try:
        return_value: OpaqueConfig | ConfigError = decode_config(raw)
    except ConfigError as err:
        return_value = err
    if isinstance(return_value, ConfigError):
        assert return_value.issues, "a ConfigError names at least one issue"
        assert all(str(issue) for issue in return_value.issues)
    else:
        assert isinstance(return_value, GpuConfig | MigDeviceConfig)
    return return_value


# --- decode_config -------------------------------------------------------------------


@BOUNDED
@given(documents)
def test_decode_config_of_any_value_gives_a_config_or_config_error(document: Any) -> None:
    result = outcome(document)
    if not isinstance(result, ConfigError):  # valid configs survive their own JSON
        assert decode_config(result.model_dump_json(exclude_none=True)) == result


@BOUNDED
@given(plain_configs)
def test_a_config_decodes_alike_as_mapping_json_and_yaml(config: dict[str, Any]) -> None:
    from_mapping = outcome(config)
    texts = [json.dumps(config, ensure_ascii=False, separators=(",", ":"))]
    texts.append(yaml.safe_dump(config, allow_unicode=True))
    for text in texts:
        from_text = outcome(text)
        if isinstance(from_mapping, ConfigError):
            continue  # texts may fail differently (a size counted otherwise, surrogates)
        assert from_text == from_mapping, text


@BOUNDED
@given(raw_inputs)
def test_decode_config_of_any_text_or_bytes_gives_a_config_or_config_error(raw: Any) -> None:
    outcome(raw)


@BOUNDED
@given(raw_inputs)
def test_load_documents_of_any_text_gives_documents_or_config_error(raw: Any) -> None:
    try:
        documents: list[Any] | ConfigError = load_documents(raw)
    except ConfigError as err:
        documents = err
    if isinstance(documents, ConfigError):
        assert documents.issues
    else:
        assert None not in documents


@BOUNDED
@given(st.one_of(texts, st.text()))
def test_load_json_of_any_text_gives_a_value_or_config_error(text: str) -> None:
    with contextlib.suppress(ConfigError):
        load_json(text)


# --- quantities ----------------------------------------------------------------------


def check_quantity(text: Any) -> Decimal | None:
    try:
        value = parse_quantity(text)
    except QuantityError:
        return None
    assert isinstance(value, Decimal)
    assert value.is_finite()
    if value:
        assert value.adjusted() in QUANTITY_EXPONENTS
    return value


@BOUNDED
@given(st.one_of(quantity_texts, st.text(), st.text(alphabet="0123456789.eE+-KMGTPEimnuk")))
def test_parse_quantity_of_any_text_gives_a_bounded_value_or_quantity_error(text: str) -> None:
    check_quantity(text)


@BOUNDED
@given(exponent_quantities)
def test_huge_exponents_are_refused_or_computed_at_once(text: str) -> None:
    check_quantity(text)


@BOUNDED
@given(scalars)
def test_parse_quantity_of_anything_else_is_a_quantity_error(value: Any) -> None:
    check_quantity(value)


@BOUNDED
@given(st.integers(min_value=0, max_value=MAX_BYTES))
def test_byte_counts_round_trip_through_their_quantity(count: int) -> None:
    assert parse_quantity(format_bytes(count)) == count


@BOUNDED
@given(memory_limits)
def test_memory_limits_are_bytes_within_bounds_or_config_error(limit: Any) -> None:
    config = {"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": limit}}
    result = outcome({"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": config})
    if isinstance(result, ConfigError):
        return
    assert result.sharing.mps is not None
    value = result.sharing.mps.default_pinned_device_memory_limit
    assert value is None if limit is None else 2**20 <= value <= MAX_BYTES

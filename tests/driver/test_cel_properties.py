"""Properties of the CEL environment for ANY selector text (hypothesis).

A user's selector reaches the controller's explanations and ``drasil explain``: whatever
it is (arbitrary text, or expressions built from the grammar's pieces, nested and
combined), ``compile_selector`` returns a selector or raises ``CelCompileError``, and
``evaluate`` returns a ``SelectorResult`` (matched, or why not) and never raises, each
example within the deadline. Reproducible: a fixed seed, no example database.
"""

from __future__ import annotations

from datetime import timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drasil.driver.cel.selectors import CelCompileError, CelDevice, SelectorResult, compile_selector

DRIVER = "gpu.drasil.dev"
BOUNDED = settings(
    max_examples=300,
    deadline=timedelta(milliseconds=1000),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
DEVICE = CelDevice.from_json(
    {
        "name": "gpu-0",
        "attributes": {
            "productName": {"string": "NVIDIA H100"},
            "index": {"int": 0},
            "mig": {"bool": False},
            "driverVersion": {"version": "550.54.15"},
        },
        "capacity": {"memory": {"value": "80Gi"}},
    },
    driver=DRIVER,
)

ATTRIBUTES = f'device.attributes["{DRIVER}"]'
ATOMS = st.sampled_from(
    [
        "true",
        "false",
        "null",
        "0",
        "-1",
        "1u",
        "2.5",
        "9223372036854775807",
        '"a"',
        "b'x'",
        "[]",
        "{}",
        "[1, 2, 3]",
        '{"k": 1}',
        "device.driver",
        f"{ATTRIBUTES}.productName",
        f"{ATTRIBUTES}.index",
        f"{ATTRIBUTES}.missing",
        f"{ATTRIBUTES}.driverVersion",
        f'device.capacity["{DRIVER}"].memory',
        'quantity("40Gi")',
        'semver("1.2.3")',
        "optional.none()",
        "x",
    ]
)
UNARY = ["!{}", "-{}", "({})", "size({})", "int({})", "string({})", "has({}.a)", "{}.size()"]
BINARY = [
    "{} && {}",
    "{} || {}",
    "{} == {}",
    "{} != {}",
    "{} < {}",
    "{} + {}",
    "{} - {}",
    "{} * {}",
    "{} / {}",
    "{} % {}",
    "{} in {}",
    "[{}, {}]",
    "{}[{}]",
    "{} ? {} : false",
    "{}.contains({})",
    "{}.compareTo({})",
    "{}.isGreaterThan({})",
    "{}.matches({})",
]
COMPREHENSIONS = [
    "[1, 2].all(x, {})",
    "[1, 2].exists(x, {})",
    f"{ATTRIBUTES}.exists(x, {{}})",
    "[1, 2].map(x, {})",
    "[1, 2].filter(x, {})",
    "cel.bind(x, 1, {})",
]


def _combine(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    unary = st.tuples(st.sampled_from(UNARY + COMPREHENSIONS), children).map(
        lambda t: t[0].format(t[1])
    )
    binary = st.tuples(st.sampled_from(BINARY), children, children).map(
        lambda t: t[0].format(t[1], t[2])
    )
    return unary | binary


EXPRESSIONS = st.recursive(ATOMS, _combine, max_leaves=40)


def _check(text: str) -> None:
    try:
        selector = compile_selector(text)
    except CelCompileError:
        return
    result = selector.evaluate(DEVICE)
    assert isinstance(result, SelectorResult)
    assert result.matched or result.error is None or isinstance(result.error, str)


@BOUNDED
@given(EXPRESSIONS)
def test_any_expression_compiles_or_fails_to_compile_and_evaluates_without_raising(
    text: str,
) -> None:
    _check(text)


@BOUNDED
@given(st.text(max_size=300))
def test_any_text_compiles_or_fails_to_compile(text: str) -> None:
    _check(text)


@BOUNDED
@given(st.integers(min_value=1, max_value=600), st.sampled_from(["(", "[", "!", "-", "size("]))
def test_any_nesting_depth_is_a_result_or_a_compile_error(depth: int, opener: str) -> None:
    closer = {"(": ")", "[": "]", "!": "", "-": "", "size(": ")"}[opener]
    _check(opener * depth + "1" + closer * depth)

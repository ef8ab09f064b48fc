"""Opaque configs of claims and templates, checked with the strict config API (controller)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from drasil.driver.claims.configcheck import config_problems

DRIVER = "gpu.drasil.dev"
API = "resource.drasil.dev/v1beta1"
ALLOWED = 'allowed values are "Exclusive", "TimeSlicing", "MPS"'


def entry(parameters: Any, driver: str = DRIVER) -> dict[str, Any]:
    return {"requests": ["gpu"], "opaque": {"driver": driver, "parameters": parameters}}


def claim(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "ResourceClaim", "spec": {"devices": {"requests": [], "config": list(entries)}}}


def template(*entries: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": "ResourceClaimTemplate",
        "spec": {"spec": {"devices": {"config": list(entries)}}},
    }


def gpu_config(**sharing: Any) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "GpuConfig", "sharing": sharing}


def test_bad_strategy_names_path_value_and_allowed_values() -> None:
    problems = config_problems(claim(entry(gpu_config(strategy="Foo"))), driver=DRIVER)

    assert problems == [
        "spec.devices.config[0].opaque.parameters.sharing.strategy: "
        f'unsupported value "Foo": {ALLOWED}'
    ]


def test_templates_use_their_own_path() -> None:
    problems = config_problems(
        template(entry({}), entry(gpu_config(strategy="Foo"))), driver=DRIVER
    )

    assert problems[0].startswith("spec.spec.devices.config[0].opaque.parameters.apiVersion:")
    assert problems[-1].startswith(
        "spec.spec.devices.config[1].opaque.parameters.sharing.strategy:"
    )


def test_every_problem_is_reported() -> None:
    parameters = {**gpu_config(strategy="MPS", timeSlicing={}), "extra": 1}

    problems = config_problems(claim(entry(parameters)), driver=DRIVER)

    assert len(problems) == 2
    assert any(
        p.endswith(
            'parameters.extra: unknown field; allowed fields are "apiVersion", "kind", "sharing"'
        )
        for p in problems
    )
    assert any("sharing.timeSlicing: not allowed with strategy" in p for p in problems)


def test_parameters_that_are_not_an_object() -> None:
    assert config_problems(claim(entry("strategy: MPS")), driver=DRIVER) == [
        "spec.devices.config[0].opaque.parameters: "
        "must be an object (a GpuConfig or MigDeviceConfig)"
    ]


def test_valid_configs_other_drivers_and_other_kinds_have_no_problems() -> None:
    assert config_problems(claim(entry(gpu_config(strategy="TimeSlicing"))), driver=DRIVER) == []
    assert (
        config_problems(claim(entry({"anything": 1}, driver="other.example.com")), driver=DRIVER)
        == []
    )
    assert config_problems(claim(), driver=DRIVER) == []
    assert config_problems({"kind": "Pod", "spec": {}}, driver=DRIVER) == []
    assert config_problems({"kind": "ResourceClaim"}, driver=DRIVER) == []


# --- hostile parameters (issue 14): problems, never an exception ---------------------


def deep(depth: int) -> Any:
    value: Any = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def shared_bomb() -> Any:
    # What a YAML alias bomb becomes once parsed: 10 ** 21 values if expanded.
    value: Any = ["lol"] * 10
    for _ in range(20):
        value = [value] * 10
    return value


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        (deep(3000), "nested too deeply: at most 32 levels of objects and lists"),
        (
            gpu_config(strategy="MPS", mps={"defaultPinnedDeviceMemoryLimit": "1e999999"}),
            'sharing.mps.defaultPinnedDeviceMemoryLimit: "1e999999" is out of range: '
            "at most 9223372036854775807 bytes (8Ei - 1)",
        ),
        ({"apiVersion": API, "kind": ["GpuConfig"]}, 'kind: unsupported value ["GpuConfig"]'),
        ({"apiVersion": API, "kind": {}}, "kind: unsupported value {}"),
        (gpu_config(strategy=10**5000), "sharing.strategy: integer is too long"),
        (gpu_config(strategy="MPS", mps={"x": shared_bomb()}), "config is too large"),
    ],
    ids=["deep", "huge-exponent", "kind-list", "kind-object", "long-integer", "alias-bomb"],
)
def test_hostile_parameters_are_problems_of_the_claim(parameters: Any, expected: str) -> None:
    start = time.monotonic()
    problems = config_problems(claim(entry(parameters)), driver=DRIVER)
    assert time.monotonic() - start < 1.0
    assert len(problems) >= 1
    assert all(p.startswith("spec.devices.config[0].opaque.parameters") for p in problems)
    assert any(expected in problem for problem in problems), problems


# --- strategies drasil would not apply (MPS outside shares of consumable GPUs) ----------

NOT_APPLIED = (
    'sharing.strategy: unsupported value "MPS" for a {device}: drasil runs no MPS daemon '
    "for one yet, so its containers would share it without MPS; allowed values are "
    '"Exclusive", "TimeSlicing"; MPS applies to shares of a consumable GPU '
    "(--gpu-sharing consumable, docs/sharing.md)"
)
WHERE = "spec.devices.config[0].opaque.parameters."
MIG_SHARES = (
    " and to shares of a MIG placement (with --mig-mode dynamic, a claim that asks for "
    "capacity.requests.memory of a MIG device)"
)


def mig_config(**sharing: Any) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "MigDeviceConfig", "sharing": sharing}


def test_mps_for_a_gpu_is_refused_where_no_gpu_of_the_cluster_is_consumable() -> None:
    mps = claim(entry(gpu_config(strategy="MPS", mps={"defaultActiveThreadPercentage": 30})))

    assert config_problems(mps, driver=DRIVER, shared_gpus=False) == [
        WHERE + NOT_APPLIED.format(device="whole GPU") + "; no GPU in this cluster is consumable"
    ]
    # Where a GPU may be allocated as a share, prepare decides (docs/sharing.md).
    assert config_problems(mps, driver=DRIVER, shared_gpus=True) == []
    assert config_problems(mps, driver=DRIVER) == []


def test_mps_for_a_mig_device_is_refused_where_no_device_is_shared() -> None:
    expected = (
        WHERE.replace("spec.devices", "spec.spec.devices")
        + NOT_APPLIED.format(device="MIG device")
        + MIG_SHARES
        + "; no GPU in this cluster is consumable"
    )
    mps = template(entry(mig_config(strategy="MPS")))
    assert config_problems(mps, driver=DRIVER, shared_gpus=False) == [expected]
    # Shares of MIG placements (dynamic MIG, consumable sharing) run MPS: prepare decides.
    assert config_problems(mps, driver=DRIVER, shared_gpus=True) == []


def test_other_strategies_and_broken_mps_configs_say_only_what_is_wrong() -> None:
    for strategy in ("Exclusive", "TimeSlicing"):
        for config in (gpu_config(strategy=strategy), mig_config(strategy=strategy)):
            assert config_problems(claim(entry(config)), driver=DRIVER, shared_gpus=False) == []
    # A config that does not decode is reported as such, not as MPS on top of it.
    broken = gpu_config(strategy="MPS", mps={"defaultActiveThreadPercentage": 101})
    (problem,) = config_problems(claim(entry(broken)), driver=DRIVER, shared_gpus=False)
    assert "defaultActiveThreadPercentage" in problem

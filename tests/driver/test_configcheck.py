"""Opaque configs of claims and templates, checked with the strict config API (controller)."""

from __future__ import annotations

from typing import Any

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

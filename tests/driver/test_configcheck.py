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


# --- strategies drasil would not apply (MPS on an admin-access request) ----------------

NOT_APPLIED = (
    'sharing.strategy: unsupported value "MPS" for a device of an admin-access request: '
    "such a request sits beside the claim that holds the device and takes no sharing of "
    'its own; allowed values are "Exclusive", "TimeSlicing" (or no config for that request)'
)
WHERE = "spec.devices.config[{index}].opaque.parameters."


def mig_config(**sharing: Any) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "MigDeviceConfig", "sharing": sharing}


def requests(obj: dict[str, Any], *names: str, admin: tuple[str, ...] = ()) -> dict[str, Any]:
    devices = obj["spec"]["devices"] if "devices" in obj["spec"] else obj["spec"]["spec"]["devices"]
    devices["requests"] = [
        {"name": n, "exactly": {"deviceClassName": "gpu.drasil.dev", "adminAccess": n in admin}}
        for n in names
    ]
    return obj


def test_mps_on_whole_gpus_and_mig_devices_is_no_problem() -> None:
    """MPS runs for every GPU and MIG device, shared or allocated whole (docs/sharing.md)."""
    for config in (gpu_config(strategy="MPS", mps={}), mig_config(strategy="MPS")):
        assert config_problems(requests(claim(entry(config)), "gpu"), driver=DRIVER) == []
        assert config_problems(requests(template(entry(config)), "gpu"), driver=DRIVER) == []


def test_mps_for_an_admin_access_request_is_refused() -> None:
    mps = gpu_config(strategy="MPS")
    on_admin = {**entry(mps), "requests": ["admin"]}
    all_requests = {**entry(mps), "requests": []}
    on_other = entry(mps)  # requests [gpu]
    obj = requests(claim(on_admin, all_requests, on_other), "gpu", "admin", admin=("admin",))
    assert config_problems(obj, driver=DRIVER) == [
        WHERE.format(index=0) + NOT_APPLIED,
        WHERE.format(index=1) + NOT_APPLIED,
    ]
    # In a template too, and TimeSlicing there is no problem.
    ts = {**entry(gpu_config(strategy="TimeSlicing")), "requests": ["admin"]}
    obj = requests(template(on_admin, ts), "admin", admin=("admin",))
    assert config_problems(obj, driver=DRIVER) == [
        WHERE.replace("spec.devices", "spec.spec.devices").format(index=0) + NOT_APPLIED
    ]


def test_other_strategies_and_broken_mps_configs_say_only_what_is_wrong() -> None:
    for strategy in ("Exclusive", "TimeSlicing"):
        for config in (gpu_config(strategy=strategy), mig_config(strategy=strategy)):
            obj = requests(claim(entry(config)), "gpu", admin=("gpu",))
            assert config_problems(obj, driver=DRIVER) == []
    # A config that does not decode is reported as such, not as MPS on top of it.
    broken = gpu_config(strategy="MPS", mps={"defaultActiveThreadPercentage": 101})
    obj = requests(claim(entry(broken)), "gpu", admin=("gpu",))
    (problem,) = config_problems(obj, driver=DRIVER)
    assert "defaultActiveThreadPercentage" in problem

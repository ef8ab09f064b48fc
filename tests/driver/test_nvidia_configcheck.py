"""NVIDIA's config kinds where drasil checks and applies configs: validate-config, the
controller's check, and the resolution of an allocated claim's configs."""

from __future__ import annotations

from typing import Any

from drasil.api.config import NVIDIA_API_VERSION, GpuConfig, SharingStrategy
from drasil.driver.claims.configcheck import config_problems, validate_config_document
from drasil.driver.claims.deviceconfigs import parse_allocation, resolve_configs
from drasil.driver.devices import Device, DeviceType

DRIVER = "gpu.drasil.dev"

CLAIM = f"""\
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: mps-gpu}}
spec:
  devices:
    requests:
    - name: gpu
      exactly: {{deviceClassName: gpu.drasil.dev}}
    config:
    - requests: [gpu]
      opaque:
        driver: {DRIVER}
        parameters:
          apiVersion: {NVIDIA_API_VERSION}
          kind: GpuConfig
          sharing:
            strategy: MPS
            mpsConfig:
              defaultActiveThreadPercentage: 50
              defaultPinnedDeviceMemoryLimit: 10Gi
"""


def test_validate_config_accepts_nvidias_kinds() -> None:
    assert validate_config_document(CLAIM) == []
    config = f"apiVersion: {NVIDIA_API_VERSION}\nkind: MigDeviceConfig\n"
    assert validate_config_document(config) == []


def test_validate_config_refuses_by_nvidias_rules() -> None:
    (problem,) = validate_config_document(CLAIM.replace("strategy: MPS", "strategy: TimeSlicing"))
    assert problem == (
        "ResourceClaim/mps-gpu: spec.devices.config[0].opaque.parameters: "
        'sharing.mpsConfig: not allowed with strategy "TimeSlicing": only with strategy "MPS"'
    )


def test_validate_config_checks_any_kind_of_nvidias_version() -> None:
    text = f"apiVersion: {NVIDIA_API_VERSION}\nkind: ComputeDomainConfig\nmetadata: {{name: v}}\n"
    (problem,) = validate_config_document(text)
    assert problem == (
        'ComputeDomainConfig/v: kind: unsupported value "ComputeDomainConfig": supported kinds '
        f'of "{NVIDIA_API_VERSION}" are "GpuConfig", "MigDeviceConfig", "VfioDeviceConfig"'
    )
    # An apiVersion that is no string is no config version (and never a crash).
    assert validate_config_document('{"apiVersion": ["x"], "kind": "Pod"}') == [
        f"no opaque config for driver {DRIVER} found"
    ]


def _claim_object(parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "team", "name": "train"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.drasil.dev"}}],
                "config": [{"opaque": {"driver": DRIVER, "parameters": parameters}}],
            }
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"}
                    ],
                    "config": [
                        {
                            "source": "FromClaim",
                            "requests": [],
                            "opaque": {"driver": DRIVER, "parameters": parameters},
                        }
                    ],
                }
            }
        },
    }


def test_the_controller_check_and_resolution_read_nvidias_kinds() -> None:
    parameters = {
        "apiVersion": NVIDIA_API_VERSION,
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
    }
    claim = _claim_object(parameters)
    assert config_problems(claim, driver=DRIVER) == []
    gpu = Device(
        name="gpu-0",
        type=DeviceType.GPU,
        uuid="GPU-0",
        minor=0,
        attributes={"type": "gpu"},
        capacity={"memory": 2**30},
    )
    resolved = resolve_configs(parse_allocation(claim, driver=DRIVER), devices={"gpu-0": gpu})
    config = resolved["gpu-0"].config
    assert isinstance(config, GpuConfig)
    assert config.sharing.strategy is SharingStrategy.TIME_SLICING
    assert config.sharing.time_slicing is not None
    assert config.sharing.time_slicing.interval.value == "Long"
    bad = _claim_object({**parameters, "sharing": {"strategy": "Exclusive"}})
    (problem,) = config_problems(bad, driver=DRIVER)
    assert problem.startswith(
        'spec.devices.config[0].opaque.parameters.sharing.strategy: unsupported value "Exclusive"'
    )

"""The drasil CLI as a user runs it: arguments in, text and exit code out."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml

from drasil.driver.cli import main
from drasil.driver.slices.build import validate_slice


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def test_discover_json_is_a_list_of_valid_resourceslices() -> None:
    code, text = run(
        "discover", "--backend", "simulated", "--profile", "h100-80gb:8", "--node-name", "n1",
        "-o", "json",
    )  # fmt: skip
    assert code == 0
    slices = json.loads(text)
    assert [s["kind"] for s in slices] == ["ResourceSlice"]
    assert slices[0]["apiVersion"] == "resource.k8s.io/v1"
    assert slices[0]["spec"]["nodeName"] == "n1"
    devices = slices[0]["spec"]["devices"]
    assert [d["name"] for d in devices] == [f"gpu-{i}" for i in range(8)]
    assert devices[0]["attributes"]["cudaComputeCapability"] == {"version": "9.0.0"}
    assert devices[0]["capacity"]["memory"] == {"value": "80Gi"}
    for s in slices:
        validate_slice(s)


def test_discover_mig_profile_lists_mig_devices() -> None:
    code, text = run(
        "discover", "--backend", "simulated", "--profile", "a100-40gb-mig:2", "--node-name", "n1",
        "-o", "yaml",
    )  # fmt: skip
    assert code == 0
    devices = [d for s in yaml.safe_load_all(text) for d in s["spec"]["devices"]]
    assert devices
    for device in devices:
        assert device["attributes"]["type"] == {"string": "mig"}
        assert device["attributes"]["parentUUID"]["string"].startswith("GPU-")
        assert "profile" in device["attributes"]
        assert {"multiprocessors", "copyEngines", "memory"} <= set(device["capacity"])


def test_discover_table_names_every_device() -> None:
    code, text = run("discover", "--backend", "simulated", "--profile", "l4:2", "--node-name", "n")
    assert code == 0
    assert "gpu-0" in text
    assert "gpu-1" in text
    assert "NVIDIA L4" in text


def test_unknown_profile_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run("discover", "--backend", "simulated", "--profile", "h100:8", "--node-name", "n")
    assert code == 2
    err = capsys.readouterr().err
    assert 'unknown profile "h100"' in err
    assert "h100-80gb" in err


def test_validate_config_names_field_value_and_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: resource.drasil.dev/v1beta1\nkind: GpuConfig\nsharing:\n  strategy: Foo\n"
    )
    code, _ = run("validate-config", str(bad))
    assert code == 1
    err = capsys.readouterr().err
    for needle in ("sharing.strategy", "Foo", "Exclusive", "TimeSlicing", "MPS"):
        assert needle in err


def test_validate_config_accepts_a_good_claim(tmp_path: Path) -> None:
    claim = tmp_path / "claim.yaml"
    claim.write_text(
        """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: shared}
spec:
  devices:
    requests: [{name: gpu, exactly: {deviceClassName: gpu.drasil.dev}}]
    config:
    - opaque:
        driver: gpu.drasil.dev
        parameters:
          apiVersion: resource.drasil.dev/v1beta1
          kind: GpuConfig
          sharing: {strategy: TimeSlicing, timeSlicing: {interval: Long}}
"""
    )
    code, text = run("validate-config", str(claim))
    assert code == 0
    assert "valid" in text


@pytest.mark.parametrize(
    "command", [(), ("discover",), ("validate-config",), ("explain",), ("fault",)]
)
def test_help_is_plain_text(command: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: drasil")
    assert "``" not in out

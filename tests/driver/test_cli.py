"""The drasil CLI as a user runs it: arguments in, text and exit code out."""

from __future__ import annotations

import importlib.metadata
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from drasil.driver.cli import main
from drasil.driver.nvidia.nvml import Placement
from drasil.driver.simulated.gpus import mig_uuid
from drasil.driver.simulated.nvml import simulated_library
from drasil.driver.slices.validate import validate_slice


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


def test_discover_a_mixed_node_publishes_both_vendors_in_valid_slices() -> None:
    code, text = run(
        "discover", "--backend", "simulated", "--profile", "l4:1,mi300x-cpx:1,mi210:1",
        "--node-name", "n1", "-o", "json",
    )  # fmt: skip
    assert code == 0
    slices = json.loads(text)
    for s in slices:
        validate_slice(s)
    devices = {d["name"]: d for s in slices for d in s["spec"]["devices"]}
    assert sorted(devices) == ["amdgpu-1-cpx-" + str(i) for i in range(8)] + [
        "amdgpu-9",
        "gpu-0",
    ]
    part = devices["amdgpu-1-cpx-3"]
    assert part["attributes"]["type"] == {"string": "amdgpu-partition"}
    assert part["attributes"]["partitionProfile"] == {"string": "cpx_nps4"}
    assert part["capacity"]["computeUnits"] == {"value": "38"}
    assert devices["amdgpu-9"]["attributes"]["productName"] == {"string": "AMD Instinct MI210"}


def test_discover_table_names_each_vendors_driver() -> None:
    code, text = run(
        "discover", "--backend", "simulated", "--profile", "mi300x:1", "--node-name", "n"
    )  # fmt: skip
    assert code == 0
    assert "amdgpu-1" in text
    assert "AMD Instinct MI300X" in text
    assert "NVIDIA driver" not in text
    assert "amdgpu 6.10.5" in text


def test_discover_dynamic_mig_publishes_placements_and_counters() -> None:
    code, text = run(
        "discover", "--backend", "simulated", "--profile", "h100-80gb:2", "--node-name", "n1",
        "--mig-mode", "dynamic", "-o", "json",
    )  # fmt: skip
    assert code == 0
    slices = json.loads(text)
    counter_sets = [c for s in slices for c in s["spec"].get("sharedCounters", ())]
    assert [c["name"] for c in counter_sets] == ["gpu-0-counters", "gpu-1-counters"]
    devices = {d["name"]: d for s in slices for d in s["spec"].get("devices", ())}
    assert len(devices) == 2 * 26
    assert devices["gpu-1-mig-3g40gb-at-4"]["consumesCounters"][0]["counterSet"] == (
        "gpu-1-counters"
    )


def test_discover_lists_the_mig_instances_of_a_state_file(tmp_path: Path) -> None:
    state = tmp_path / "simulated-gpus.json"
    lib = simulated_library("h100-80gb:1", node_name="n", state_file=state)
    lib.init()
    gpu = lib.device_handle_by_index(0)
    lib.device_set_mig_mode(gpu, True)
    lib.create_gpu_instance(gpu, 9, Placement(4, 4))
    lib.create_compute_instance(gpu, 2)
    argv = ["discover", "--backend", "simulated", "--profile", "h100-80gb:1", "--node-name", "n"]
    code, text = run(*argv, "--mig-mode", "dynamic", "--simulated-state", str(state))
    assert code == 0
    assert "gpu-0-mig-3g40gb-at-4" in text  # dynamic mode publishes placements, not instances
    line = f"gpu-0 gi=2 ci=0 3g.40gb at 4 {mig_uuid('n', 0, 2, 0)}"
    assert line in text.splitlines()
    code, text = run(*argv, "--simulated-state", str(state))  # static: the MIG device itself
    assert "gpu-0-mig-3g40gb-2-0" in text
    lib.destroy_compute_instance(gpu, 2, 0)
    lib.destroy_gpu_instance(gpu, 2)
    code, text = run(*argv, "--simulated-state", str(state))
    assert code == 0
    assert "gi=" not in text  # and static mode has no device left on the MIG-mode GPU
    assert text.startswith("NAME")


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


# --- hostile files (issue 14): a problem line and exit 1, never a traceback -----------

API = "resource.drasil.dev/v1beta1"
CONFIG = f"apiVersion: {API}\nkind: GpuConfig\n"
HOSTILE_FILES: dict[str, tuple[bytes, str]] = {
    "deep-json": (
        b'{"apiVersion": "%s", "kind": "GpuConfig", "sharing": %s%s}'
        % (API.encode(), b"[" * 3000, b"]" * 3000),
        "nested too deeply (line 1, column ",
    ),
    "deep-yaml": (
        (CONFIG + "sharing: " + "[" * 3000 + "]" * 3000).encode(),
        "nested too deeply (line 3, column ",
    ),
    "huge-exponent": (
        (
            CONFIG + "sharing: {strategy: MPS, mps: {defaultPinnedDeviceMemoryLimit: 1e999999}}"
        ).encode(),
        'sharing.mps.defaultPinnedDeviceMemoryLimit: "1e999999" is out of range: '
        "at most 9223372036854775807 bytes",
    ),
    "kind-list": (f"apiVersion: {API}\nkind: [GpuConfig]\n".encode(), "kind: unsupported value"),
    "kind-object": (f"apiVersion: {API}\nkind: {{}}\n".encode(), "kind: unsupported value {}"),
    "long-integer": (
        (
            CONFIG
            + "sharing: {strategy: MPS, mps: {defaultActiveThreadPercentage: %s}}" % ("9" * 5000)
        ).encode(),
        "is too long (line 3, column 63): at most 20 digits",
    ),
    "not-utf8": (CONFIG.encode() + b"sharing: {strategy: \xff}\n", "config is not UTF-8"),
    "alias-bomb": (
        (
            CONFIG
            + "sharing:\n  a0: &a0 [lol, lol]\n"
            + "".join(f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 10))
        ).encode(),
        "YAML anchors and aliases (&name, *name) are not allowed (line 4, column 7)",
    ),
    "too-large": (b"#" * (2**20 + 1), "text is too large"),
    "bad-tag": (CONFIG.encode() + b"sharing: !!int abc\n", "invalid YAML: invalid integer 'abc'"),
}


@pytest.mark.parametrize("name", HOSTILE_FILES)
def test_validate_config_names_the_problem_of_a_hostile_file(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, expected = HOSTILE_FILES[name]
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(data)
    code, out = run("validate-config", str(path))
    err = capsys.readouterr().err
    assert code == 1
    assert out == ""
    assert "Traceback" not in err
    assert err.startswith(f"{path}: ")
    assert expected in err, err
    assert len(err) < 1000  # a problem line, not the input


def test_validate_config_reads_hostile_standard_input(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data, expected = HOSTILE_FILES["not-utf8"]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data)))
    code, _ = run("validate-config", "-")
    assert code == 1
    assert capsys.readouterr().err.startswith(f"-: {expected}")


def test_validate_config_command_prints_no_traceback(tmp_path: Path) -> None:
    # The installed command, as a user runs it, on the files that once crashed it.
    for name in ("deep-json", "alias-bomb", "not-utf8"):
        data, expected = HOSTILE_FILES[name]
        path = tmp_path / f"{name}.yaml"
        path.write_bytes(data)
        done = subprocess.run(
            [sys.executable, "-m", "drasil.driver.cli", "validate-config", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr
        assert expected in done.stderr


def test_discover_consumable_marks_shared_gpus() -> None:
    argv = ["discover", "--backend", "simulated", "--profile", "h100-80gb:2", "--node-name", "n"]
    code, text = run(*argv, "--gpu-sharing", "consumable")
    assert code == 0
    lines = text.splitlines()
    assert lines[0].split() == ["NAME", "TYPE", "PRODUCT", "MEMORY", "SHARED", "UUID", "PARENT"]
    assert lines[1].split()[:7] == ["gpu-0", "gpu", "NVIDIA", "H100", "80GB", "HBM3", "80Gi"]
    assert lines[1].split()[7] == "yes"
    assert (
        "shared by capacity: gpu-0, gpu-1: computePercent 0 to 100 in steps of 1 (default 0), "
        "memory 2Gi to 80Gi in steps of 1Gi (default 80Gi)"
    ) in lines
    code, text = run(*argv)
    assert "SHARED" not in text
    assert "shared by capacity" not in text
    code, text = run(*argv, "--gpu-sharing", "consumable", "-o", "json")
    devices = json.loads(text)[0]["spec"]["devices"]
    assert all(d["allowMultipleAllocations"] for d in devices)


def test_version_prints_the_installed_distribution_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"drasil {importlib.metadata.version('drasil')}\n"


@pytest.mark.parametrize(
    ("claim", "named"),
    [("ns/", "claim name ''"), ("a/b/c", "namespace 'a/b'"), ("Bad_Claim", "claim name")],
)
def test_explain_names_a_malformed_claim_before_any_connection(
    claim: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # No kubeconfig exists here: the name is refused before one would be read.
    assert main(["explain", claim, "--kubeconfig", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("drasil explain: ")
    assert named in err
    assert "Traceback" not in err

"""The GPU check's pure parts: nvidia-smi's XML against NVML, the report, the sandbox plan.

The XML sample follows NVIDIA's documented ``nvidia-smi -q -x`` format
(``nvsmi_device_v12.dtd``), abridged to a few of the elements a real log has around the
ones the check reads, with two GPUs: an H100 (MIG capable, off) and an L4 (no MIG).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from drasil.driver.devices import Device, DeviceType
from drasil.kubeletplugin.gpucheck import claim, compare, mpsshare, report, runtime, sandbox
from drasil.kubeletplugin.gpucheck.cdicheck import compare_with_ctk, spec_problems
from drasil.kubeletplugin.gpucheck.container import Run
from drasil.kubeletplugin.gpucheck.main import probe_problems

H100 = "GPU-1e5d7136-70f6-5db0-829a-ba028cb36591"
L4 = "GPU-5c1a0d2e-7f3b-4c6d-9e8f-0a1b2c3d4e5f"

SMI_XML = f"""<?xml version="1.0" ?>
<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">
<nvidia_smi_log>
  <timestamp>Tue Oct 14 09:12:44 2025</timestamp>
  <driver_version>580.95.05</driver_version>
  <cuda_version>13.0</cuda_version>
  <attached_gpus>2</attached_gpus>
  <gpu id="00000000:19:00.0">
    <product_name>NVIDIA H100 80GB HBM3</product_name>
    <product_brand>NVIDIA</product_brand>
    <product_architecture>Hopper</product_architecture>
    <display_mode>Disabled</display_mode>
    <persistence_mode>Enabled</persistence_mode>
    <addressing_mode>None</addressing_mode>
    <mig_mode>
      <current_mig>Disabled</current_mig>
      <pending_mig>Disabled</pending_mig>
    </mig_mode>
    <mig_devices>None</mig_devices>
    <accounting_mode>Disabled</accounting_mode>
    <serial>1654922000000</serial>
    <uuid>{H100}</uuid>
    <minor_number>0</minor_number>
    <vbios_version>96.00.99.00.01</vbios_version>
    <pci>
      <pci_bus>19</pci_bus>
      <pci_device>00</pci_device>
      <pci_domain>0000</pci_domain>
      <pci_device_id>233010DE</pci_device_id>
      <pci_bus_id>00000000:19:00.0</pci_bus_id>
      <pci_sub_system_id>16C110DE</pci_sub_system_id>
    </pci>
    <fb_memory_usage>
      <total>81559 MiB</total>
      <reserved>551 MiB</reserved>
      <used>0 MiB</used>
      <free>81008 MiB</free>
    </fb_memory_usage>
    <compute_mode>Default</compute_mode>
  </gpu>
  <gpu id="00000000:3B:00.0">
    <product_name>NVIDIA L4</product_name>
    <product_brand>NVIDIA</product_brand>
    <mig_mode>
      <current_mig>N/A</current_mig>
      <pending_mig>N/A</pending_mig>
    </mig_mode>
    <uuid>{L4}</uuid>
    <minor_number>1</minor_number>
    <pci>
      <pci_bus>3B</pci_bus>
      <pci_bus_id>00000000:3B:00.0</pci_bus_id>
    </pci>
    <fb_memory_usage>
      <total>23034 MiB</total>
    </fb_memory_usage>
  </gpu>
</nvidia_smi_log>
"""


def nvml_side(**changes: Any) -> compare.NodeFacts:
    h100 = compare.GpuFacts(H100, "NVIDIA H100 80GB HBM3", 81559, "0000:19:00.0", False, 0)
    l4 = compare.GpuFacts(L4, "NVIDIA L4", 23034, "0000:3b:00.0", None, 1)
    return compare.NodeFacts(changes.get("driver", "580.95.05"), changes.get("gpus", (h100, l4)))


def test_the_sample_parses_into_the_facts_the_check_compares() -> None:
    smi = compare.parse_smi_xml(SMI_XML)
    assert smi == nvml_side()


def test_identical_sides_have_no_mismatch() -> None:
    assert compare.compare_facts(compare.parse_smi_xml(SMI_XML), nvml_side()) == []


def test_every_mismatch_is_named() -> None:
    h100 = compare.GpuFacts(H100, "NVIDIA H100 PCIe", 81000, "0000:1a:00.0", True, 0)
    other = compare.GpuFacts("GPU-other", "NVIDIA L4", 23034, "0000:3b:00.0", None, 1)
    problems = compare.compare_facts(
        compare.parse_smi_xml(SMI_XML), nvml_side(driver="580.82.07", gpus=(h100, other))
    )
    text = "\n".join(problems)
    assert "driver version: nvidia-smi '580.95.05', drasil '580.82.07'" in text
    assert f"GPU {L4}: in nvidia-smi, not found by drasil (UUID mismatch?)" in text
    assert "GPU GPU-other: found by drasil, not in nvidia-smi" in text
    for what in ("product name", "memory total", "PCI bus id", "MIG mode (current)"):
        assert f"GPU {H100}: {what}" in text


def test_output_that_is_no_smi_log_is_an_error() -> None:
    with pytest.raises(compare.SmiParseError):
        compare.parse_smi_xml("NVIDIA-SMI has failed because it couldn't communicate")
    with pytest.raises(compare.SmiParseError):
        compare.parse_smi_xml("<other/>")


@pytest.mark.parametrize(
    ("given", "normal"),
    [("00000000:3B:00.0", "0000:3b:00.0"), ("0000:3b:00.0", "0000:3b:00.0"), ("x", "x")],
)
def test_pci_bus_ids_compare_in_one_spelling(given: str, normal: str) -> None:
    assert compare.normal_pci(given) == normal


# ---- the report ------------------------------------------------------------------------


def test_the_report_has_a_line_per_step_and_fails_on_any_fail(tmp_path: Path) -> None:
    r = report.Report()
    r.add(report.ok("NVML", "driver 580.95.05"))
    r.add(report.skipped("dynamic MIG", "MIG mode off"))
    r.add(report.judged("nvidia-smi vs NVML", "2 GPU(s)", ["GPU x: UUID mismatch"]))
    with r.guard("prepare"):
        raise OSError("disk full")
    text = r.text()
    assert "dynamic MIG:               skipped: MIG mode off" in text
    assert "nvidia-smi vs NVML:        FAIL: 2 GPU(s): 1 mismatch(es)" in text
    assert "GPU x: UUID mismatch" in text
    assert "prepare:                   FAIL: OSError: disk full" in text
    assert text.endswith("gpu-check FAILED: 1 ok, 2 failed, 1 skipped\n")
    assert r.exit_code() == 1
    r.write_json(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert [s["status"] for s in data["steps"]] == ["ok", "skipped", "FAIL", "FAIL"]
    assert data["passed"] is False


def test_a_report_without_fail_exits_zero() -> None:
    r = report.Report()
    r.add(report.ok("NVML"))
    r.add(report.skipped("nvidia-ctk", "nvidia-ctk not installed"))
    assert r.exit_code() == 0


# ---- the sandbox plan --------------------------------------------------------------------

HOOK = "/usr/bin/nvidia-cdi-hook"
LIB = "/usr/lib/x86_64-linux-gnu"
SPEC: dict[str, Any] = {
    "cdiVersion": "0.6.0",
    "kind": "k8s.gpu.drasil.dev/claim",
    "containerEdits": {
        "env": ["NVIDIA_VISIBLE_DEVICES=void", f"NVIDIA_CTK_LIBCUDA_DIR={LIB}"],
        "deviceNodes": [{"path": "/dev/nvidiactl"}],
        "mounts": [
            {
                "hostPath": f"/drv{LIB}/libcuda.so.580.95.05",
                "containerPath": f"{LIB}/libcuda.so.580.95.05",
                "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"],
            }
        ],
        "hooks": [
            {
                "hookName": "createContainer",
                "path": HOOK,
                "args": [
                    "nvidia-cdi-hook",
                    "create-symlinks",
                    "--link",
                    f"libcuda.so.580.95.05::{LIB}/libcuda.so.1",
                ],
            },
            {
                "hookName": "createContainer",
                "path": HOOK,
                "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", LIB],
            },
            {
                "hookName": "createContainer",
                "path": HOOK,
                "args": ["nvidia-cdi-hook", "disable-device-node-modification"],
            },
        ],
    },
    "devices": [
        {
            "name": "uid-gpu-0",
            "containerEdits": {
                "env": ["DRASIL_DEVICE_GPU_0=GPU-a"],
                "deviceNodes": [{"path": "/dev/nvidia0", "major": 195, "minor": 0}],
            },
        },
        {
            "name": "uid-gpu-1",
            "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1"}]},
        },
    ],
}
RUNTIME = sandbox.Runtime(
    executable="/usr/bin/python3.11",
    directories=("/usr/lib/python3.11",),
    files=(f"{LIB}/libc.so.6", "/usr/lib/python3.11/lib-dynload/_ctypes.so"),
    links=(sandbox.Link("/lib64", "usr/lib64", "runtime"),),
)


def plan(*devices: str) -> sandbox.Plan:
    return sandbox.build_plan(SPEC, devices, RUNTIME, probe_source="/src/probe.py")


def test_the_plan_holds_the_spec_wide_edits_and_the_given_device_only() -> None:
    p = plan("uid-gpu-0")
    spec_nodes = [n.path for n in p.nodes if n.origin == "spec"]
    assert spec_nodes == ["/dev/nvidiactl", "/dev/nvidia0"]
    gpu = next(n for n in p.nodes if n.path == "/dev/nvidia0")
    assert (gpu.major, gpu.minor, gpu.type) == (195, 0, "c")
    (lib,) = [b for b in p.binds if b.origin == "spec"]
    assert lib.source == f"/drv{LIB}/libcuda.so.580.95.05"
    assert lib.flags == ("ro", "nosuid", "nodev")
    assert lib.recursive
    assert p.env["DRASIL_DEVICE_GPU_0"] == "GPU-a"
    assert "DRASIL_DEVICE_GPU_1" not in p.env


def test_hooks_become_links_and_a_library_path() -> None:
    p = plan("uid-gpu-0")
    assert sandbox.Link(f"{LIB}/libcuda.so.1", "libcuda.so.580.95.05") in p.links
    assert p.env["LD_LIBRARY_PATH"] == LIB
    assert p.hooks_applied == ("create-symlinks", "update-ldcache (as LD_LIBRARY_PATH)")
    assert p.hooks_not_applied == ("disable-device-node-modification",)


def test_the_probe_runtime_is_bound_read_only_and_named_as_not_the_spec() -> None:
    p = plan("uid-gpu-0")
    runtime = {b.target: b for b in p.binds if b.origin == "runtime"}
    assert set(runtime) >= {"/usr/bin/python3.11", "/usr/lib/python3.11", f"{LIB}/libc.so.6"}
    # Inside a bound folder already: not bound again.
    assert "/usr/lib/python3.11/lib-dynload/_ctypes.so" not in runtime
    assert runtime[sandbox.PROBE_PATH].source == "/src/probe.py"
    assert all(b.flags == ("ro",) for b in runtime.values())
    assert p.argv == ("/usr/bin/python3.11", "-I", "-S", sandbox.PROBE_PATH)
    assert sandbox.Plan.from_json(p.to_json()) == p


def test_a_device_the_spec_lacks_is_an_error() -> None:
    with pytest.raises(sandbox.SandboxError, match="uid-gpu-9"):
        plan("uid-gpu-9")


# ---- the spec checks and the probe's verdict ---------------------------------------------


def test_the_sample_spec_passes_the_schema_and_drasils_rules() -> None:
    assert spec_problems(SPEC) == []
    broken = {**SPEC, "devices": [{"name": "x"}]}
    assert any(p.startswith("schema: devices/0") for p in spec_problems(broken))


def test_the_ctk_comparison_names_what_drasil_lacks_and_adds() -> None:
    theirs = json.loads(json.dumps(SPEC))
    theirs["containerEdits"]["mounts"].append(
        {"hostPath": "/drv/usr/bin/nvidia-smi", "containerPath": "/usr/bin/nvidia-smi"}
    )
    theirs["devices"] = [{"name": "all", "containerEdits": {"deviceNodes": [
        {"path": "/dev/nvidia0"}, {"path": "/dev/nvidia1"}, {"path": "/dev/nvidia-caps/nvidia-cap1"}
    ]}}]  # fmt: skip
    found = compare_with_ctk(SPEC, ["uid-gpu-0"], theirs, gpu_node="/dev/nvidia0")
    assert found.problems == ("mount /usr/bin/nvidia-smi: nvidia-ctk has it, drasil lacks it",)
    assert "/dev/nvidia1" in found.notes[0]


def test_the_probe_must_see_exactly_the_claimed_gpu() -> None:
    good = {"cuda": {"cuInit": 0, "count": 1}, "nvml": {"nvmlInit_v2": 0, "uuids": ["GPU-a"]}}
    assert probe_problems(good, "GPU-a") == []
    two = {"cuda": {"cuInit": 0, "count": 2}, "nvml": {"nvmlInit_v2": 0, "uuids": ["a", "b"]}}
    assert len(probe_problems(two, "GPU-a")) == 2
    broken = {"cuda": {"error": "dlopen libcuda.so.1: not found"}, "nvml": {"nvmlInit_v2": 9}}
    assert probe_problems(broken, "GPU-a") == [
        "CUDA: dlopen libcuda.so.1: not found",
        "NVML: nvmlInit_v2 returned 9",
    ]


# ---- the MPS step ------------------------------------------------------------------------

# What a client of a 4Gi / 25% share saw on an H100 80GB (driver 580.159.04), with its
# env and with the limit variables unset: the daemon holds both.
H100_CLIENT = {
    "cuInit": 0,
    "multiprocessors": 32,
    "cuCtxCreate": 0,
    "cuMemGetInfo": 0,
    "freeMiB": 3951,
    "totalMiB": 81079,
    "allocSmall": 0,
    "allocOverLimit": 2,
}


def test_a_client_held_to_its_share_has_no_problem() -> None:
    assert mpsshare.client_problems(H100_CLIENT, full_sms=132, what="client") == []


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"freeMiB": 80900}, "80900 MiB free, over the share's 4096 MiB"),
        ({"allocOverLimit": 0}, "allocating 4352 MiB returned 0, not out of memory"),
        ({"allocSmall": 2}, "256 MiB not allocated"),
        ({"multiprocessors": 132}, "132 of 132 multiprocessors, over 25%"),
        ({"cuCtxCreate": 999}, "no CUDA context"),
        ({"error": "the client exited 127: sandbox: ..."}, "the client exited 127"),
    ],
)
def test_a_client_past_its_share_is_named(change: dict[str, Any], named: str) -> None:
    problems = mpsshare.client_problems({**H100_CLIENT, **change}, full_sms=132, what="client")
    assert len(problems) == 1
    assert named in problems[0]


def _share_run(container_seen: dict[str, Any] | None) -> Any:
    device = Device(
        name="gpu-0", type=DeviceType.GPU, uuid="GPU-a", minor=0, attributes={}, capacity={}
    )
    ran = Run(seen=container_seen, returncode=0, failed_step="", log="")
    return mpsshare._Run(
        device=device,
        before=0,
        during=3,
        after=0,
        clients={"with its env": H100_CLIENT, "env unset": H100_CLIENT},
        container=ran if container_seen is not None else None,
        container_note="" if container_seen is not None else "container: skipped: no kit",
    )


CONTAINER = {"uuids": "GPU-a", "cudaDevices": 1, "values": 4096, "wrong": 0, "freeMiB": 3951}


def test_the_share_in_a_container_is_judged_with_its_limit() -> None:
    held = {**CONTAINER, "allocMiB": 4352, "allocResult": 2}
    step = mpsshare._verdict("MPS share", _share_run(held), full_sms=132, program="p")
    assert step.status == "ok", step.details
    assert "container: 4096 kernel values checked, 3951 MiB free, 4352 MiB refused (2)" in (
        step.details
    )
    granted = {**CONTAINER, "allocMiB": 4352, "allocResult": 0}
    step = mpsshare._verdict("MPS share", _share_run(granted), full_sms=132, program="p")
    assert step.status == "FAIL"
    assert "container: an allocation of 4352 MiB was granted" in step.details


def test_without_a_kit_the_share_says_its_container_was_skipped() -> None:
    step = mpsshare._verdict("MPS share", _share_run(None), full_sms=132, program="p")
    assert step.status == "ok"
    assert "container: skipped: no kit" in step.details


def test_a_share_claim_carries_a_share_id_and_what_it_consumed() -> None:
    made = claim.make_claim(
        driver="gpu.drasil.dev", pool="n", device="gpu-0", consumed={"memory": "4Gi"}
    )
    result = made["status"]["allocation"]["devices"]["results"][0]
    assert result["consumedCapacity"] == {"memory": "4Gi"}
    assert result["shareID"]
    whole = claim.make_claim(driver="gpu.drasil.dev", pool="n", device="gpu-0")
    assert "shareID" not in whole["status"]["allocation"]["devices"]["results"][0]


def test_the_probe_gets_its_arguments_after_the_script() -> None:
    p = sandbox.build_plan(
        SPEC, ["uid-gpu-0"], RUNTIME, probe_source="/src/probe.py", probe_args=("--client", "1")
    )
    assert p.argv[-3:] == (sandbox.PROBE_PATH, "--client", "1")


def test_glibc_comes_along_from_beside_the_mapped_libc(tmp_path: Path) -> None:
    for name in ("libc.so.6", "libdl.so.2", "libpthread.so.0"):
        (tmp_path / name).write_bytes(b"")
    found = runtime.glibc_files([str(tmp_path / "libc.so.6"), "/usr/lib/libffi.so.8"])
    assert found == [str(tmp_path / n) for n in ("libc.so.6", "libdl.so.2", "libpthread.so.0")]
    assert runtime.glibc_files(["/usr/lib/libffi.so.8"]) == []

"""GPUs passed through to virtual machines (``--passthrough``): published twice, bound
to vfio-pci at prepare, back at unprepare.

Everything runs over the simulated backend's PCI tree and its kernel
(``drasil.driver.simulated.pcikernel``): binds and unbinds move the ``driver`` links,
``driver_override`` is kept, and ``/dev/vfio/<group>`` comes and goes as on a node. A
second Preparer (or a child process killed at a crash point) sees the bindings the
first one left, as a restarted plugin would.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from kubelet_client import (
    DRIVER,
    NODE,
    FileClaims,
    claim_json,
    crash_in_child,
    gpu_config,
    ref_of,
    result,
    spec_file,
)

from drasil.api.checkpoint import ClaimState
from drasil.driver.checkpoint import CHECKPOINT_DIR, CheckpointStore
from drasil.driver.devices import Device
from drasil.driver.vfio.holders import holders
from drasil.driver.vfio.pcisysfs import PciBus
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.options import PluginOptions, parse_options
from drasil.kubeletplugin.vendors.nvidia.node import SOURCE, NvidiaNode
from drasil.kubeletplugin.vendors.passthrough import Passthrough, record_key

PROFILE = "h100-80gb:2"
UID_A = "aaaaaaaa-0000-4000-8000-000000000001"
UID_B = "bbbbbbbb-0000-4000-8000-000000000002"


def options(root: Path) -> PluginOptions:
    return parse_options(
        [
            "--backend=simulated",
            f"--simulated-profile={PROFILE}",
            "--passthrough",
            f"--plugins-dir={root / 'plugins'}",
            f"--proc-root={root / 'proc'}",
        ],
        {"NODE_NAME": NODE},
    )


def vendor(root: Path) -> NvidiaNode:
    return SOURCE.open(options(root), simulated=PROFILE)


def found(root: Path) -> dict[str, Device]:
    return {d.name: d for d in vendor(root).discover(dra=True).devices}


def preparer(root: Path) -> Preparer:
    """A Preparer as the plugin builds one, on ``root``'s state, specs and PCI tree."""
    node = vendor(root)
    devices = {d.name: d for d in node.discover(dra=True).devices}
    opts = node.opts
    (root / "proc").mkdir(exist_ok=True)
    cdi = root / "cdi"
    cdi.mkdir(exist_ok=True)
    store = CheckpointStore(opts.state_dir / CHECKPOINT_DIR)
    store.load()
    p = Preparer(
        driver=DRIVER,
        pool=NODE,
        devices=devices,
        claims=FileClaims(root / "claims"),
        store=store,
        cdi_root=cdi,
        state_dir=opts.state_dir,
    )
    assert node.pci is not None
    p.passthrough = Passthrough(
        node.pci.bus,
        dev_root=node.pci.dev_root,
        proc_root=opts.proc_root,
        store=store,
        state_lock=p.state_lock,
        state_dir=opts.state_dir,
    )
    return p


def bus(root: Path) -> PciBus:
    node = vendor(root)
    assert node.pci is not None
    return node.pci.bus


def vfio_name(root: Path, gpu: str = "gpu-0") -> tuple[str, str]:
    """The passthrough device of ``gpu`` and the GPU's PCI address."""
    devices = found(root)
    bdf = str(devices[gpu].attributes["resource.kubernetes.io/pciBusID"])
    return "vfio-" + bdf.replace(":", "-").replace(".", "-"), bdf


def put_claim(root: Path, uid: str, *device_names: str, config: Any = ()) -> Any:
    claim = claim_json(
        uid,
        *(result(d, request=f"r{i}") for i, d in enumerate(device_names)),
        name=f"c-{uid[:4]}",
        namespace="vms",
        config=config,
    )
    FileClaims(root / "claims").put(claim)
    return ref_of(claim)


def drivers(root: Path, bdf: str) -> tuple[str | None, str | None]:
    """(the GPU function's driver, its audio function's)."""
    b = bus(root)
    return b.read(bdf).driver, b.read(bdf[:-1] + "1").driver


def spec(root: Path, uid: str) -> dict[str, Any]:
    return dict(json.loads(spec_file(root, uid).read_text()))


# ---- what is published ---------------------------------------------------------------


def test_each_whole_gpu_is_published_twice_sharing_one_counter(tmp_path: Path) -> None:
    node = vendor(tmp_path)
    discovered = node.discover(dra=True)
    devices = {d.name: d for d in discovered.devices}
    name, bdf = vfio_name(tmp_path)
    vfio = devices[name]
    assert str(vfio.type) == "vfio"
    assert vfio.attributes["resource.kubernetes.io/pciBusID"] == bdf
    assert vfio.attributes["vendorID"] == "0x10de"
    assert vfio.attributes["iommuFDEnabled"] is True
    assert vfio.attributes["iommuGroup"] == 20
    assert vfio.attributes["uuid"] == devices["gpu-0"].uuid
    assert "cudaDriverVersion" not in vfio.attributes  # the VM runs its own driver
    counter_set = "pci-" + bdf.replace(":", "-").replace(".", "-")
    assert [(c.counter_set, dict(c.counters)) for c in vfio.consumes_counters] == [
        (counter_set, {"passthrough": 1})
    ]
    assert [c.counter_set for c in devices["gpu-0"].consumes_counters] == [counter_set]
    sets = {c.name: dict(c.counters) for c in discovered.counter_sets}
    assert sets[counter_set] == {"passthrough": 1}
    assert sum(str(d.type) == "vfio" for d in devices.values()) == 2
    assert discovered.skipped == ()


def test_without_passthrough_nothing_changes(tmp_path: Path) -> None:
    opts = parse_options(
        ["--backend=simulated", f"--simulated-profile={PROFILE}", f"--plugins-dir={tmp_path}"],
        {"NODE_NAME": NODE},
    )
    devices = SOURCE.open(opts, simulated=PROFILE).discover(dra=True).devices
    assert sorted(d.name for d in devices) == ["gpu-0", "gpu-1"]
    assert all(not d.consumes_counters for d in devices)
    assert not opts.simulated_pci_root.exists()


def test_a_gpu_without_an_iommu_group_is_not_passed_through(tmp_path: Path) -> None:
    _, bdf = vfio_name(tmp_path)
    (bus(tmp_path).device_dir(bdf) / "iommu_group").unlink()
    discovered = vendor(tmp_path).discover(dra=True)
    names = {d.name for d in discovered.devices}
    assert "gpu-0" in names
    assert len([n for n in names if n.startswith("vfio-")]) == 1
    assert any("no IOMMU group" in s and "intel_iommu=on" in s for s in discovered.skipped)


def test_the_dynamic_mig_counters_are_drawn_by_the_passthrough_device_too(
    tmp_path: Path,
) -> None:
    opts = parse_options(
        [
            "--backend=simulated",
            "--simulated-profile=h100-80gb:1",
            "--passthrough",
            "--mig-mode=dynamic",
            f"--plugins-dir={tmp_path}",
        ],
        {"NODE_NAME": NODE},
    )
    devices = {
        d.name: d for d in SOURCE.open(opts, simulated="h100-80gb:1").discover(dra=True).devices
    }
    vfio = next(d for d in devices.values() if str(d.type) == "vfio")
    whole = devices["gpu-0"]
    assert [c.counter_set for c in vfio.consumes_counters] == [
        c.counter_set for c in whole.consumes_counters
    ]
    assert dict(vfio.consumes_counters[0].counters) == dict(whole.consumes_counters[0].counters)
    placement = next(d for d in devices.values() if d.mig_placement is not None)
    assert len(placement.consumes_counters) == 1  # its slices, not the passthrough counter


# ---- prepare and unprepare -----------------------------------------------------------


def test_prepare_binds_the_iommu_group_to_vfio_pci_and_unprepare_binds_it_back(
    tmp_path: Path,
) -> None:
    p = preparer(tmp_path)
    name, bdf = vfio_name(tmp_path)
    ref = put_claim(tmp_path, UID_A, name)
    answer = p.prepare(ref)
    assert answer.error == ""
    assert drivers(tmp_path, bdf) == ("vfio-pci", "vfio-pci")
    assert bus(tmp_path).read(bdf).driver_override == "vfio-pci"
    written = spec(tmp_path, UID_A)
    assert written.get("containerEdits", {}) in ({}, {"env": []})  # no driver files
    (device,) = [d for d in written["devices"] if d["name"].endswith(name)]
    edits = device["containerEdits"]
    nodes = {
        n["path"]: (n.get("type"), n.get("major"), n.get("minor")) for n in edits["deviceNodes"]
    }
    assert nodes == {"/dev/vfio/vfio": ("c", 10, 196), "/dev/vfio/20": ("c", 511, 20)}
    assert f"PCI_RESOURCE_GPU_DRASIL_DEV_R0={bdf}" in edits["env"]
    record = p.store.get(UID_A)
    assert record is not None
    assert record.devices[0].vfio is not None
    assert record.devices[0].vfio.iommu_group == 20
    natives = {k: r.native_driver for k, r in p.store.gpus().items()}
    assert natives == {record_key(bdf): "nvidia", record_key(bdf[:-1] + "1"): "snd_hda_intel"}

    assert p.unprepare(ref) == ""
    assert drivers(tmp_path, bdf) == ("nvidia", "snd_hda_intel")
    assert bus(tmp_path).read(bdf).driver_override is None
    assert not (p.passthrough.dev_root / "vfio" / "20").exists()  # type: ignore[union-attr]
    assert p.store.gpus() == {}


def test_the_metadata_carries_the_pci_address_where_kubevirt_reads_it(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    name, bdf = vfio_name(tmp_path)
    ref = put_claim(tmp_path, UID_A, name)
    assert p.prepare(ref).error == ""
    (meta_file,) = (p.metadata_root / UID_A).glob("*.json")
    lines = [json.loads(line) for line in meta_file.read_text().splitlines() if line]
    attributes = lines[0]["requests"][0]["devices"][0]["attributes"]
    assert attributes["resource.kubernetes.io/pciBusID"] == {"string": bdf}


def test_a_gpu_in_use_is_refused_naming_the_process_and_nothing_moves(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    name, bdf = vfio_name(tmp_path)
    minor = found(tmp_path)["gpu-0"].minor
    holder = tmp_path / "proc" / "4242"
    (holder / "fd").mkdir(parents=True)
    (holder / "comm").write_text("python3\n")
    os.symlink(f"/dev/nvidia{minor}", holder / "fd" / "7")
    ref = put_claim(tmp_path, UID_A, name)
    error = p.prepare(ref).error
    assert "is in use" in error
    assert "pid 4242 (python3)" in error
    assert "retries" in error
    assert drivers(tmp_path, bdf) == ("nvidia", "snd_hda_intel")
    (holder / "fd" / "7").unlink()
    assert p.prepare(ref).error == ""
    assert drivers(tmp_path, bdf) == ("vfio-pci", "vfio-pci")


def test_a_gpu_claim_and_a_passthrough_claim_of_one_gpu_are_never_prepared_together(
    tmp_path: Path,
) -> None:
    p = preparer(tmp_path)
    name, bdf = vfio_name(tmp_path)
    assert p.prepare(put_claim(tmp_path, UID_A, "gpu-0")).error == ""
    error = p.prepare(put_claim(tmp_path, UID_B, name)).error
    assert "c-aaaa" in error
    assert "unprepared" in error
    assert drivers(tmp_path, bdf) == ("nvidia", "snd_hda_intel")


def test_a_gpu_config_for_a_passthrough_device_is_refused_by_name(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    name, _ = vfio_name(tmp_path)
    ref = put_claim(tmp_path, UID_A, name, config=[gpu_config("MPS", requests=["r0"])])
    error = p.prepare(ref).error
    assert "a GpuConfig cannot be applied" in error
    assert "use a VfioDeviceConfig" in error


def test_a_kernel_without_vfio_pci_is_told_and_the_gpu_goes_back(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    name, bdf = vfio_name(tmp_path)
    vfio_driver = bus(tmp_path).driver_dir("vfio-pci")
    for file in vfio_driver.iterdir():
        file.unlink()
    vfio_driver.rmdir()
    ref = put_claim(tmp_path, UID_A, name)
    error = p.prepare(ref).error
    assert "modprobe vfio-pci" in error
    assert p.unprepare(ref) == ""
    assert drivers(tmp_path, bdf) == ("nvidia", "snd_hda_intel")
    assert p.store.gpus() == {}


def test_a_restarted_plugin_publishes_a_passed_through_gpu_as_passthrough_only(
    tmp_path: Path,
) -> None:
    p = preparer(tmp_path)
    name, bdf = vfio_name(tmp_path)
    ref = put_claim(tmp_path, UID_A, name)
    assert p.prepare(ref).error == ""
    again = found(tmp_path)  # its driver does not see the GPU now
    assert "gpu-0" not in again
    assert name in again
    assert "gpu-1" in again
    restarted = preparer(tmp_path)
    assert restarted.prepare(ref).error == ""  # answered from the checkpoint
    assert restarted.unprepare(ref) == ""
    assert drivers(tmp_path, bdf) == ("nvidia", "snd_hda_intel")


def test_a_function_the_host_bound_to_vfio_pci_stays_there(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    name, bdf = vfio_name(tmp_path)
    b = bus(tmp_path)
    for function in (bdf, bdf[:-1] + "1"):  # the host's own binding, made at boot
        b.set_override(function, "vfio-pci")
        b.unbind(function)
        b.bind(function, "vfio-pci")
    ref = put_claim(tmp_path, UID_A, name)
    assert p.prepare(ref).error == ""
    assert p.unprepare(ref) == ""
    assert drivers(tmp_path, bdf) == ("vfio-pci", "vfio-pci")


# ---- crashes -------------------------------------------------------------------------

PREPARE_CRASHES = [
    "prepare-after-started",
    "vfio-after-record",
    "vfio-after-override",
    "vfio-after-unbind",
    "vfio-after-bind",
    "prepare-after-cdi",
]
UNPREPARE_CRASHES = ["unprepare-after-cdi", "unprepare-after-removed", "vfio-after-restore"]


def crashed(root: Path, operation: str, ref: Any, point: str) -> None:
    crash_in_child("test_passthrough", root, operation, ref, point)


@pytest.mark.parametrize("point", PREPARE_CRASHES)
def test_a_prepare_repeated_after_a_crash_passes_the_gpu_through(
    tmp_path: Path, point: str
) -> None:
    name, bdf = vfio_name(tmp_path)
    ref = put_claim(tmp_path, UID_A, name)
    crashed(tmp_path, "prepare", ref, point)
    p = preparer(tmp_path)  # the restarted plugin
    assert p.prepare(ref).error == ""
    assert drivers(tmp_path, bdf) == ("vfio-pci", "vfio-pci")
    record = p.store.get(UID_A)
    assert record is not None
    assert record.state == ClaimState.PREPARE_COMPLETED
    assert p.unprepare(ref) == ""
    assert drivers(tmp_path, bdf) == ("nvidia", "snd_hda_intel")
    assert p.store.gpus() == {}


@pytest.mark.parametrize("point", PREPARE_CRASHES)
def test_an_unprepare_after_a_crashed_prepare_gives_the_gpu_back(
    tmp_path: Path, point: str
) -> None:
    name, bdf = vfio_name(tmp_path)
    ref = put_claim(tmp_path, UID_A, name)
    crashed(tmp_path, "prepare", ref, point)
    p = preparer(tmp_path)
    assert p.unprepare(ref) == ""
    assert drivers(tmp_path, bdf) == ("nvidia", "snd_hda_intel")
    assert bus(tmp_path).read(bdf).driver_override is None
    assert p.store.gpus() == {}


@pytest.mark.parametrize("point", UNPREPARE_CRASHES)
def test_a_crashed_unprepare_is_finished_by_the_repeat_or_the_restart(
    tmp_path: Path, point: str
) -> None:
    name, bdf = vfio_name(tmp_path)
    ref = put_claim(tmp_path, UID_A, name)
    assert preparer(tmp_path).prepare(ref).error == ""
    crashed(tmp_path, "unprepare", ref, point)
    restarted = preparer(tmp_path)
    assert restarted.passthrough is not None
    restarted.passthrough.settle()  # the start-up settle
    assert restarted.unprepare(ref) == ""
    assert drivers(tmp_path, bdf) == ("nvidia", "snd_hda_intel")
    assert restarted.store.gpus() == {}


# ---- the holder search ---------------------------------------------------------------


def test_the_holder_search_is_bounded_and_says_so(tmp_path: Path) -> None:
    (tmp_path / "1" / "fd").mkdir(parents=True)
    os.symlink("/dev/nvidia0", tmp_path / "1" / "fd" / "3")
    assert [h.pid for h in holders(tmp_path, ["/dev/nvidia0"]).found] == [1]
    late = holders(tmp_path, ["/dev/nvidia0"], budget=-1)
    assert "took over" in late.incomplete
    assert holders(tmp_path / "missing", ["/dev/nvidia0"]).incomplete
    assert holders(tmp_path, []).found == ()


# ---- explanations --------------------------------------------------------------------


def _explained(root: Path, target: dict[str, Any], holder: dict[str, Any]) -> str:
    from drasil.driver.explain.claims import explain_claim, render_table
    from drasil.driver.slices.build import build_slices

    discovered = vendor(root).discover(dra=True)
    slices = build_slices(
        driver=DRIVER,
        pool=NODE,
        devices=discovered.devices,
        node_name=NODE,
        counter_sets=discovered.counter_sets,
        generation=1,
        owner=None,
    )
    classes = [
        {"metadata": {"name": c}, "spec": {"selectors": [{"cel": {"expression": e}}]}}
        for c, e in (
            (DRIVER, f'device.attributes["{DRIVER}"].type == "gpu"'),
            ("vfio.gpu.drasil.dev", f'device.attributes["{DRIVER}"].type == "vfio"'),
        )
    ]
    found = explain_claim(
        target, slices=slices, claims=[target, holder], classes=classes, driver=DRIVER
    )
    return render_table(found)


def _claim(name: str, device_class: str, bdf: str, *, holds: str = "") -> dict[str, Any]:
    selector = f'device.attributes["resource.kubernetes.io"].pciBusID == "{bdf}"'
    obj: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "vms", "uid": f"uid-{name}"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": device_class,
                            "selectors": [{"cel": {"expression": selector}}],
                        },
                    }
                ]
            }
        },
    }
    if holds:
        result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": holds}
        obj["status"] = {"allocation": {"devices": {"results": [result]}}}
    return obj


def test_explain_says_a_gpu_is_with_a_vm_and_a_vm_waits_for_a_gpu_in_use(
    tmp_path: Path,
) -> None:
    name, bdf = vfio_name(tmp_path)
    vm = _claim("vm", "vfio.gpu.drasil.dev", bdf, holds=name)
    text = _explained(tmp_path, _claim("train", DRIVER, bdf), vm)
    assert "gpu-0 needs its GPU, which is passed through to a virtual machine" in text
    assert "vms/vm" in text
    container = _claim("train", DRIVER, bdf, holds="gpu-0")
    text = _explained(tmp_path, _claim("vm", "vfio.gpu.drasil.dev", bdf), container)
    assert f"{name} needs its GPU, which is in use as a GPU" in text
    assert "vms/train" in text


# ---- AMD -----------------------------------------------------------------------------


def amd_preparer(root: Path) -> tuple[Preparer, dict[str, Device]]:
    from drasil.kubeletplugin.vendors.amd.node import SOURCE as AMD

    opts = parse_options(
        [
            "--backend=simulated",
            "--simulated-profile=mi300x:1",
            "--passthrough",
            f"--plugins-dir={root / 'plugins'}",
            f"--proc-root={root / 'proc'}",
        ],
        {"NODE_NAME": NODE},
    )
    (root / "proc").mkdir(exist_ok=True)
    node = AMD.open(opts, simulated="mi300x:1")
    devices = {d.name: d for d in node.discover(dra=True).devices}
    (root / "cdi").mkdir(exist_ok=True)
    store = CheckpointStore(opts.state_dir / CHECKPOINT_DIR)
    store.load()
    p = Preparer(
        driver=DRIVER,
        pool=NODE,
        devices=devices,
        claims=FileClaims(root / "claims"),
        store=store,
        cdi_root=root / "cdi",
        state_dir=opts.state_dir,
    )
    assert node.pci is not None
    p.passthrough = Passthrough(
        node.pci.bus,
        dev_root=node.pci.dev_root,
        proc_root=opts.proc_root,
        store=store,
        state_lock=p.state_lock,
        state_dir=opts.state_dir,
    )
    return p, devices


def test_an_amd_gpu_is_passed_through_the_same_way(tmp_path: Path) -> None:
    p, devices = amd_preparer(tmp_path)
    name = "vfio-0000-03-00-0"
    assert str(devices[name].type) == "amdgpu-vfio"
    assert devices[name].attributes["vendorID"] == "0x1002"
    assert devices[name].passthrough is not None
    assert devices[name].passthrough.busy_nodes  # the GPU's /dev/dri nodes
    assert [c.counter_set for c in devices["amdgpu-1"].consumes_counters] == ["pci-0000-03-00-0"]
    ref = put_claim(tmp_path, UID_A, name)
    assert p.prepare(ref).error == ""
    assert p.passthrough is not None
    assert p.passthrough.bus.read("0000:03:00.0").driver == "vfio-pci"
    again, _ = amd_preparer(tmp_path)  # amdgpu's tree no longer lists the GPU
    assert "amdgpu-1" not in again.devices
    assert name in again.devices
    assert again.unprepare(ref) == ""
    assert p.passthrough.bus.read("0000:03:00.0").driver == "amdgpu"
    back, _ = amd_preparer(tmp_path)
    assert "amdgpu-1" in back.devices


# ---- VfioDeviceConfig ----------------------------------------------------------------


def _vfio_config(api: str, **iommu: Any) -> dict[str, Any]:
    parameters = {"apiVersion": api, "kind": "VfioDeviceConfig", "iommu": iommu}
    opaque = {"driver": DRIVER, "parameters": parameters}
    return {"source": "FromClaim", "requests": ["r0"], "opaque": opaque}


def _nodes(root: Path, uid: str) -> list[str]:
    return sorted(
        n["path"]
        for d in spec(root, uid)["devices"]
        for n in d["containerEdits"].get("deviceNodes") or []
    )


@pytest.mark.parametrize(
    ("config", "nodes"),
    [
        (None, ["/dev/vfio/20", "/dev/vfio/vfio"]),
        (("resource.drasil.dev/v1beta1", {}), ["/dev/vfio/20", "/dev/vfio/vfio"]),
        (
            ("resource.drasil.dev/v1beta1", {"enableAPIDevice": False}),
            ["/dev/vfio/20"],
        ),
        # NVIDIA's kind keeps NVIDIA's default: no API device unless asked.
        (("resource.nvidia.com/v1beta1", {}), ["/dev/vfio/20"]),
        (
            (
                "resource.nvidia.com/v1beta1",
                {"backendPolicy": "LegacyOnly", "enableAPIDevice": True},
            ),
            ["/dev/vfio/20", "/dev/vfio/vfio"],
        ),
        (
            (
                "resource.nvidia.com/v1beta1",
                {"backendPolicy": "PreferIommuFD", "enableAPIDevice": True},
            ),
            ["/dev/iommu", "/dev/vfio/devices/vfio160"],
        ),
    ],
)
def test_the_vfio_config_picks_the_nodes(
    tmp_path: Path, config: tuple[str, dict[str, Any]] | None, nodes: list[str]
) -> None:
    p = preparer(tmp_path)
    name, bdf = vfio_name(tmp_path)
    configs = [] if config is None else [_vfio_config(config[0], **config[1])]
    ref = put_claim(tmp_path, UID_A, name, config=configs)
    assert p.prepare(ref).error == ""
    assert _nodes(tmp_path, UID_A) == nodes
    assert p.unprepare(ref) == ""
    assert drivers(tmp_path, bdf) == ("nvidia", "snd_hda_intel")


def test_a_bad_vfio_config_names_the_field_and_the_values(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    name, _ = vfio_name(tmp_path)
    bad = _vfio_config("resource.nvidia.com/v1beta1", backendPolicy="IommuFDOnly")
    error = p.prepare(put_claim(tmp_path, UID_A, name, config=[bad])).error
    assert "iommu.backendPolicy" in error
    assert '"LegacyOnly"' in error
    assert '"PreferIommuFD"' in error


def test_a_gpu_nvml_lists_processes_on_is_refused_and_an_nvml_that_cannot_tell_is_not_trusted(
    tmp_path: Path,
) -> None:
    from drasil.driver.devices import HardwareError

    p = preparer(tmp_path)
    assert p.passthrough is not None
    step = p.passthrough
    name, bdf = vfio_name(tmp_path)
    ref = put_claim(tmp_path, UID_A, name)
    step.processes = lambda device: (4711, 4712)
    error = p.prepare(ref).error
    assert "its driver lists processes 4711, 4712" in error
    assert drivers(tmp_path, bdf) == ("nvidia", "snd_hda_intel")

    def broken(device: Device) -> tuple[int, ...]:
        raise HardwareError("NVML: Function Not Found")

    step.processes = broken
    assert p.prepare(ref).error == ""  # the /proc walk found no holder
    assert drivers(tmp_path, bdf) == ("vfio-pci", "vfio-pci")

"""``nvidia-smi -q -x`` against what drasil's NVML backend and discovery found.

nvidia-smi is NVIDIA's own reading of the same driver, so it is the oracle: for every
GPU its UUID, product name, total framebuffer memory, PCI bus id and current MIG mode,
and the driver version, must agree with drasil's. The XML follows NVIDIA's
``nvsmi_device_v12.dtd`` (``<nvidia_smi_log>``, one ``<gpu id="...">`` per GPU).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from drasil.driver.devices import Device, DeviceType, Version
from drasil.driver.nvidia.nodedevices import driver_version_semver
from drasil.driver.nvidia.nvml import NvmlLibrary, NvmlNotSupported

MIB = 2**20
PCI_ATTRIBUTE = "resource.kubernetes.io/pciBusID"
_PCI = re.compile(r"^([0-9a-fA-F]+):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


class SmiParseError(ValueError):
    """nvidia-smi's output is not the XML log it documents."""


@dataclass(frozen=True)
class GpuFacts:
    """One GPU as one side saw it; ``mig`` is ``None`` where MIG is not supported."""

    uuid: str
    name: str
    memory_mib: int | None
    pci_bus_id: str
    mig: bool | None
    minor: int | None = None


@dataclass(frozen=True)
class NodeFacts:
    driver_version: str
    gpus: tuple[GpuFacts, ...]


def normal_pci(bus_id: str) -> str:
    """``00000000:17:00.0`` (NVML, nvidia-smi) and ``0000:17:00.0`` (sysfs) alike:
    a 4-digit domain, lowercase."""
    m = _PCI.match(bus_id.strip())
    if m is None:
        return bus_id.strip().lower()
    domain, bus, dev, fn = m.groups()
    return f"{int(domain, 16):04x}:{bus}:{dev}.{fn}".lower()


def _text(node: ET.Element, path: str) -> str:
    found = node.find(path)
    return (found.text or "").strip() if found is not None else ""


def _mib(text: str) -> int | None:
    m = re.match(r"^(\d+)\s*MiB$", text)
    return int(m.group(1)) if m else None


def _mig(text: str) -> bool | None:
    return {"enabled": True, "disabled": False}.get(text.lower())


def parse_smi_xml(text: str) -> NodeFacts:
    """The facts of ``nvidia-smi -q -x`` output. Raises ``SmiParseError``."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as err:
        raise SmiParseError(f"nvidia-smi -q -x printed no XML: {err}") from err
    if root.tag != "nvidia_smi_log":
        raise SmiParseError(f"nvidia-smi -q -x: root element <{root.tag}>, not <nvidia_smi_log>")
    gpus = []
    for gpu in root.findall("gpu"):
        minor = _text(gpu, "minor_number")
        gpus.append(
            GpuFacts(
                uuid=_text(gpu, "uuid"),
                name=_text(gpu, "product_name"),
                memory_mib=_mib(_text(gpu, "fb_memory_usage/total")),
                pci_bus_id=normal_pci(_text(gpu, "pci/pci_bus_id") or gpu.get("id", "")),
                mig=_mig(_text(gpu, "mig_mode/current_mig")),
                minor=int(minor) if minor.isdigit() else None,
            )
        )
    return NodeFacts(driver_version=_text(root, "driver_version"), gpus=tuple(gpus))


def nvml_facts(lib: NvmlLibrary) -> NodeFacts:
    """The same facts through drasil's NVML backend (``lib`` initialised)."""
    gpus = []
    for index in range(lib.device_count()):
        handle = lib.device_handle_by_index(index)
        try:
            mig: bool | None = lib.device_mig_mode(handle).current
        except NvmlNotSupported:
            mig = None
        gpus.append(
            GpuFacts(
                uuid=lib.device_uuid(handle),
                name=lib.device_name(handle),
                memory_mib=lib.device_memory_total(handle) // MIB,
                pci_bus_id=normal_pci(lib.device_pci_bus_id(handle)),
                mig=mig,
                minor=lib.device_minor_number(handle),
            )
        )
    return NodeFacts(driver_version=lib.system_driver_version(), gpus=tuple(gpus))


def _mode(mig: bool | None) -> str:
    return {True: "Enabled", False: "Disabled", None: "N/A"}[mig]


def compare_facts(smi: NodeFacts, nvml: NodeFacts) -> list[str]:
    """Every disagreement between nvidia-smi and drasil's NVML, one line each."""
    problems = []
    if smi.driver_version != nvml.driver_version:
        problems.append(
            f"driver version: nvidia-smi {smi.driver_version!r}, drasil {nvml.driver_version!r}"
        )
    ours = {g.uuid: g for g in nvml.gpus}
    theirs = {g.uuid: g for g in smi.gpus}
    for uuid in sorted(theirs.keys() - ours.keys()):
        problems.append(f"GPU {uuid}: in nvidia-smi, not found by drasil (UUID mismatch?)")
    for uuid in sorted(ours.keys() - theirs.keys()):
        problems.append(f"GPU {uuid}: found by drasil, not in nvidia-smi (UUID mismatch?)")
    for uuid in sorted(ours.keys() & theirs.keys()):
        problems += _gpu_problems(theirs[uuid], ours[uuid])
    return problems


def _gpu_problems(smi: GpuFacts, nvml: GpuFacts) -> list[str]:
    pairs = [
        ("product name", smi.name, nvml.name),
        ("memory total (MiB)", smi.memory_mib, nvml.memory_mib),
        ("PCI bus id", smi.pci_bus_id, nvml.pci_bus_id),
        ("MIG mode (current)", _mode(smi.mig), _mode(nvml.mig)),
    ]
    return [
        f"GPU {smi.uuid}: {what}: nvidia-smi {a!r}, drasil {b!r}" for what, a, b in pairs if a != b
    ]


def _attribute(device: Device, name: str) -> str:
    value = device.attributes.get(name)
    if isinstance(value, Version):
        return value.value
    return "" if value is None else str(value)


def compare_devices(smi: NodeFacts, devices: Sequence[Device]) -> list[str]:
    """Whether the devices discovery publishes say what nvidia-smi says: each GPU not
    in MIG mode as a whole ``gpu`` device, a GPU in MIG mode never whole."""
    whole: Mapping[str, Device] = {d.uuid: d for d in devices if d.type == DeviceType.GPU}
    problems = []
    for gpu in smi.gpus:
        device = whole.get(gpu.uuid)
        if gpu.mig:
            if device is not None:
                problems.append(f"GPU {gpu.uuid} is in MIG mode but published whole")
            continue
        if device is None:
            problems.append(f"GPU {gpu.uuid} ({gpu.name}) is not published as a device")
            continue
        problems += _device_problems(gpu, device, smi.driver_version)
    return problems


def _device_problems(gpu: GpuFacts, device: Device, driver_version: str) -> list[str]:
    memory = device.capacity.get("memory", 0) // MIB
    pairs = [
        ("productName", gpu.name, _attribute(device, "productName")),
        ("capacity memory (MiB)", gpu.memory_mib, memory),
        (PCI_ATTRIBUTE, gpu.pci_bus_id, normal_pci(_attribute(device, PCI_ATTRIBUTE))),
        # Published as semver (580.95.05 -> 580.95.5): compare in that spelling.
        ("driverVersion", _semver(driver_version), _attribute(device, "driverVersion")),
    ]
    return [
        f"device {device.name} ({gpu.uuid}): {what}: nvidia-smi {a!r}, published {b!r}"
        for what, a, b in pairs
        if a != b
    ]


def _semver(text: str) -> str:
    try:
        return driver_version_semver(text)
    except ValueError:
        return text

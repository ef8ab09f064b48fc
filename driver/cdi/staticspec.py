"""The static CDI spec of device-plugin mode: one CDI device per node device.

DRA mode writes a spec per claim because each claim gets its own env. A device
plugin's Allocate answers synchronously and kubelet never tells us when a container
is gone, so there is nothing to clean up per container: one spec, written when the
plugin starts, names every device (``k8s.gpu.drasil.dev/device=gpu-3``). The lists
that depend on the whole allocation (``NVIDIA_VISIBLE_DEVICES``) cannot live in it,
since a runtime keeps only the last value when two CDI devices set one variable;
Allocate returns them as env instead.

The file is ``<cdi_root>/k8s.<driver>-device.json``, replaced atomically, validated by
the same rules as the claim specs (``drasil.driver.cdi.claimspecs``).

One spec per vendor. The NVIDIA spec's spec-wide ``containerEdits`` carry the NVIDIA
driver's edits (its libraries, ``nvidia-cdi-hook`` hooks, control nodes), and a CDI
runtime applies a spec's spec-wide edits to every container that gets any device of
that spec. AMD devices therefore live in a spec of their own, kind
``k8s.<driver>/amd-device`` in ``<cdi_root>/k8s.<driver>-amd-device.json``, which has no
spec-wide edits at all: an AMD container gets its devices' nodes (``/dev/kfd``,
``/dev/dri/card<N>``, ``/dev/dri/renderD<M>``, by number) and nothing of NVIDIA's; ROCm's
user space comes from the workload's image.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Final

from drasil.driver.cdi.spec import (
    SPEC_FILE_MODE,
    CdiSpec,
    ContainerEdits,
    common_edits_dict,
    device_env_name,
    device_nodes_of,
    edits_dict,
    encode_spec,
    required_cdi_version,
    validate_spec,
)
from drasil.driver.devices import Device, Vendor
from drasil.driver.files import remove_file, write_atomic

DEVICE_CLASS: Final = "device"


def device_class(vendor: Vendor = Vendor.NVIDIA) -> str:
    """``device`` for NVIDIA's spec (its name since before AMD), ``amd-device`` for AMD's."""
    return DEVICE_CLASS if vendor == Vendor.NVIDIA else f"{vendor.value}-{DEVICE_CLASS}"


def device_kind(driver: str, vendor: Vendor = Vendor.NVIDIA) -> str:
    """``k8s.<driver>/device``: a class of its own, apart from DRA's per-claim specs
    (``k8s.<driver>/amd-device`` for AMD devices)."""
    return f"k8s.{driver}/{device_class(vendor)}"


def device_cdi_id(*, driver: str, device_name: str, vendor: Vendor = Vendor.NVIDIA) -> str:
    """The fully-qualified CDI device ID Allocate returns: ``k8s.<driver>/device=gpu-0``
    (``k8s.<driver>/amd-device=amdgpu-1`` for an AMD device)."""
    return f"{device_kind(driver, vendor)}={device_name}"


def device_spec_path(cdi_root: Path, *, driver: str, vendor: Vendor = Vendor.NVIDIA) -> Path:
    """``<cdi_root>/k8s.<driver>-device.json`` (CDI's ``<vendor>-<class>``, docs/design.md#cdi)."""
    cdi_vendor, cls = device_kind(driver, vendor).split("/")
    return cdi_root / f"{cdi_vendor}-{cls}.json"


def build_device_spec(
    devices: Sequence[Device],
    *,
    driver: str,
    common: ContainerEdits | None = None,
    vendor: Vendor = Vendor.NVIDIA,
) -> CdiSpec:
    """The validated spec naming every device, with the lowest ``cdiVersion`` it needs.

    ``common``: the node's edits every GPU container needs (the driver's files and
    hooks, its control nodes), spec-wide. NVIDIA's only: an AMD spec refuses them, and
    every device must be ``vendor``'s (spec-wide edits reach every device of a spec).
    """
    others = sorted(d.name for d in devices if d.vendor != vendor)
    if others:
        raise ValueError(f"the {vendor.value} device spec cannot hold {', '.join(others)}")
    if vendor != Vendor.NVIDIA and common is not None:
        raise ValueError(f"the {vendor.value} device spec takes no spec-wide edits")
    spec: CdiSpec = {
        "kind": device_kind(driver, vendor),
        "devices": [_entry(d) for d in sorted(devices, key=lambda d: (d.minor, d.name))],
    }
    if common is not None and (edits := common_edits_dict(common)):
        spec["containerEdits"] = edits
    spec["cdiVersion"] = required_cdi_version(spec)
    validate_spec(spec)
    return spec


def _entry(device: Device) -> CdiSpec:
    # The per-device variable makes every entry non-empty (CDI requires an edit) even
    # for simulated devices, which have no device nodes.
    edits: CdiSpec = {"env": [f"{device_env_name(device.name)}={device.uuid}"]}
    if nodes := device_nodes_of(device):
        edits = edits_dict({device_env_name(device.name): device.uuid}, nodes, ())
    return {"name": device.name, "containerEdits": edits}


def write_device_spec(
    devices: Sequence[Device],
    *,
    cdi_root: Path,
    driver: str,
    common: ContainerEdits | None = None,
    vendor: Vendor = Vendor.NVIDIA,
) -> Path | None:
    """Write (or, for a node without devices, remove) the static spec; returns its path."""
    path = device_spec_path(cdi_root, driver=driver, vendor=vendor)
    if not devices:
        # A spec needs at least one device; a stale one would name devices that are gone.
        remove_file(path, crash_tag="cdi", durable=False)
        return None
    data = encode_spec(build_device_spec(devices, driver=driver, common=common, vendor=vendor))
    cdi_root.mkdir(parents=True, exist_ok=True)
    # /var/run/cdi is tmpfs (see write_claim_spec): atomic rename without fsync.
    write_atomic(path, data, mode=SPEC_FILE_MODE, crash_tag="cdi", durable=False)
    return path


def write_device_specs(
    devices: Sequence[Device],
    *,
    cdi_root: Path,
    driver: str,
    nvidia_common: ContainerEdits | None = None,
) -> dict[Vendor, Path | None]:
    """Each vendor's spec with that vendor's devices (removed where it has none);
    ``nvidia_common`` goes into NVIDIA's only."""
    return {
        vendor: write_device_spec(
            [d for d in devices if d.vendor == vendor],
            cdi_root=cdi_root,
            driver=driver,
            common=nvidia_common if vendor == Vendor.NVIDIA else None,
            vendor=vendor,
        )
        for vendor in Vendor.known()
    }

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
from drasil.driver.devices import Device
from drasil.driver.files import remove_file, write_atomic

DEVICE_CLASS: Final = "device"


def device_kind(driver: str) -> str:
    """``k8s.<driver>/device``: a class of its own, apart from DRA's per-claim specs."""
    return f"k8s.{driver}/{DEVICE_CLASS}"


def device_cdi_id(*, driver: str, device_name: str) -> str:
    """The fully-qualified CDI device ID Allocate returns: ``k8s.<driver>/device=gpu-0``."""
    return f"{device_kind(driver)}={device_name}"


def device_spec_path(cdi_root: Path, *, driver: str) -> Path:
    """``<cdi_root>/k8s.<driver>-device.json`` (CDI's ``<vendor>-<class>``, docs/design.md#cdi)."""
    vendor, cls = device_kind(driver).split("/")
    return cdi_root / f"{vendor}-{cls}.json"


def build_device_spec(
    devices: Sequence[Device], *, driver: str, common: ContainerEdits | None = None
) -> CdiSpec:
    """The validated spec naming every device, with the lowest ``cdiVersion`` it needs.

    ``common``: the node's edits every GPU container needs (the driver's files and
    hooks, its control nodes), spec-wide.
    """
    spec: CdiSpec = {
        "kind": device_kind(driver),
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
) -> Path | None:
    """Write (or, for a node without devices, remove) the static spec; returns its path."""
    path = device_spec_path(cdi_root, driver=driver)
    if not devices:
        # A spec needs at least one device; a stale one would name devices that are gone.
        remove_file(path, crash_tag="cdi", durable=False)
        return None
    data = encode_spec(build_device_spec(devices, driver=driver, common=common))
    cdi_root.mkdir(parents=True, exist_ok=True)
    # /var/run/cdi is tmpfs (see write_claim_spec): atomic rename without fsync.
    write_atomic(path, data, mode=SPEC_FILE_MODE, crash_tag="cdi", durable=False)
    return path

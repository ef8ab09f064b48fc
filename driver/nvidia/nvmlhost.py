"""Not NVML: the host facts and the tool the pynvml adapter needs beside NVML.

The ``NvmlLibrary`` methods that NVML has no call for read them here: a GPU's PCIe
root complex from sysfs, the capability minors of MIG devices from the driver's
``/proc`` entries (``mig-minors``, a capability's ``access`` file, the ``nvidia-caps``
major in ``/proc/devices``), and the compute time slice through
``nvidia-smi compute-policy`` (run with ``NVIDIA_SMI_TIMEOUT``; its listing parsed
by ``parse_time_slice``). The simulated backend has none of these.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from drasil.driver.nvidia.nvml import TIME_SLICE_NAMES, NvmlNotFound, NvmlQueryError

_PCI_ROOT = re.compile(r"pci[0-9a-f]{4,}:[0-9a-f]{2}")


def sysfs_pcie_root(pci_bus_id: str, *, sysfs: Path = Path("/sys")) -> str | None:
    """The PCIe root complex of a device, read from where its sysfs node really lives.

    ``/sys/bus/pci/devices/0000:3b:00.0`` links to
    ``/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0``; the ``pci…`` component is
    the root (the same rule as Kubernetes' ``deviceattribute`` helper).
    """
    try:
        target = (sysfs / "bus" / "pci" / "devices" / pci_bus_id).resolve(strict=True)
    except OSError:
        return None
    return next((part for part in target.parts if _PCI_ROOT.fullmatch(part)), None)


MIG_MINORS = Path("/proc/driver/nvidia-caps/mig-minors")


def read_mig_minors(path: Path) -> dict[str, int]:
    """``mig-minors``: ``gpu0/gi1/access 12`` lines → ``{"gpu0/gi1/access": 12}``.

    The driver lists the capability minor of every GPU instance and compute instance
    that could exist; ``/dev/nvidia-caps/nvidia-cap<minor>`` opens it. A missing file
    (driver without MIG) reads as empty.
    """
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except FileNotFoundError:
        return {}
    minors: dict[str, int] = {}
    for line in text.splitlines():
        name, _, number = line.strip().partition(" ")
        if number.strip().isdigit():
            minors[name] = int(number)
    return minors


def read_access_minor(path: Path) -> int | None:
    """``DeviceFileMinor`` of a driver capability's ``access`` file, None without one.

    The file reads ``DeviceFileMinor: 21`` / ``DeviceFileMode: 292`` /
    ``DeviceFileModify: 1``.
    """
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "DeviceFileMinor" and value.strip().isdigit():
            return int(value.strip())
    return None


def caps_major(devices: Path) -> int:
    """The character major of ``nvidia-caps`` in ``/proc/devices``; NvmlNotFound when the
    driver registered none (no MIG support loaded)."""
    try:
        text = devices.read_text(encoding="ascii", errors="replace")
    except OSError as err:
        raise NvmlNotFound(f"{devices}: {err}") from err
    section = text.partition("Character devices:")[2].partition("Block devices:")[0]
    for line in section.splitlines():
        number, _, name = line.strip().partition(" ")
        if name.strip() == "nvidia-caps" and number.isdigit():
            return int(number)
    raise NvmlNotFound(
        f"{devices}: no nvidia-caps character device: the NVIDIA driver loaded has no MIG "
        "capabilities; MIG devices cannot be given to containers until it does"
    )


NVIDIA_SMI_TIMEOUT = 10.0
_TIME_SLICE_WORD = re.compile(r"time[ _-]?slice")


def parse_time_slice(listing: str) -> int | None:
    """The time slice in ``nvidia-smi compute-policy --list`` output, or None.

    The layout is undocumented, so this reads the first line naming the time slice
    and takes the first level name or 0-3 digit after that word (a GPU index may come
    before it in a table row).
    """
    for line in listing.splitlines():
        parts = _TIME_SLICE_WORD.split(line.lower(), maxsplit=1)
        if len(parts) < 2:
            continue
        rest = parts[1]
        for token in re.findall(r"[a-z]+|\d+", rest):
            if token in TIME_SLICE_NAMES:
                return TIME_SLICE_NAMES[token]
            if token.isdigit() and int(token) in TIME_SLICE_NAMES.values():
                return int(token)
    return None


def compute_policy(nvidia_smi: str, uuid: str, option: str) -> str:
    """``nvidia-smi compute-policy -i <uuid> <option>``'s output, or NvmlQueryError
    with what the tool said."""
    command = [nvidia_smi, "compute-policy", "-i", uuid, option]
    what = f"nvidia-smi compute-policy -i {uuid} {option}"
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except FileNotFoundError as err:
        raise NvmlQueryError(f"{what}: {nvidia_smi} not found") from err
    except subprocess.TimeoutExpired as err:
        raise NvmlQueryError(f"{what}: no answer in {NVIDIA_SMI_TIMEOUT:g}s") from err
    except OSError as err:
        raise NvmlQueryError(f"{what}: {err}") from err
    if done.returncode != 0:
        # nvidia-smi prints some refusals on stdout, so fall back to it.
        said = (done.stderr.strip() or done.stdout.strip())[:500]
        raise NvmlQueryError(f"{what}: exit status {done.returncode}: {said}")
    return done.stdout

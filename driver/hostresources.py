"""Host CPUs and memory that go with a GPU: ``nodeAllocatableResources`` (KEP-5517).

A GPU job needs host resources beside its GPU: CPUs to feed it, memory to stage its
data. With ``--host-resources-per-gpu cpu=8,memory=32Gi`` every whole GPU the node
publishes carries, in its ResourceSlice entry,

    nodeAllocatableResources: {cpu: {overhead: {perPod: "8"}}, memory: {overhead: {perPod: "32Gi"}}}

and kube-scheduler (feature gate ``DRANodeAllocatableResources``, alpha in 1.36/1.37)
debits them from the node's allocatable for every Pod that uses the GPU, as if the
Pod had asked for them; kubelet adds them to the Pod's cgroup. An *overhead*, not a
*mapping*: the GPU is not itself host CPU or memory (the API's own example), and a
claim shared by several Pods stays allowed, each Pod debited once.

Only whole GPUs (NVIDIA ``gpu``, AMD ``amdgpu``) that one claim holds carry it: a MIG
device, an AMD partition or a share of a consumable GPU is part of a GPU, and an
overhead is a fixed amount per Pod that cannot follow the part's size.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Final

from drasil.api.quantity import QuantityError, parse_quantity
from drasil.driver.devices import Device, DeviceType

WHOLE_GPU_TYPES: Final = frozenset({DeviceType.GPU, DeviceType.AMDGPU})
_NAMES: Final = ("cpu", "memory", "ephemeral-storage")
_HUGEPAGES = re.compile(r"hugepages-[0-9]+[KMGT]i?")
MAX_RESOURCES: Final = 8


class HostResourcesError(ValueError):
    """An option value that names no node-allocatable resource or no amount."""


def parse_host_resources(text: str, *, flag: str = "--host-resources-per-gpu") -> dict[str, str]:
    """``cpu=8,memory=32Gi`` → ``{"cpu": "8", "memory": "32Gi"}`` (empty: none).

    Names are node-allocatable resources (``cpu``, ``memory``, ``ephemeral-storage``,
    ``hugepages-<size>``); extended resources are not allowed by the API. Amounts are
    positive quantities."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, amount = (s.strip() for s in part.partition("="))
        if not sep:
            raise HostResourcesError(f"{flag}: {part!r} is not <resource>=<amount>")
        _check_name(name, flag=flag)
        _check_amount(name, amount, flag=flag)
        if name in out:
            raise HostResourcesError(f"{flag}: {name} is given twice")
        out[name] = amount
    if len(out) > MAX_RESOURCES:
        raise HostResourcesError(f"{flag}: at most {MAX_RESOURCES} resources")
    return out


def _check_name(name: str, *, flag: str) -> None:
    if name in _NAMES or _HUGEPAGES.fullmatch(name):
        return
    raise HostResourcesError(
        f"{flag}: {name!r} is not a node-allocatable resource; allowed: "
        f"{', '.join(_NAMES)}, hugepages-<size> (extended resources are not)"
    )


def _check_amount(name: str, amount: str, *, flag: str) -> None:
    try:
        value = parse_quantity(amount)
    except QuantityError as err:
        raise HostResourcesError(f"{flag}: {name}: {err}") from None
    if value <= 0:
        raise HostResourcesError(f"{flag}: {name}: {amount!r} is not a positive amount")


def with_host_resources(devices: Iterable[Device], per_gpu: Mapping[str, str]) -> list[Device]:
    """The devices, each whole GPU that one claim holds carrying ``per_gpu``."""
    if not per_gpu:
        return list(devices)
    return [
        replace(d, host_resources=per_gpu)
        if d.type in WHOLE_GPU_TYPES and not d.allow_multiple_allocations
        else d
        for d in devices
    ]

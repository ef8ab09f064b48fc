"""``drasil migrate check --from nvidia-dra``: what of a cluster built on NVIDIA's DRA
driver (kubernetes-sigs/dra-driver-nvidia-gpu) moves to drasil installed with the chart
preset ``compatibility: nvidia-dra``, per object and per workload.

Read-only and pure, as ``drasil.driver.nvidia.migration`` is: the caller lists
DeviceClasses, ResourceClaims, ResourceClaimTemplates, ResourceSlices, ComputeDomains,
Pods, Deployments, StatefulSets and Jobs and hands them here as plain dicts. Each object
that uses NVIDIA's driver gets one verdict (``runs unchanged``, ``needs a change``
naming it, ``cannot move yet`` saying why), and a workload the worst of the claims and
templates it uses and of the extended resources it asks for.

What drasil offers under the preset is in the constants below, in one place: the
driver ``gpu.nvidia.com``, the DeviceClasses ``gpu.nvidia.com`` and ``mig.nvidia.com``
(and drasil's own), the attributes and capacities its devices publish (those of
``drasil.driver.nvidia.nodedevices`` and ``partitions``), and NVIDIA's config kinds
decoded by ``drasil.api.config.decode_config``. What it does not offer (ComputeDomains,
NVIDIA's integer ``shares``) is named with the reason; VFIO passthrough moves where the
chart's ``passthrough.enabled`` is set, and is noted so.

The objects are the users': any field may be missing or of the wrong type, and none is
trusted to be small. Lists are read up to the API server's own limits, CEL selectors
are scanned (not parsed) with one linear regular expression and only up to the API
server's length limit, and opaque configs go through ``decode_config``'s bounded
readers; nothing here recurses into a user's object.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Final

from drasil.api.config import OpaqueConfig, SharingStrategy, decode_config
from drasil.api.documents import ConfigError
from drasil.api.quantity import QuantityError, parse_quantity
from drasil.driver.nvidia.migration import BLOCKED, CHANGE, ORDER, UNCHANGED
from drasil.driver.objects import JsonObject, mapping, objects, text

# --- what drasil offers under `compatibility: nvidia-dra` -----------------------------

DRIVER: Final = "gpu.nvidia.com"
"""The driver name under the preset: NVIDIA's, so claims' configs and selectors match."""
COMPUTE_DOMAIN_DRIVER: Final = "compute-domain.nvidia.com"
"""NVIDIA's second driver, for ComputeDomains' IMEX channels and daemons."""
STANDARD_DOMAIN: Final = "resource.kubernetes.io"

PUBLISHED_ATTRIBUTES: Final[frozenset[str]] = frozenset(
    {
        # drasil.driver.nvidia.nodedevices._read_gpu, _full_gpu, _mig_device
        "type",
        "uuid",
        "productName",
        "brand",
        "architecture",
        "cudaComputeCapability",
        "driverVersion",
        "cudaDriverVersion",
        "index",
        "minor",
        "addressingMode",  # where NVML reports one (HMM, ATS), as NVIDIA's driver does
        # MIG devices (static and dynamic placements)
        "parentUUID",
        "profile",
        # dynamic MIG placements only (drasil.driver.nvidia.partitions)
        "placementStart",
        "placementSize",
        # passthrough devices (drasil.driver.vfio.devices), NVIDIA's names
        "vendorID",
        "deviceID",
        "iommuFDEnabled",
        "iommuGroup",
    }
)
"""Attributes of domain ``gpu.nvidia.com`` drasil's NVIDIA devices publish."""
PUBLISHED_STANDARD: Final[frozenset[str]] = frozenset({"pciBusID", "pcieRoot", "numaNode"})
"""Attributes of domain ``resource.kubernetes.io`` drasil's NVIDIA devices publish."""
PUBLISHED_CAPACITY: Final[frozenset[str]] = frozenset(
    {
        "memory",
        "multiprocessors",
        "copyEngines",
        "decoders",
        "encoders",
        "jpegEngines",
        "ofaEngines",
        "computePercent",  # GPUs and MIG placements shared by capacity (consumable)
    }
)
"""Capacities of drasil's NVIDIA devices (domain ``gpu.nvidia.com``)."""
SHARED_CAPACITY: Final[frozenset[str]] = frozenset({"memory", "computePercent"})
"""The capacities a claim may ask a share of (``gpuSharing: consumable``)."""
MEMORY_STEP: Final = 2**30
NVIDIA_ONLY: Final[Mapping[str, str]] = {
    "gpuModuleId": "a Fabric Manager attribute of NVIDIA's VFIO devices",
    "addressableMemory": "a capacity of NVIDIA's VFIO devices (drasil's have memory)",
}
"""What NVIDIA's driver publishes and drasil does not, with what it is."""

VFIO_CLASS: Final = "vfio.gpu.nvidia.com"
OFFERED_CLASSES: Final[frozenset[str]] = frozenset({"gpu.nvidia.com", "mig.nvidia.com", VFIO_CLASS})
DRASIL_CLASS_SUFFIX: Final = ".drasil.dev"
PRESET_EXTENDED: Final[Mapping[str, str]] = {"nvidia.com/gpu": "gpu.nvidia.com"}
"""Extended resources the preset's DeviceClasses stand for."""

COMPUTE_DOMAINS: Final = (
    "ComputeDomains (IMEX channels across a multi-node NVLink domain) are NVIDIA's: "
    "drasil runs no ComputeDomain controller nor IMEX daemons"
)
PASSTHROUGH: Final = (
    "GPUs for virtual machines are published with the chart value passthrough.enabled: "
    "true (docs/passthrough.md)"
)
SHARES: Final = (
    "NVIDIA's integer consumable-shares mode (capacity shares) has no drasil counterpart: "
    "drasil shares by memory and compute (ask capacity.requests.memory, and computePercent, "
    "with gpuSharing: consumable)"
)
BLOCKED_CLASSES: Final[Mapping[str, str]] = {
    "compute-domain-daemon.nvidia.com": COMPUTE_DOMAINS,
    "compute-domain-default-channel.nvidia.com": COMPUTE_DOMAINS,
    "imex.nvidia.com": COMPUTE_DOMAINS,  # IMEX channels before ComputeDomains
}
BLOCKED_CONFIG_KINDS: Final[Mapping[str, str]] = {
    "ComputeDomainChannelConfig": COMPUTE_DOMAINS,
    "ComputeDomainDaemonConfig": COMPUTE_DOMAINS,
}
NVIDIA_CLASSES: Final = OFFERED_CLASSES | frozenset(BLOCKED_CLASSES)

# --- bounds on what is read ------------------------------------------------------------

MAX_CEL_CHARS: Final = 10 * 1024
"""The API server's limit on a CEL selector (CELSelectorExpressionMaxLength)."""
MAX_ITEMS: Final = 32
"""Requests, subrequests, selectors, constraints, configs and the config's request
names read per object: the API server's own limit on each of these lists is 32."""
MAX_NAME: Final = 253
MAX_REFERENCES: Final = 64
"""References to attributes read from one CEL selector."""
MAX_REASONS: Final = 8
"""Reasons one object's line gives; past these, how many more there are."""

_NAME = rf"""(?:'([^'\\]{{1,{MAX_NAME}}})'|"([^"\\]{{1,{MAX_NAME}}})")"""
_REFERENCE = re.compile(
    rf"""device\s*\.\s*(attributes|capacity)\s*\[\s*{_NAME}\s*\]\s*"""
    r"""(?:\.\s*([A-Za-z_][A-Za-z0-9_]{0,63})|\[\s*(?:'([^'\\]{1,64})'|"([^"\\]{1,64})")\s*\])"""
)
"""``device.attributes['d'].name``, ``device.capacity["d"].name``, ``...['d']['name']``:
no nested or overlapping repetition, so a scan is linear in the expression."""
_DRIVER_IS = re.compile(rf"""device\s*\.\s*driver\s*==\s*{_NAME}""")
_PLUS = re.compile(r"(gb)\.(?=[a-z])")
_VFIO_TYPE = re.compile(r"""\.\s*type\s*==\s*['"]vfio['"]""")


@dataclass(frozen=True)
class Finding:
    """One object's verdict and why."""

    kind: str
    namespace: str
    name: str
    verdict: str
    reasons: tuple[str, ...]

    @property
    def ref(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}" if self.namespace else self.short

    @property
    def short(self) -> str:
        return f"{self.kind} {self.name}"


@dataclass
class _Judgement:
    """What one object's checks found, worst first when made a verdict."""

    relevant: bool = False
    blocked: list[str] = field(default_factory=list)
    change: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # why -> what of it was found: one reason however many parts of the object it is
    because: dict[str, list[str]] = field(default_factory=dict)

    def verdict(self) -> str:
        return BLOCKED if self.blocked or self.because else CHANGE if self.change else UNCHANGED

    def add(self, verdict: str, reason: str) -> None:
        self.relevant = True
        {BLOCKED: self.blocked, CHANGE: self.change}.get(verdict, self.notes).append(reason)

    def cannot(self, what: str, why: str) -> None:
        """A part of the object drasil does not serve (``what``), and ``why``."""
        self.relevant = True
        self.because.setdefault(why, []).append(what)

    def absorb(self, prefix: str, found: Finding) -> None:
        self.relevant = True
        for reason in found.reasons:
            self.add(found.verdict if found.verdict != UNCHANGED else "", f"{prefix}{reason}")
        if found.verdict != UNCHANGED and not found.reasons:
            self.add(found.verdict, f"{prefix}{found.verdict}")

    def finding(self, kind: str, namespace: str, name: str) -> Finding:
        grouped = [f"{', '.join(dict.fromkeys(w))}: {why}" for why, w in self.because.items()]
        reasons = tuple(dict.fromkeys(grouped + self.blocked + self.change + self.notes))
        if len(reasons) > MAX_REASONS:
            reasons = (*reasons[:MAX_REASONS], f"and {len(reasons) - MAX_REASONS} more")
        return Finding(kind, namespace, name, self.verdict(), reasons)


def _name(value: object) -> str:
    found = text(value)
    return found if len(found) <= MAX_NAME else found[:MAX_NAME] + "..."


def _first(value: object) -> tuple[JsonObject, ...]:
    return objects(value[:MAX_ITEMS] if isinstance(value, list | tuple) else value)


def _strings(value: object) -> list[str]:
    items = value[:MAX_ITEMS] if isinstance(value, list | tuple) else []
    return [_name(v) for v in items if isinstance(v, str)]


def _meta(obj: JsonObject) -> tuple[str, str]:
    raw = mapping(obj.get("metadata"))
    return _name(raw.get("namespace")), _name(raw.get("name"))


# --- the plan --------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What drasil will offer: the chart values' sharing, the cluster's own DeviceClasses
    (judged), the extended resources a DeviceClass stands for, and the consumable-shares
    mode NVIDIA's driver publishes its GPUs with (None: exclusive, or not seen)."""

    consumable: bool
    classes: Mapping[str, Finding | None]
    extended: Mapping[str, str]
    # The chart's passthrough.enabled: GPUs for VMs (vfio.gpu.nvidia.com) are published.
    passthrough: bool = False
    nvidia_sharing: str | None = None
    compatibility: bool = True
    class_configs: Mapping[str, tuple[_Config, ...]] = field(default_factory=dict)


def plan_from(
    values: Mapping[str, Any],
    classes: Sequence[JsonObject],
    slices: Sequence[JsonObject] = (),
) -> Plan:
    """The plan from the chart values (``gpuSharing``, ``compatibility``), the cluster's
    DeviceClasses and NVIDIA's ResourceSlices."""
    judged: dict[str, Finding | None] = {}
    configs: dict[str, tuple[_Config, ...]] = {}
    extended = dict(PRESET_EXTENDED)
    for obj in classes:
        if not isinstance(obj, Mapping):
            continue
        _, name = _meta(obj)
        if not name or name in NVIDIA_CLASSES or name.endswith(DRASIL_CLASS_SUFFIX):
            continue
        judged[name], configs[name] = _judge_class(obj)
        resource = text(mapping(obj.get("spec")).get("extendedResourceName"))
        if resource and judged[name] is not None:
            extended.setdefault(resource, name)
    return Plan(
        consumable=values.get("gpuSharing") == "consumable",
        passthrough=mapping(values.get("passthrough")).get("enabled") is True,
        classes=judged,
        extended=extended,
        nvidia_sharing=nvidia_sharing(slices),
        # No values at all: judged as the preset; values that do not name it are told.
        compatibility=not values or values.get("compatibility") == "nvidia-dra",
        class_configs=configs,
    )


def nvidia_sharing(slices: Iterable[JsonObject]) -> str | None:
    """NVIDIA's ``--consumable-shares`` mode as its ResourceSlices show it: ``integer``
    (a ``shares`` capacity), ``unlimited`` (memory shared with a default of 0),
    ``memory``, or None where no GPU of ``gpu.nvidia.com`` is shared."""
    modes: set[str] = set()
    for obj in slices:
        spec = mapping(obj.get("spec")) if isinstance(obj, Mapping) else mapping(None)
        if spec.get("driver") != DRIVER:
            continue
        for device in objects(spec.get("devices")):
            if device.get("allowMultipleAllocations") is not True:
                continue
            capacity = mapping(device.get("capacity"))
            memory = mapping(mapping(capacity.get("memory")).get("requestPolicy"))
            if "shares" in capacity:
                modes.add("integer")
            elif _quantity(memory.get("default")) == 0:
                modes.add("unlimited")
            else:
                modes.add("memory")
    for mode in ("integer", "unlimited", "memory"):
        if mode in modes:
            return mode
    return None


def _quantity(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    try:
        return int(parse_quantity(value)) if isinstance(value, str) else None
    except (QuantityError, ValueError, ArithmeticError):
        return None


# --- selectors and constraints ---------------------------------------------------------


@dataclass
class _Scan:
    references: set[tuple[str, str, str]] = field(default_factory=set)  # (what, domain, name)
    drivers: set[str] = field(default_factory=set)
    vfio: bool = False
    too_long: int = 0


def scan_cel(expression: object) -> _Scan:
    """The attributes, capacities and drivers a CEL selector names (found by a regular
    expression, not parsed); nothing for one longer than the API server allows."""
    found = _Scan()
    if not isinstance(expression, str):
        return found
    if len(expression) > MAX_CEL_CHARS:
        found.too_long = len(expression)
        return found
    for match in _REFERENCE.finditer(expression):
        what, d1, d2, n1, n2, n3 = match.groups()
        found.references.add((what, d1 or d2 or "", n1 or n2 or n3 or ""))
        if len(found.references) >= MAX_REFERENCES:
            break
    for match in _DRIVER_IS.finditer(expression):
        found.drivers.add(match.group(1) or match.group(2) or "")
        if len(found.drivers) >= MAX_REFERENCES:
            break
    found.vfio = _VFIO_TYPE.search(expression) is not None
    return found


def _unpublished(what: str, domain: str, name: str) -> str | None:
    """Why drasil lacks the attribute (or capacity) ``domain/name``; None when it has
    it or the domain is not one drasil's NVIDIA devices publish in."""
    if domain == DRIVER:
        known = PUBLISHED_CAPACITY if what == "capacity" else PUBLISHED_ATTRIBUTES
    elif domain == STANDARD_DOMAIN and what == "attributes":
        known = PUBLISHED_STANDARD
    else:
        return None
    if name in known:
        return None
    noun = "capacity" if what == "capacity" else "attribute"
    why = NVIDIA_ONLY.get(name)
    if name.startswith("memorySlice") and what == "capacity":
        why = "drasil counts a MIG placement's memory slices in counters, not capacities"
    elif name.startswith("partition") and what == "attributes":
        why = "a Fabric Manager attribute of NVIDIA's VFIO devices"
    return f"{noun} {domain}/{name}, which drasil does not publish" + (f" ({why})" if why else "")


def _selectors(
    where: str, selectors: object, judged: _Judgement, *, passthrough: bool = False
) -> None:
    for selector in _first(selectors):
        found = scan_cel(mapping(selector.get("cel")).get("expression"))
        if found.too_long:
            judged.add(
                CHANGE,
                f"{where}: a CEL selector of {found.too_long} characters, more than the API "
                f"server's {MAX_CEL_CHARS}: not judged",
            )
            continue
        for what, domain, name in sorted(found.references):
            if domain in (DRIVER, COMPUTE_DOMAIN_DRIVER):
                judged.relevant = True
            why = _unpublished(what, domain, name)
            if why is not None:
                judged.add(CHANGE, f"{where} selects on {why}")
        for driver in sorted(found.drivers):
            if driver == DRIVER:
                judged.relevant = True
            elif driver == COMPUTE_DOMAIN_DRIVER:
                judged.cannot(f"{where} selects devices of {driver}", COMPUTE_DOMAINS)
        if found.vfio and judged.relevant and not passthrough:
            judged.add(CHANGE, f"{where} selects devices of type vfio: {PASSTHROUGH}")


def _constraints(constraints: object, judged: _Judgement) -> None:
    for constraint in _first(constraints):
        for key in ("matchAttribute", "distinctAttribute"):
            value = _name(constraint.get(key))
            domain, _, name = value.rpartition("/")
            if domain in (DRIVER, COMPUTE_DOMAIN_DRIVER):
                judged.relevant = True
            why = _unpublished("attributes", domain, name) if value else None
            if why is not None:
                judged.add(CHANGE, f"constraint {key} {value}: drasil does not publish it")


# --- configs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Config:
    requests: tuple[str, ...]  # empty: every request
    decoded: OpaqueConfig | None


def _configs(where: str, configs: object, judged: _Judgement) -> list[_Config]:
    """The configs drasil would decode (``gpu.nvidia.com``'s), in order; the others of
    NVIDIA's drivers judged, any other driver's left alone."""
    found: list[_Config] = []
    for entry in _first(configs):
        opaque = mapping(entry.get("opaque"))
        driver = text(opaque.get("driver"))
        requests = tuple(_strings(entry.get("requests")))
        named = f"{where}config for {', '.join(requests) or 'every request'}"
        parameters = opaque.get("parameters")
        kind = text(mapping(parameters).get("kind"))
        if driver == COMPUTE_DOMAIN_DRIVER or (driver == DRIVER and kind in BLOCKED_CONFIG_KINDS):
            why = BLOCKED_CONFIG_KINDS.get(kind, COMPUTE_DOMAINS)
            judged.cannot(f"{named} ({_name(kind) or driver})", why)
            continue
        if driver != DRIVER:
            continue
        judged.relevant = True
        try:
            decoded: OpaqueConfig | None = decode_config(mapping(parameters))
        except ConfigError as err:
            issue = err.issues[0] if err.issues else err
            judged.add(CHANGE, f"{named}: {issue}")
            decoded = None
        found.append(_Config(requests, decoded))
    return found


def _applies(config: _Config, request: str) -> bool:
    top = request.partition("/")[0]
    return not config.requests or request in config.requests or top in config.requests


def _is_mps(config: OpaqueConfig | None) -> bool:
    return config is not None and config.sharing.strategy == SharingStrategy.MPS


# --- DeviceClasses ---------------------------------------------------------------------


def check_class(obj: JsonObject) -> Finding | None:
    """A DeviceClass of the user's (not NVIDIA's, not drasil's): its selectors, configs
    and extended resource; None when it has nothing to do with NVIDIA's driver."""
    return _judge_class(obj)[0]


def _judge_class(obj: JsonObject) -> tuple[Finding | None, tuple[_Config, ...]]:
    namespace, name = _meta(obj)
    spec = mapping(obj.get("spec"))
    judged = _Judgement()
    _selectors("a selector", spec.get("selectors"), judged)
    configs = tuple(_configs("", spec.get("config"), judged))
    resource = text(spec.get("extendedResourceName"))
    if resource in PRESET_EXTENDED:
        judged.add(
            CHANGE,
            f"extendedResourceName {resource}: the preset's DeviceClass "
            f"{PRESET_EXTENDED[resource]} stands for it too; drop it here",
        )
    elif resource.startswith("nvidia.com/"):
        judged.relevant = True
    if not judged.relevant:
        return None, ()
    return judged.finding("DeviceClass", namespace, name), configs


# --- ResourceClaims and templates ------------------------------------------------------


ALL: Final = 1 << 30  # allocationMode: All


@dataclass(frozen=True)
class _Request:
    name: str  # "req" or "req/sub"
    spec: JsonObject  # exactly, or one of firstAvailable


def _requests(devices: JsonObject) -> Iterator[_Request]:
    for request in _first(devices.get("requests")):
        name = _name(request.get("name"))
        exactly = request.get("exactly")
        if isinstance(exactly, Mapping):
            yield _Request(name, exactly)
        elif "deviceClassName" in request:  # v1beta1's flat request
            yield _Request(name, request)
        for sub in _first(request.get("firstAvailable")):
            yield _Request(f"{name}/{_name(sub.get('name'))}", sub)


def _count(spec: JsonObject) -> int:
    if spec.get("allocationMode") == "All":
        return ALL
    count = spec.get("count", 1)
    return min(max(count, 1), ALL) if isinstance(count, int) and not isinstance(count, bool) else 1


def check_devices(devices: JsonObject, plan: Plan) -> _Judgement:
    """The judgement of a claim's ``spec.devices`` (a template's ``spec.spec.devices``)."""
    judged = _Judgement()
    configs = _configs("", devices.get("config"), judged)
    _constraints(devices.get("constraints"), judged)
    mps_whole: dict[str, int] = {}
    for request in _requests(devices):
        where = f"request {request.name}"
        class_name = _name(request.spec.get("deviceClassName"))
        nvidia = _class(where, class_name, plan, judged)
        _selectors(where, request.spec.get("selectors"), judged, passthrough=plan.passthrough)
        asked = _capacity(where, request.spec, plan, judged)
        if not asked and nvidia:
            _lost_share(where, plan, judged)
        class_configs = plan.class_configs.get(class_name, ())
        effective = [c for c in (*class_configs, *configs) if _applies(c, request.name)]
        decoded = effective[-1].decoded if effective else None
        if not _is_mps(decoded):
            continue
        if request.spec.get("adminAccess") is True:
            judged.add(
                CHANGE,
                f"{where}: MPS on an adminAccess request, which drasil refuses (it would "
                "change the sharing of the claim that holds the device): drop one of the two",
            )
        elif not asked:
            top = request.name.partition("/")[0]
            mps_whole[top] = max(mps_whole.get(top, 0), _count(request.spec))
    if sum(mps_whole.values()) > 1:
        counts = ", ".join(
            f"{name} ({'all' if n >= ALL else n})" for name, n in sorted(mps_whole.items())
        )
        judged.add(
            CHANGE,
            f"one MPS device per claim: {counts} ask MPS on devices allocated whole, and "
            "drasil runs one MPS daemon per device, of which a container reaches one: ask "
            "for each MPS device in a claim of its own",
        )
    return judged


def _class(where: str, class_name: str, plan: Plan, judged: _Judgement) -> bool:
    """Judge the request's DeviceClass; whether it is one of NVIDIA's GPUs or MIG devices
    (offered under the preset, or a class of the user's for them)."""
    if class_name in BLOCKED_CLASSES:
        judged.cannot(f"{where} asks for {class_name}", BLOCKED_CLASSES[class_name])
    elif class_name == VFIO_CLASS:
        judged.relevant = True
        if not plan.passthrough:
            judged.add(CHANGE, f"{where} asks for {class_name}: {PASSTHROUGH}")
        return True
    elif class_name in OFFERED_CLASSES:
        judged.relevant = True
        return True
    elif class_name in plan.classes:
        found = plan.classes[class_name]
        if found is not None:
            judged.absorb(f"{where}: DeviceClass {class_name}: ", found)
            return found.verdict != BLOCKED
    elif class_name.endswith(".nvidia.com"):
        judged.add(
            CHANGE,
            f"{where} asks for DeviceClass {class_name}, which drasil does not offer (it "
            f"offers {', '.join(sorted(OFFERED_CLASSES))}) and the cluster does not have",
        )
    return False


def _capacity(where: str, spec: JsonObject, plan: Plan, judged: _Judgement) -> bool:
    """Judge ``capacity.requests``; whether the request asks a share at all."""
    requests = mapping(mapping(spec.get("capacity")).get("requests"))
    keys = list(islice(requests, MAX_ITEMS))
    names = [_name(key).removeprefix(f"{DRIVER}/") for key in keys]
    for key, name in zip(keys, names, strict=True):
        if name == "shares":
            judged.cannot(f"{where} asks capacity shares", SHARES)
        elif name not in SHARED_CAPACITY:
            judged.add(
                CHANGE,
                f"{where} asks capacity {name}, which drasil does not share (it shares "
                "memory and computePercent)",
            )
        elif not plan.consumable:
            judged.add(
                CHANGE,
                f"{where} asks capacity {name} (a share of a GPU): set the chart value "
                "gpuSharing: consumable",
            )
        elif name == "memory":
            amount = _quantity(requests.get(key))
            if amount is None:
                judged.add(CHANGE, f"{where}: capacity memory is not a quantity")
            elif amount % MEMORY_STEP:
                judged.add(
                    "",
                    f"{where}: memory is rounded up to whole Gi (drasil's steps), and at least the "
                    "policy's minimum",
                )
    asked = bool(names)
    if asked and plan.consumable and set(names) <= SHARED_CAPACITY:
        judged.add(
            "", f"{where}: on drasil the share is an MPS client held to its memory and compute"
        )
    return asked


def _lost_share(where: str, plan: Plan, judged: _Judgement) -> None:
    if plan.nvidia_sharing == "integer":
        was = "one of the N shares of a GPU (--consumable-shares=N)"
    elif plan.nvidia_sharing == "unlimited":
        was = "a share of no memory (--consumable-shares=unlimited)"
    else:
        return
    judged.add(
        CHANGE,
        f"{where} took {was} on NVIDIA's driver, and gets the whole device on drasil: ask "
        "capacity.requests.memory with gpuSharing: consumable to keep sharing",
    )


def _generated(obj: JsonObject) -> bool:
    """A claim kube-controller-manager made for a Pod from a template: judged there."""
    raw = mapping(obj.get("metadata"))
    if "resource.kubernetes.io/pod-claim-name" in mapping(raw.get("annotations")):
        return True
    return any(
        o.get("controller") is True and o.get("kind") == "Pod"
        for o in _first(raw.get("ownerReferences"))
    )


def check_claim(obj: JsonObject, plan: Plan) -> Finding | None:
    """A ResourceClaim's verdict; None when it uses no NVIDIA device."""
    namespace, name = _meta(obj)
    judged = check_devices(mapping(mapping(obj.get("spec")).get("devices")), plan)
    return judged.finding("ResourceClaim", namespace, name) if judged.relevant else None


def check_template(obj: JsonObject, plan: Plan) -> Finding | None:
    """A ResourceClaimTemplate's verdict; None when it uses no NVIDIA device."""
    namespace, name = _meta(obj)
    spec = mapping(mapping(obj.get("spec")).get("spec"))
    judged = check_devices(mapping(spec.get("devices")), plan)
    return judged.finding("ResourceClaimTemplate", namespace, name) if judged.relevant else None


def check_compute_domain(obj: JsonObject) -> Finding:
    namespace, name = _meta(obj)
    return Finding("ComputeDomain", namespace, name, BLOCKED, (COMPUTE_DOMAINS,))


# --- workloads -------------------------------------------------------------------------

KINDS: Final = ("Deployment", "StatefulSet", "Job")


def workloads(
    pods: Sequence[JsonObject], controllers: Mapping[str, Sequence[JsonObject]]
) -> Iterator[tuple[str, JsonObject, JsonObject]]:
    """(kind, object, Pod spec) of the Pods no controller owns and of each Deployment,
    StatefulSet and Job."""
    for pod in pods:
        if not isinstance(pod, Mapping):
            continue
        owners = _first(mapping(pod.get("metadata")).get("ownerReferences"))
        if not any(o.get("controller") is True for o in owners):
            yield "Pod", pod, mapping(pod.get("spec"))
    for kind in KINDS:
        for obj in controllers.get(kind, ()):
            if isinstance(obj, Mapping):
                template = mapping(mapping(obj.get("spec")).get("template"))
                yield kind, obj, mapping(template.get("spec"))


def check_workload(
    kind: str,
    obj: JsonObject,
    spec: JsonObject,
    plan: Plan,
    judged: Mapping[tuple[str, str, str], Finding | None],
) -> Finding | None:
    """A workload's verdict: the worst of the claims and templates it uses (``judged``:
    (kind, namespace, name) -> their findings) and of the NVIDIA extended resources it
    asks for; None when it uses neither."""
    namespace, name = _meta(obj)
    found = _Judgement()
    for entry in _first(spec.get("resourceClaims")):
        for key, what in (
            ("resourceClaimName", "ResourceClaim"),
            ("resourceClaimTemplateName", "ResourceClaimTemplate"),
        ):
            target = _name(entry.get(key))
            if not target:
                continue
            ref = (what, namespace, target)
            if ref not in judged:
                found.add(CHANGE, f"uses {what} {target}, which was not found: not judged")
            elif (finding := judged[ref]) is not None:
                found.absorb(f"{what} {target}: ", finding)
    for resource in _extended(spec):
        _resource(resource, plan, found)
    return found.finding(kind, namespace, name) if found.relevant else None


def _extended(spec: JsonObject) -> list[str]:
    names: set[str] = set()
    for key in ("initContainers", "containers"):
        for container in _first(spec.get(key)):
            resources = mapping(container.get("resources"))
            for part in ("limits", "requests"):
                asked = islice(mapping(resources.get(part)), MAX_ITEMS)
                names.update(_name(k) for k in asked if text(k).startswith("nvidia.com/"))
    return sorted(names)


def _resource(resource: str, plan: Plan, found: _Judgement) -> None:
    class_name = plan.extended.get(resource)
    if class_name is not None:
        finding = plan.classes.get(class_name)
        found.relevant = True
        if finding is not None:
            found.absorb(f"asks for {resource}: DeviceClass {class_name}: ", finding)
    elif resource.startswith("nvidia.com/mig-"):
        # A resource name has no "+": NVIDIA writes 1g.10gb+me as mig-1g.10gb.me.
        profile = _PLUS.sub(r"\1+", resource.removeprefix("nvidia.com/mig-"))
        found.add(
            CHANGE,
            f"asks for {resource}, which no DeviceClass stands for: create one that selects "
            f"mig devices of profile {profile} with extendedResourceName {resource}",
        )
    else:
        found.add(
            BLOCKED,
            f"asks for {resource}, which no DeviceClass stands for and drasil does not serve "
            "(a device plugin's resource: see drasil migrate check --from device-plugin)",
        )


# --- everything ------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    objects: tuple[Finding, ...]
    workloads: tuple[Finding, ...]
    plan: Plan


def _sorted(found: Iterable[Finding]) -> tuple[Finding, ...]:
    return tuple(sorted(found, key=lambda f: (-ORDER[f.verdict], f.kind, f.namespace, f.name)))


def check_all(
    *,
    plan: Plan,
    claims: Sequence[JsonObject] = (),
    templates: Sequence[JsonObject] = (),
    compute_domains: Sequence[JsonObject] = (),
    pods: Sequence[JsonObject] = (),
    controllers: Mapping[str, Sequence[JsonObject]] | None = None,
) -> Result:
    """Every NVIDIA object's verdict (the user's DeviceClasses, the claims no Pod's
    template made, the templates, ComputeDomains), and every workload's that uses one."""
    judged: dict[tuple[str, str, str], Finding | None] = {}
    found: list[Finding] = [f for f in plan.classes.values() if f is not None]
    for obj in claims:
        if isinstance(obj, Mapping):
            namespace, name = _meta(obj)
            judged[("ResourceClaim", namespace, name)] = finding = check_claim(obj, plan)
            if finding is not None and not _generated(obj):
                found.append(finding)
    for obj in templates:
        if isinstance(obj, Mapping):
            namespace, name = _meta(obj)
            judged[("ResourceClaimTemplate", namespace, name)] = finding = check_template(obj, plan)
            if finding is not None:
                found.append(finding)
    found += [check_compute_domain(o) for o in compute_domains if isinstance(o, Mapping)]
    used = [
        finding
        for kind, obj, spec in workloads(pods, controllers or {})
        if (finding := check_workload(kind, obj, spec, plan, judged)) is not None
    ]
    return Result(_sorted(found), _sorted(used), plan)


def _counts(findings: Sequence[Finding]) -> str:
    counts = Counter(f.verdict for f in findings)
    return ", ".join(f"{verdict} {counts.get(verdict, 0)}" for verdict in ORDER)


def report(result: Result) -> str:
    """The text ``drasil migrate check --from nvidia-dra`` prints: the objects, the
    workloads (tab-separated, blocked first) and a summary."""
    lines = ["OBJECT\tVERDICT\tWHY"]
    lines += [f"{f.ref}\t{f.verdict}\t{'; '.join(f.reasons) or '-'}" for f in result.objects]
    lines += ["", "WORKLOAD\tVERDICT\tWHY"]
    lines += [f"{f.ref}\t{f.verdict}\t{'; '.join(f.reasons) or '-'}" for f in result.workloads]
    plan = result.plan
    sharing = "consumable" if plan.consumable else "exclusive"
    seen = f"; NVIDIA's consumable shares: {plan.nvidia_sharing}" if plan.nvidia_sharing else ""
    lines += [
        "",
        f"objects: {len(result.objects)} ({_counts(result.objects)})",
        f"workloads: {len(result.workloads)} ({_counts(result.workloads)})",
        f"judged for: compatibility nvidia-dra, gpuSharing {sharing}, passthrough "
        f"{'on' if plan.passthrough else 'off'}{seen}",
    ]
    if not plan.compatibility:
        lines.append("the values do not set compatibility: nvidia-dra, which all of this needs")
    return "\n".join(lines) + "\n"

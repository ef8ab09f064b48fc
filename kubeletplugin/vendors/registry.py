"""The vendors a node serves, found and opened: drasil's own, and installed ones.

drasil's vendors are named in ``BUILT_IN`` (``--vendors`` name → the module whose
``SOURCE`` is the vendor's ``VendorSource``); a module is imported only when its vendor
is asked for, detected, or named by a simulated profile, so an AMD-only node never
imports NVML. A vendor from another package registers itself with an entry point in
the group ``drasil.vendors`` (name: its ``--vendors`` name, value: ``module:SOURCE``):
no line of drasil changes for it.

``--vendors auto`` asks every vendor whether its kernel driver is loaded here;
``--backend simulated`` gives each profile entry to the vendor that simulates its
model (an entry no vendor has goes to ``DEFAULT_SIMULATED``, whose error names it).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import replace
from typing import Final, cast

from drasil.driver.devices import VendorError
from drasil.kubeletplugin.options import AUTO_VENDORS, BACKENDS, VENDORS, PluginOptions
from drasil.kubeletplugin.vendors.installed import installed as _installed
from drasil.kubeletplugin.vendors.seam import NodeVendor, VendorSource

log = logging.getLogger(__name__)

BUILT_IN: Final = {
    "nvidia": "drasil.kubeletplugin.vendors.nvidia.node",
    "amd": "drasil.kubeletplugin.vendors.amd.node",
}
DEFAULT_SIMULATED: Final = "nvidia"
assert tuple(BUILT_IN) == VENDORS  # --vendors' names (kubeletplugin.options)


def installed() -> dict[str, str]:
    """Vendors other packages register (entry point name → ``module:attribute``)."""
    return _installed(built_in=VENDORS)


def vendor_names(*, with_installed: bool = True) -> tuple[str, ...]:
    """Every ``--vendors`` name this installation can serve."""
    return (*BUILT_IN, *(installed() if with_installed else {}))


def source(name: str) -> VendorSource:
    """The vendor ``name``; ``VendorError`` naming the known ones if none is."""
    if name in BUILT_IN:
        return cast(VendorSource, importlib.import_module(BUILT_IN[name]).SOURCE)
    target = installed().get(name)
    if target is None:
        raise VendorError(
            f"--vendors: no vendor {name!r} is installed; known: {', '.join(vendor_names())}"
        )
    module, _, attribute = target.partition(":")
    return cast(VendorSource, getattr(importlib.import_module(module), attribute or "SOURCE"))


def open_vendors(opts: PluginOptions) -> tuple[PluginOptions, tuple[NodeVendor, ...]]:
    """The node's vendors, and the options with the vendors served (``auto``'s, or a
    simulated profile's) in place of the ones asked for. Raises ``VendorError``."""
    if opts.backend == "simulated":
        opened = _simulated(opts)
    elif opts.backend != "nvml":
        raise ValueError(
            f"--backend: unsupported value {opts.backend!r}; allowed values are {BACKENDS}"
        )
    else:
        names = _detected(opts) if opts.vendors == (AUTO_VENDORS,) else opts.vendors
        # Each vendor is opened with the vendors served, not ``auto``: what it reads of
        # the options (NVIDIA's driver root) must see itself served.
        served_opts = replace(opts, vendors=tuple(names))
        opened = tuple(source(name).open(served_opts, simulated=None) for name in names)
    served = tuple(v.vendor.value for v in opened)
    log.info("serving GPU vendors", extra={"vendors": served})
    return replace(opts, vendors=served), opened


def _detected(opts: PluginOptions) -> tuple[str, ...]:
    sources = {name: source(name) for name in vendor_names()}
    found = tuple(name for name, s in sources.items() if s.detect(opts))
    if not found:
        looked = " and ".join(s.where_detected(opts) for s in sources.values())
        raise VendorError(
            f"--vendors auto: no GPU driver found: {looked}; install a driver, or name "
            "the vendors with --vendors"
        )
    return found


def _simulated(opts: PluginOptions) -> tuple[NodeVendor, ...]:
    """Each vendor of the profile opened on its entries, in ``vendor_names`` order.

    The default vendor is loaded only for entries no other built-in vendor has (an
    AMD-only profile never imports NVIDIA's module), installed vendors only for
    entries no built-in vendor has."""
    entries = [part.strip() for part in opts.simulated_profile.split(",") if part.strip()]
    loaded = {name: source(name) for name in BUILT_IN if name != DEFAULT_SIMULATED}
    owners = {entry: _owner(entry, loaded) for entry in entries}
    if not entries or None in owners.values():
        default = loaded[DEFAULT_SIMULATED] = source(DEFAULT_SIMULATED)
        if any(o is None and not default.simulates(_model(e)) for e, o in owners.items()):
            loaded.update({name: source(name) for name in installed()})
            owners = {e: o or _owner(e, loaded) for e, o in owners.items()}
    given: dict[str, list[str]] = {}
    for entry, owner in owners.items():
        given.setdefault(owner or DEFAULT_SIMULATED, []).append(entry)
    if not entries:  # an empty profile gets the default vendor's error, naming its models
        given[DEFAULT_SIMULATED] = []
    order = (*(n for n in BUILT_IN if n in given), *(n for n in given if n not in BUILT_IN))
    served_opts = replace(opts, vendors=order)  # the profile's vendors, as with ``auto``
    return tuple(
        _open_simulated(name, loaded, ",".join(given[name]), served_opts) for name in order
    )


def _owner(entry: str, loaded: dict[str, VendorSource]) -> str | None:
    """The vendor other than the default that simulates the entry's model."""
    model = _model(entry)
    others = (n for n, s in loaded.items() if n != DEFAULT_SIMULATED and s.simulates(model))
    return next(others, None)


def _open_simulated(
    name: str, sources: dict[str, VendorSource], entries: str, opts: PluginOptions
) -> NodeVendor:
    try:
        return sources[name].open(opts, simulated=entries)
    except ValueError as err:
        if name != DEFAULT_SIMULATED:
            raise VendorError(f"profile spec {opts.simulated_profile!r}: {err}") from None
        others = "; ".join(
            f"{s.vendor.value.upper()} models: {', '.join(s.simulated_models())}"
            for n, s in sources.items()
            if n != name
        )
        raise VendorError(f"{err}; {others}" if others else str(err)) from None


def _model(entry: str) -> str:
    return entry.partition(":")[0].strip()

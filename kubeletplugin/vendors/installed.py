"""Vendors other packages register: entry points of the group ``drasil.vendors``.

An entry point's name is the vendor's ``--vendors`` name, its value the
``module:attribute`` of its ``VendorSource`` (``kubeletplugin.vendors.seam``). Reading
them imports nothing; ``vendors.registry`` imports one when its vendor is served.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Final

ENTRY_POINT_GROUP: Final = "drasil.vendors"


def installed(*, built_in: tuple[str, ...] = ("nvidia", "amd")) -> dict[str, str]:
    """Entry point name → ``module:attribute``, drasil's own names left out."""
    return {
        ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in built_in
    }

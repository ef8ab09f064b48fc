"""DeviceTaintRules (KEP-5055, ``resource.k8s.io/v1`` since 1.37): taints an operator puts
on devices without touching the driver's slices.

The scheduler treats a rule's taint exactly like a taint in the slice, so the
explanation does too, but names the rule: an operator who drained ``gpu-3`` with a rule
reads ``gpu-3 tainted by DeviceTaintRule drain-gpu-3 (NoSchedule)`` rather than a taint
key they have to trace back to some object.

In v1 ``spec.deviceSelector`` has only ``driver``, ``pool`` and ``device``; each one
set must match. An empty selector matches every device, a missing one none (the field
documentation of ``DeviceTaintSelector``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from drasil.driver.explain.counters import listing
from drasil.driver.explain.inventory import InventoryDevice, object_spec
from drasil.driver.explain.nodefit import BLOCKING_EFFECTS, tolerated
from drasil.driver.objects import JsonObject, meta

MAX_DEVICES_NAMED = 3


@dataclass(frozen=True)
class RuleTaint:
    """One DeviceTaintRule: its name, what it selects, its taint."""

    rule: str
    selector: JsonObject
    taint: JsonObject

    def selects(self, device: InventoryDevice, *, driver: str) -> bool:
        wanted = {"driver": driver, "pool": device.pool, "device": device.name}
        return all(self.selector.get(k) in (None, "", v) for k, v in wanted.items())

    def text(self) -> str:
        return f"DeviceTaintRule {self.rule} ({self.taint.get('effect')})"


@dataclass(frozen=True)
class TaintRules:
    """The rules that can select devices of ``driver``, in name order (so the same
    device is always reported under the same rule)."""

    driver: str
    rules: tuple[RuleTaint, ...] = ()

    @classmethod
    def of(cls, objects: Iterable[JsonObject], *, driver: str) -> TaintRules:
        rules = [r for r in map(_rule, objects) if r is not None]
        mine = [r for r in rules if r.selector.get("driver") in (None, "", driver)]
        return cls(driver=driver, rules=tuple(sorted(mine, key=lambda r: r.rule)))

    def blocking(
        self, device: InventoryDevice, tolerations: Sequence[JsonObject]
    ) -> RuleTaint | None:
        """The first rule whose taint keeps the request off ``device``."""
        for rule in self.rules:
            effect = rule.taint.get("effect")
            if (
                effect in BLOCKING_EFFECTS
                and rule.selects(device, driver=self.driver)
                and not tolerated(rule.taint, tolerations)
            ):
                return rule
        return None


def _rule(obj: JsonObject) -> RuleTaint | None:
    spec = object_spec(obj)
    selector, taint = spec.get("deviceSelector"), spec.get("taint")
    # Without a selector a rule selects nothing; without a taint it does nothing.
    if not isinstance(selector, Mapping) or not isinstance(taint, Mapping):
        return None
    return RuleTaint(rule=meta(obj).name, selector=selector, taint=taint)


def ruled_text(rule: str, devices: Sequence[str]) -> str:
    """``gpu-3 tainted by DeviceTaintRule drain-gpu-3 (NoSchedule)``."""
    return f"{listing(devices, limit=MAX_DEVICES_NAMED)} tainted by {rule}"

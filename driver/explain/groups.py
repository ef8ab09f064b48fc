"""The PodGroups of a pending claim's Pods: a gang waits for its members, not devices.

kube-scheduler (feature gate ``GenericWorkload``) places the Pods of a gang PodGroup
only together, once ``minCount`` of them can be placed at the same time: until then
every member stays unscheduled and a claim of the group (``DRAWorkloadResourceClaims``)
stays unallocated, whatever devices are free. An explanation names the group of each
waiting Pod, and one that finds devices for every request says that the gang is what
the Pods wait for, rather than calling the wait capacity or a scheduler stall.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from drasil.driver.objects import JsonObject, Pod, PodGroup

Key = tuple[str, str]


@dataclass(frozen=True)
class GroupWait:
    """One PodGroup of the waiting Pods: its gang size and how many members exist."""

    namespace: str
    name: str
    found: bool
    min_count: int | None  # None: not a gang (or not found)
    members: int  # Pods of the namespace that name the group

    @property
    def incomplete(self) -> bool:
        """A gang with fewer members than its minCount: none of them can be placed."""
        return self.min_count is not None and self.members < self.min_count

    def describe(self) -> str:
        where = f"PodGroup {self.namespace}/{self.name}"
        if not self.found:
            return f"{where} (not found)"
        if self.min_count is None:
            return where
        return f"{where} (a gang of minCount {self.min_count}; {self.members} of its Pods exist)"


def pod_groups(pods: Iterable[JsonObject]) -> list[Key]:
    """The (namespace, PodGroup) of each Pod that is scheduled in one, once each."""
    found = {(Pod(p).meta.namespace, Pod(p).pod_group) for p in pods}
    return sorted(key for key in found if key[1])


def group_waits(
    groups: Mapping[Key, JsonObject | None], members: Mapping[Key, int]
) -> list[GroupWait]:
    """What the PodGroups ``groups`` (read from the API; None: not found) wait for."""
    return [
        GroupWait(
            namespace=key[0],
            name=key[1],
            found=obj is not None,
            min_count=None if obj is None else PodGroup(obj).min_count,
            members=members.get(key, 0),
        )
        for key, obj in sorted(groups.items())
    ]


def gang_message(waits: Iterable[GroupWait]) -> str | None:
    """Why a claim with devices for every request stays pending: incomplete gangs."""
    incomplete = [w for w in waits if w.incomplete]
    if not incomplete:
        return None
    names = "; ".join(w.describe() for w in incomplete)
    return (
        f"devices exist for every request, but kube-scheduler places the Pods of {names} "
        "only together, once minCount of them can be placed at the same time. The wait "
        "is the gang's, not capacity: create the missing Pods or lower minCount"
    )


def with_groups(message: str, waits: Iterable[GroupWait]) -> str:
    """``message`` naming the PodGroups of the waiting Pods, if any."""
    named = "; ".join(w.describe() for w in waits)
    return f"{message} (Pods in {named})" if named else message

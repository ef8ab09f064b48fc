"""Prepared claims' specs follow the driver's files (kubeletplugin/dra/specrefresh.py).

A driver upgraded under running Pods: a container that restarts is created from the
spec written at prepare, so that spec must name the new files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubelet_client import (
    MemoryClaims,
    claim_json,
    make_preparer,
    ref_of,
    result,
    spec_file,
)

from drasil.driver.cdi.spec import ContainerEdits, Hook, Mount, common_edits_dict
from drasil.driver.nvidia.driverfiles import DriverFilesError
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.dra.specrefresh import SpecRefresher

UID_A = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
UID_B = "1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f9"
LIB = "/usr/lib/x86_64-linux-gnu"


def driver(version: str) -> ContainerEdits:
    """The spec-wide edits of a driver root holding `version`."""
    return ContainerEdits(
        mounts=(Mount(f"{LIB}/libcuda.so.{version}", f"{LIB}/libcuda.so.{version}", ("ro",)),),
        hooks=(Hook("/usr/bin/nvidia-cdi-hook", ("nvidia-cdi-hook", "update-ldcache")),),
    )


@dataclass
class FakeFiles:
    version: str


class DriverOnDisk:
    """Stands for NodeEdits: the same edits object until the files change."""

    def __init__(self, version: str) -> None:
        self.upgrade(version)
        self.broken: str | None = None

    def upgrade(self, version: str) -> None:
        self.edits, self.files = driver(version), FakeFiles(version)

    def current(self) -> ContainerEdits:
        if self.broken:
            raise DriverFilesError(self.broken)
        return self.edits

    def files_version(self) -> str:
        return self.files.version


def prepared(tmp_path: Path, disk: DriverOnDisk, *uids: str) -> Preparer:
    claims = [claim_json(uid, result(f"gpu-{i}")) for i, uid in enumerate(uids)]
    preparer = make_preparer(tmp_path, MemoryClaims(*claims))
    preparer.node_edits = disk  # type: ignore[assignment]
    for claim in claims:
        assert preparer.prepare(ref_of(claim)).error == ""
    return preparer


def spec(tmp_path: Path, uid: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(spec_file(tmp_path, uid).read_text())
    return loaded


def test_an_upgraded_driver_gives_every_prepared_claims_spec_the_new_files(
    tmp_path: Path,
) -> None:
    disk = DriverOnDisk("580.95.05")
    preparer = prepared(tmp_path, disk, UID_A, UID_B)
    before = {uid: spec(tmp_path, uid) for uid in (UID_A, UID_B)}
    told: list[tuple[str, int]] = []
    refresher = SpecRefresher(preparer, on_change=lambda v, n: told.append((v, n)))
    assert refresher.check() == 0  # nothing changed since the prepares
    assert refresher.check() == 0

    disk.upgrade("590.44.01")
    assert refresher.check() == 2
    assert told == [("590.44.01", 2)]
    for uid in (UID_A, UID_B):
        after = spec(tmp_path, uid)
        assert after["containerEdits"] == common_edits_dict(driver("590.44.01"))
        assert after["devices"] == before[uid]["devices"]  # the claim's devices untouched
        assert after["annotations"] == before[uid]["annotations"]
    assert refresher.check() == 0  # once per change
    assert told == [("590.44.01", 2)]


def test_a_driver_in_the_middle_of_its_upgrade_leaves_the_specs_until_it_is_whole(
    tmp_path: Path,
) -> None:
    disk = DriverOnDisk("580.95.05")
    preparer = prepared(tmp_path, disk, UID_A)
    written = spec(tmp_path, UID_A)
    refresher = SpecRefresher(preparer, on_change=lambda v, n: None)
    disk.broken = "driver root / holds no NVIDIA driver libraries"
    assert refresher.check() == 0
    assert spec(tmp_path, UID_A) == written
    disk.broken = None
    disk.upgrade("590.44.01")
    assert refresher.check() == 1


def test_specs_of_no_recorded_claim_and_without_driver_edits_are_left_alone(
    tmp_path: Path,
) -> None:
    disk = DriverOnDisk("580.95.05")
    preparer = prepared(tmp_path, disk, UID_A, UID_B)
    # UID_B unprepared by another plugin instance between the listing and the rewrite
    # would have left its spec gone; here its record alone is gone.
    with preparer.state_lock():
        preparer.store.remove(UID_B)
    stray = spec(tmp_path, UID_B)
    # A claim of no NVIDIA device carries no spec-wide edits.
    no_driver = {**spec(tmp_path, UID_A), "containerEdits": {}}
    spec_file(tmp_path, UID_A).write_text(json.dumps(no_driver))
    disk.upgrade("590.44.01")
    assert SpecRefresher(preparer, on_change=lambda v, n: None).check() == 0
    assert spec(tmp_path, UID_B) == stray
    assert spec(tmp_path, UID_A) == no_driver


def test_a_refresher_started_after_the_upgrade_rewrites_at_its_first_look(
    tmp_path: Path,
) -> None:
    disk = DriverOnDisk("580.95.05")
    preparer = prepared(tmp_path, disk, UID_A)
    disk.upgrade("590.44.01")  # the plugin was down meanwhile
    assert SpecRefresher(preparer, on_change=lambda v, n: None).check() == 1
    assert spec(tmp_path, UID_A)["containerEdits"] == common_edits_dict(driver("590.44.01"))

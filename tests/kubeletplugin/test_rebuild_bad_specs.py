"""A lost checkpoint rebuilt from the CDI specs: one damaged spec (not JSON, not a
regular file, no device list) is skipped, the others are rebuilt, and the plugin
starts; the stale-claim pass deletes the damaged one later.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from kubelet_client import MemoryClaims, claim_json, make_preparer, ref_of, result, spec_file

from drasil.driver.checkpoint import CHECKPOINT_DIR
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.dra.reconcile import rebuild_from_specs, reconcile

UID_A = "0b7c3f2e-8d1a-4c55-9e0f-1a2b3c4d5e6f"
UID_B = "1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f9"


def not_json(path: Path) -> None:
    path.write_text("{not json")


def devices_not_a_list(path: Path) -> None:
    spec = json.loads(path.read_bytes())
    spec["devices"] = "gpu-1"
    path.write_text(json.dumps(spec))


def symlink_to_a_spec(path: Path) -> None:
    target = path.parent.parent / "elsewhere.json"
    path.rename(target)
    path.symlink_to(target)


DAMAGES: dict[str, Callable[[Path], None]] = {
    "not-json": not_json,
    "devices-not-a-list": devices_not_a_list,
    "symlink": symlink_to_a_spec,
}


def two_prepared_then_lost(tmp_path: Path) -> tuple[Preparer, MemoryClaims]:
    claims = [
        claim_json(UID_A, result("gpu-0"), name="a"),
        claim_json(UID_B, result("gpu-1"), name="b"),
    ]
    reader = MemoryClaims(*claims)
    first = make_preparer(tmp_path, reader)
    for claim in claims:
        assert first.prepare(ref_of(claim)).error == ""
    shutil.rmtree(tmp_path / "state" / CHECKPOINT_DIR)
    return make_preparer(tmp_path, reader), reader


@pytest.mark.timeout(20)
@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_one_damaged_spec_is_skipped_and_the_others_rebuilt(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    preparer, reader = two_prepared_then_lost(tmp_path)
    DAMAGES[damage](spec_file(tmp_path, UID_B))

    with caplog.at_level(logging.WARNING):
        assert rebuild_from_specs(preparer) == 1

    assert list(preparer.store.claims()) == [UID_A]
    assert "skipped" in caplog.text
    # No entry accounts for the damaged spec: the stale-claim pass deletes it (the link
    # itself, not its target), and the claim's next prepare writes it again.
    reconcile(preparer, reader)
    assert not os.path.lexists(spec_file(tmp_path, UID_B))
    assert preparer.prepare(ref_of(claim_json(UID_B, result("gpu-1"), name="b"))).error == ""
    assert spec_file(tmp_path, UID_B).is_file()


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def fifo_behind_a_symlink(path: Path) -> None:
    fifo = path.parent.parent / "fifo"
    os.mkfifo(fifo)
    path.symlink_to(fifo)


NOT_FILES: dict[str, Callable[[Path], None]] = {
    "directory": Path.mkdir,
    "fifo": make_fifo,
    "fifo-behind-symlink": fifo_behind_a_symlink,
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", sorted(NOT_FILES))
def test_an_entry_that_is_no_file_is_not_listed(tmp_path: Path, kind: str) -> None:
    preparer, _ = two_prepared_then_lost(tmp_path)
    spec_file(tmp_path, UID_B).unlink()
    NOT_FILES[kind](spec_file(tmp_path, UID_B))
    assert rebuild_from_specs(preparer) == 1
    assert list(preparer.store.claims()) == [UID_A]

"""Crash recovery of prepare and unprepare, with real processes killed at each step.

A child process builds a Preparer and runs one call with ``DRASIL_CRASH_AT`` set, so
it dies (status 137, as after SIGKILL) at that point. A fresh Preparer on the same
directories then repeats the call, as kubelet would. The end state must equal a
crash-free run's: the same CDI spec bytes, the same checkpoint entry, and after
unprepare nothing at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kubelet_client import FileClaims, claim_json, make_preparer, result, spec_file

from drasil.api.checkpoint import ClaimState
from drasil.driver.checkpoint import CHECKPOINT_DIR
from drasil.driver.checkpointdisk import GENERATION, read_state
from drasil.driver.claims.plan import ClaimRef
from drasil.driver.files import CRASH_ENV, CRASH_EXIT_CODE

UID = "0b7c3f2e-8d1a-4c55-9e0f-1a2b3c4d5e6f"
REF = ClaimRef(namespace="ml", name="train", uid=UID)
CLAIM = claim_json(
    UID,
    result("gpu-2", request="a"),
    result("gpu-0", request="b/full"),
    name="train",
    namespace="ml",
)

CHILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from kubelet_client import FileClaims, make_preparer
from drasil.driver.claims.plan import ClaimRef

root = Path(sys.argv[2])
ref = ClaimRef(namespace=sys.argv[4], name=sys.argv[5], uid=sys.argv[6])
preparer = make_preparer(root, FileClaims(root / "claims"))
if sys.argv[3] == "prepare":
    print(json.dumps({"error": preparer.prepare(ref).error}))
else:
    print(json.dumps({"error": preparer.unprepare(ref)}))
"""


def child(root: Path, operation: str, crash_at: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    if crash_at is not None:
        env[CRASH_ENV] = crash_at
    return subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(Path(__file__).parent),
            str(root),
            operation,
            REF.namespace,
            REF.name,
            REF.uid,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def setup_root(root: Path) -> Path:
    FileClaims(root / "claims").put(CLAIM)
    return root


def checkpoint_entry(root: Path) -> dict[str, Any] | None:
    """The claim's entry as stored, read without a store (a load sweeps temp files)."""
    state = read_state(root / "state" / CHECKPOINT_DIR)
    record = state.claims.get(UID) if state is not None else None
    return record.model_dump(mode="json") if record is not None else None


def temp_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*.tmp"))


def leftovers(root: Path) -> list[str]:
    cdi = sorted(p.name for p in (root / "cdi").iterdir())
    # Files only: the metadata directory itself may stay, empty.
    state = sorted(
        str(p.relative_to(root / "state")) for p in (root / "state").rglob("*") if p.is_file()
    )
    # The checkpoint's own files: its claim files are checked through read_state.
    kept = {"checkpoint.lock", f"{CHECKPOINT_DIR}/{GENERATION}"}
    return cdi + [n for n in state if n not in kept] + temp_files(root)


def spec_bytes(root: Path) -> bytes:
    """The spec with the root replaced: its metadata mounts name host paths under it."""
    return spec_file(root, UID).read_bytes().replace(str(root).encode(), b"<root>")


def metadata_files(root: Path) -> dict[str, bytes]:
    base = root / "state" / "dra-device-metadata"
    return {str(p.relative_to(base)): p.read_bytes() for p in base.rglob("*") if p.is_file()}


@pytest.fixture
def reference(tmp_path: Path) -> dict[str, Any]:
    """What a crash-free prepare leaves behind."""
    root = setup_root(tmp_path / "reference")
    preparer = make_preparer(root, FileClaims(root / "claims"))
    outcome = preparer.prepare(REF)
    assert outcome.error == ""
    record = preparer.store.get(UID)
    assert record is not None
    return {
        "devices": outcome.devices,
        "spec": spec_bytes(root),
        "metadata": metadata_files(root),
        "record": (record.namespace, record.name, record.state, record.devices),
    }


def assert_like_reference(root: Path, reference: dict[str, Any], devices: object) -> None:
    assert devices == reference["devices"]
    assert spec_bytes(root) == reference["spec"]
    assert metadata_files(root) == reference["metadata"]
    store = make_preparer(root, FileClaims(root / "claims")).store
    record = store.get(UID)
    assert record is not None
    assert (record.namespace, record.name, record.state, record.devices) == reference["record"]
    assert record.state == ClaimState.PREPARE_COMPLETED
    assert temp_files(root) == []


def test_a_child_without_crash_matches_the_reference(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    root = setup_root(tmp_path / "child")
    done = child(root, "prepare", None)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"error": ""}
    preparer = make_preparer(root, FileClaims(root / "claims"))
    assert_like_reference(root, reference, preparer.prepare(REF).devices)


# (crash point, spec exists after the crash, checkpoint state after the crash, temp file)
PREPARE_CRASHES = [
    ("checkpoint-mid-write", False, None, True),
    ("checkpoint-before-rename", False, None, True),
    ("prepare-after-started", False, ClaimState.PREPARE_STARTED, False),
    ("metadata-mid-write", False, ClaimState.PREPARE_STARTED, True),
    ("metadata-after-rename", False, ClaimState.PREPARE_STARTED, False),
    ("cdi-mid-write", False, ClaimState.PREPARE_STARTED, True),
    ("cdi-before-rename", False, ClaimState.PREPARE_STARTED, True),
    ("cdi-after-rename", True, ClaimState.PREPARE_STARTED, False),
    ("prepare-after-cdi", True, ClaimState.PREPARE_STARTED, False),
    ("prepare-after-completed", True, ClaimState.PREPARE_COMPLETED, False),
]


@pytest.mark.parametrize(
    ("point", "spec_after_crash", "state_after_crash", "temp_after_crash"),
    PREPARE_CRASHES,
    ids=[p[0] for p in PREPARE_CRASHES],
)
def test_prepare_after_a_crash_ends_like_a_crash_free_run(
    tmp_path: Path,
    reference: dict[str, Any],
    point: str,
    spec_after_crash: bool,
    state_after_crash: ClaimState | None,
    temp_after_crash: bool,
) -> None:
    root = setup_root(tmp_path / "crashed")
    crashed = child(root, "prepare", point)
    assert crashed.returncode == CRASH_EXIT_CODE, crashed.stderr
    assert crashed.stdout == ""
    # The child died where it was told to.
    assert spec_file(root, UID).exists() == spec_after_crash
    entry = checkpoint_entry(root)
    assert (entry["state"] if entry else None) == state_after_crash
    assert bool(temp_files(root)) == temp_after_crash

    # kubelet retries; a new plugin process answers.
    preparer = make_preparer(root, FileClaims(root / "claims"))
    outcome = preparer.prepare(REF)
    assert outcome.error == ""
    assert_like_reference(root, reference, outcome.devices)

    assert preparer.unprepare(REF) == ""
    assert checkpoint_entry(root) is None
    assert leftovers(root) == []


# (crash point, spec exists after the crash, entry exists after the crash, temp file)
UNPREPARE_CRASHES = [
    ("cdi-before-remove", True, True, False),
    ("unprepare-after-cdi", False, True, False),
    ("metadata-before-remove", False, True, False),
    ("checkpoint-mid-write", False, True, True),
    ("checkpoint-after-rename", False, False, False),
]


@pytest.mark.parametrize(
    ("point", "spec_after_crash", "entry_after_crash", "temp_after_crash"),
    UNPREPARE_CRASHES,
    ids=[p[0] for p in UNPREPARE_CRASHES],
)
def test_unprepare_after_a_crash_leaves_nothing(
    tmp_path: Path,
    reference: dict[str, Any],
    point: str,
    spec_after_crash: bool,
    entry_after_crash: bool,
    temp_after_crash: bool,
) -> None:
    root = setup_root(tmp_path / "crashed")
    outcome = make_preparer(root, FileClaims(root / "claims")).prepare(REF)
    assert_like_reference(root, reference, outcome.devices)

    crashed = child(root, "unprepare", point)
    assert crashed.returncode == CRASH_EXIT_CODE, crashed.stderr
    assert spec_file(root, UID).exists() == spec_after_crash
    assert (checkpoint_entry(root) is not None) == entry_after_crash
    assert bool(temp_files(root)) == temp_after_crash

    preparer = make_preparer(root, FileClaims(root / "claims"))
    assert preparer.unprepare(REF) == ""
    assert preparer.store.get(UID) is None
    assert checkpoint_entry(root) is None
    assert leftovers(root) == []
    # And the claim can be prepared again from scratch, identically.
    assert_like_reference(root, reference, preparer.prepare(REF).devices)

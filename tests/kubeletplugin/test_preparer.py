"""Prepare and unprepare of claims: CDI specs, checkpoint, device reservation, errors.

The claims come from an in-memory ClaimReader (the plugin's own Protocol); what is
asserted is what kubelet and the runtime see: the PrepareResult and the CDI file.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kubelet_client import (
    DEADLINE,
    DRIVER,
    Claim,
    MemoryClaims,
    claim_json,
    gpu_config,
    make_preparer,
    node_devices,
    ref_of,
    result,
    spec_file,
    wait_until,
)

from drasil.api.checkpoint import ClaimState, PreparedDevice
from drasil.driver.cdi.claimspecs import ClaimIdentity, claim_identity
from drasil.driver.claims.plan import ClaimRef
from drasil.driver.files import FileLock
from drasil.kubeletplugin.dra import prepare as prepare_module
from drasil.kubeletplugin.dra.prepare import Preparer, _KeyedLocks

UID_A = "0b7c3f2e-8d1a-4c55-9e0f-1a2b3c4d5e6f"
UID_B = "1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f9"
UID_C = "2a3b4c5d-6e7f-4a8b-9c0d-e1f2a3b4c5d6"
DEVICES = node_devices()
KNOWN = "gpu-0, gpu-1, gpu-2, gpu-3"


def env_of(spec_path: Path) -> dict[str, str]:
    """What a container given every device of the spec sees."""
    spec = json.loads(spec_path.read_text())
    edits = [spec.get("containerEdits") or {}, *(d["containerEdits"] for d in spec["devices"])]
    return dict(item.split("=", 1) for e in edits for item in e.get("env", []))


def setup(tmp_path: Path, *claims: Claim) -> tuple[Preparer, MemoryClaims]:
    reader = MemoryClaims(*claims)
    return make_preparer(tmp_path, reader), reader


# ---- success ------------------------------------------------------------------------


def test_prepare_writes_the_cdi_spec_and_returns_cdi_ids(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-1"), name="train", namespace="ml")
    preparer, _ = setup(tmp_path, claim)

    outcome = preparer.prepare(ref_of(claim))

    assert outcome.error == ""
    assert outcome.devices == (
        PreparedDevice(
            request_names=("gpu",),
            pool_name="n1",
            device_name="gpu-1",
            # The device, then its request's KEP-5304 metadata mount.
            cdi_device_ids=(
                f"k8s.gpu.drasil.dev/claim={UID_A}-gpu-1",
                f"k8s.gpu.drasil.dev/claim={UID_A}_gpu",
            ),
        ),
    )
    path = tmp_path / "cdi" / f"k8s.gpu.drasil.dev-claim_{UID_A}.json"
    assert path.is_file()
    env = env_of(path)
    assert env["DRASIL_DEVICE_GPU_1"] == DEVICES["gpu-1"].uuid
    spec = json.loads(path.read_text())
    assert claim_identity(spec) == ClaimIdentity(UID_A, "ml", "train")
    assert spec["kind"] == "k8s.gpu.drasil.dev/claim"
    assert [d["name"] for d in spec["devices"]] == [f"{UID_A}-gpu-1", f"{UID_A}_gpu"]

    record = preparer.store.get(UID_A)
    assert record is not None
    assert record.state == ClaimState.PREPARE_COMPLETED
    assert (record.namespace, record.name) == ("ml", "train")
    assert record.devices == outcome.devices


def test_all_devices_of_a_claim_are_visible_in_order(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-3", request="a"), result("gpu-0", request="b"))
    preparer, _ = setup(tmp_path, claim)
    outcome = preparer.prepare(ref_of(claim))
    assert [(d.device_name, d.request_names) for d in outcome.devices] == [
        ("gpu-3", ("a",)),
        ("gpu-0", ("b",)),
    ]
    spec = json.loads(spec_file(tmp_path, UID_A).read_text())
    assert [d["name"] for d in spec["devices"]] == [
        f"{UID_A}-gpu-3",
        f"{UID_A}-gpu-0",
        f"{UID_A}_a",
        f"{UID_A}_b",
    ]
    env = env_of(spec_file(tmp_path, UID_A))
    assert env["DRASIL_DEVICE_GPU_3"] == DEVICES["gpu-3"].uuid
    assert env["DRASIL_DEVICE_GPU_0"] == DEVICES["gpu-0"].uuid


def test_results_of_other_drivers_are_not_ours(tmp_path: Path) -> None:
    claim = claim_json(
        UID_A, result("gpu-0"), result("nic-0", request="net", driver="net.example.com")
    )
    preparer, _ = setup(tmp_path, claim)
    outcome = preparer.prepare(ref_of(claim))
    assert outcome.error == ""
    assert [d.device_name for d in outcome.devices] == ["gpu-0"]


def test_first_available_subrequest_reports_the_base_request(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-2", request="gpu/full"))
    preparer, _ = setup(tmp_path, claim)
    outcome = preparer.prepare(ref_of(claim))
    assert outcome.error == ""
    assert outcome.devices[0].request_names == ("gpu",)


def test_sharing_config_reaches_the_container_env(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-0"), config=[gpu_config("TimeSlicing")])
    preparer, _ = setup(tmp_path, claim)
    assert preparer.prepare(ref_of(claim)).error == ""
    spec = json.loads(spec_file(tmp_path, UID_A).read_text())
    env = spec["devices"][0]["containerEdits"]["env"]
    assert "DRASIL_DEVICE_GPU_0_SHARING_STRATEGY=TimeSlicing" in env


# ---- repeated calls -------------------------------------------------------------------


def test_repeated_prepare_answers_from_the_checkpoint(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-1"))
    preparer, reader = setup(tmp_path, claim)
    first = preparer.prepare(ref_of(claim))
    assert reader.calls == 1
    spec_bytes = spec_file(tmp_path, UID_A).read_bytes()

    again = preparer.prepare(ref_of(claim))
    assert again == first
    assert reader.calls == 1  # no API call for a prepared claim
    assert spec_file(tmp_path, UID_A).read_bytes() == spec_bytes


def test_repeated_prepare_in_a_new_plugin_instance(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-1"))
    first = setup(tmp_path, claim)[0].prepare(ref_of(claim))
    preparer, reader = setup(tmp_path, claim)  # restarted plugin, same state dir
    assert preparer.prepare(ref_of(claim)) == first
    assert reader.calls == 0


def test_repeated_prepare_recreates_a_wiped_spec(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-1"))
    preparer, reader = setup(tmp_path, claim)
    first = preparer.prepare(ref_of(claim))
    spec_bytes = spec_file(tmp_path, UID_A).read_bytes()

    spec_file(tmp_path, UID_A).unlink()  # /var/run/cdi is tmpfs
    again = preparer.prepare(ref_of(claim))
    assert again == first
    assert reader.calls == 2  # done again from the claim
    assert spec_file(tmp_path, UID_A).read_bytes() == spec_bytes
    record = preparer.store.get(UID_A)
    assert record is not None
    assert record.state == ClaimState.PREPARE_COMPLETED


@pytest.mark.timeout(20)
@pytest.mark.parametrize("damage", ["not json", "directory", "fifo"])
def test_repeated_prepare_rewrites_a_damaged_spec(tmp_path: Path, damage: str) -> None:
    """A completed claim whose spec cannot be read is prepared again from the claim (as
    a wiped one), not failed at every retry; a FIFO is never opened blocking."""
    claim = claim_json(UID_A, result("gpu-1"))
    preparer, reader = setup(tmp_path, claim)
    first = preparer.prepare(ref_of(claim))
    path = spec_file(tmp_path, UID_A)
    spec_bytes = path.read_bytes()
    path.unlink()
    if damage == "not json":
        path.write_text("{")
    elif damage == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)

    assert preparer.prepare(ref_of(claim)) == first
    assert reader.calls == 2
    assert path.read_bytes() == spec_bytes


# ---- cached claim reads ------------------------------------------------------------------


def test_prepare_reads_the_cached_claim_first(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-0"))
    preparer, reader = setup(tmp_path, claim)
    assert preparer.prepare(ref_of(claim)).error == ""
    assert (reader.calls, reader.cached_calls) == (1, 1)


@pytest.mark.parametrize("cached", ["missing", "unallocated", "old-uid"])
def test_an_unusable_cached_claim_is_read_again_fresh(tmp_path: Path, cached: str) -> None:
    claim = claim_json(UID_A, result("gpu-0"), name="c")
    preparer, reader = setup(tmp_path, claim)
    if cached == "missing":
        reader.stale[("default", "c")] = None
    elif cached == "unallocated":
        reader.stale[("default", "c")] = {**claim, "status": {}}
    else:
        reader.stale[("default", "c")] = claim_json(UID_B, result("gpu-1"), name="c")

    outcome = preparer.prepare(ref_of(claim))
    assert outcome.error == ""
    assert [d.device_name for d in outcome.devices] == ["gpu-0"]
    assert (reader.calls, reader.cached_calls) == (2, 1)


# ---- unprepare ----------------------------------------------------------------------


def test_unprepare_removes_spec_and_entry_and_is_idempotent(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-1"))
    preparer, reader = setup(tmp_path, claim)
    preparer.prepare(ref_of(claim))
    reader.delete("default", claim["metadata"]["name"])  # unprepare needs no API

    assert preparer.unprepare(ref_of(claim)) == ""
    assert not spec_file(tmp_path, UID_A).exists()
    assert preparer.store.get(UID_A) is None
    assert preparer.unprepare(ref_of(claim)) == ""
    assert sorted(p.name for p in (tmp_path / "cdi").iterdir()) == []


def test_unprepare_of_an_unknown_claim_is_fine(tmp_path: Path) -> None:
    preparer, _ = setup(tmp_path)
    assert preparer.unprepare(ClaimRef(namespace="x", name="never", uid=UID_C)) == ""
    assert preparer.store.claims() == {}


def test_unprepare_uid(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-0"))
    preparer, _ = setup(tmp_path, claim)
    preparer.prepare(ref_of(claim))
    preparer.unprepare_uid(UID_A)
    assert not spec_file(tmp_path, UID_A).exists()
    assert preparer.store.get(UID_A) is None
    preparer.unprepare_uid(UID_A)


def test_unprepare_frees_the_device_for_the_next_claim(tmp_path: Path) -> None:
    first = claim_json(UID_A, result("gpu-0"))
    second = claim_json(UID_B, result("gpu-0"))
    preparer, _ = setup(tmp_path, first, second)
    assert preparer.prepare(ref_of(first)).error == ""
    assert preparer.prepare(ref_of(second)).error != ""
    preparer.unprepare(ref_of(first))
    assert preparer.prepare(ref_of(second)).error == ""


# ---- devices held by other claims -------------------------------------------------------


def test_device_held_by_another_claim_is_refused(tmp_path: Path) -> None:
    first = claim_json(UID_A, result("gpu-2"), name="first")
    second = claim_json(UID_B, result("gpu-2"), name="second")
    preparer, _ = setup(tmp_path, first, second)
    assert preparer.prepare(ref_of(first)).error == ""

    outcome = preparer.prepare(ref_of(second))
    assert outcome.devices == ()
    assert outcome.error == (
        f'device "gpu-2" is already prepared for claim default/first ({UID_A}); '
        "it cannot be used by default/second until that claim is unprepared"
    )
    assert not spec_file(tmp_path, UID_B).exists()
    assert preparer.store.get(UID_B) is None


def test_a_started_prepare_reserves_its_devices(tmp_path: Path) -> None:
    # What a crash between PrepareStarted and the CDI spec leaves in the checkpoint.
    second = claim_json(UID_B, result("gpu-3"), name="second")
    preparer, _ = setup(tmp_path, second)
    with preparer.state_lock():
        preparer.store.mark_started(
            UID_A,
            namespace="team",
            name="crashed",
            devices=[PreparedDevice(pool_name="n1", device_name="gpu-3")],
        )
    outcome = preparer.prepare(ref_of(second))
    assert "team/crashed" in outcome.error
    assert UID_A in outcome.error
    assert "default/second" in outcome.error


def test_held_device_of_another_pool_does_not_conflict(tmp_path: Path) -> None:
    claim = claim_json(UID_B, result("gpu-3"))
    preparer, _ = setup(tmp_path, claim)
    with preparer.state_lock():
        preparer.store.mark_started(
            UID_A,
            namespace="x",
            name="y",
            devices=[PreparedDevice(pool_name="other-node", device_name="gpu-3")],
        )
    assert preparer.prepare(ref_of(claim)).error == ""


def test_admin_access_may_use_a_held_device(tmp_path: Path) -> None:
    user = claim_json(UID_A, result("gpu-1"), name="user")
    monitor = claim_json(UID_B, result("gpu-1", admin_access=True), name="monitor")
    preparer, _ = setup(tmp_path, user, monitor)
    assert preparer.prepare(ref_of(user)).error == ""
    outcome = preparer.prepare(ref_of(monitor))
    assert outcome.error == ""
    assert [d.device_name for d in outcome.devices] == ["gpu-1"]
    assert spec_file(tmp_path, UID_B).is_file()


def test_shared_allocations_may_use_one_device(tmp_path: Path) -> None:
    one = claim_json(UID_A, result("gpu-0", share_id="share-1"), name="one")
    two = claim_json(UID_B, result("gpu-0", share_id="share-2"), name="two")
    preparer, _ = setup(tmp_path, one, two)
    assert preparer.prepare(ref_of(one)).error == ""
    outcome = preparer.prepare(ref_of(two))
    assert outcome.error == ""
    assert outcome.devices[0].share_id == "share-2"


def test_an_exclusive_claim_cannot_join_a_shared_device(tmp_path: Path) -> None:
    shared = claim_json(UID_A, result("gpu-0", share_id="share-1"), name="shared")
    exclusive = claim_json(UID_B, result("gpu-0"), name="exclusive")
    preparer, _ = setup(tmp_path, shared, exclusive)
    assert preparer.prepare(ref_of(shared)).error == ""
    assert "already prepared for claim default/shared" in preparer.prepare(ref_of(exclusive)).error


def test_concurrent_claims_for_one_device_get_it_once(tmp_path: Path) -> None:
    claims = [claim_json(uid, result("gpu-2")) for uid in (UID_A, UID_B, UID_C)]
    preparer, _ = setup(tmp_path, *claims)
    with ThreadPoolExecutor(max_workers=3) as pool:
        outcomes = list(pool.map(preparer.prepare, [ref_of(c) for c in claims]))
    assert sorted(bool(o.error) for o in outcomes) == [False, True, True]
    assert len(preparer.store.claims()) == 1
    assert len(list((tmp_path / "cdi").glob("*.json"))) == 1


# ---- claims that cannot be prepared -----------------------------------------------------


def test_device_of_another_pool_is_refused(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-0", pool="n2"))
    preparer, _ = setup(tmp_path, claim)
    outcome = preparer.prepare(ref_of(claim))
    assert outcome.error == (
        'request "gpu": device "gpu-0" of pool "n2" is not a device of driver '
        f'gpu.drasil.dev on node "n1" (known: {KNOWN})'
    )
    assert not spec_file(tmp_path, UID_A).exists()
    assert preparer.store.get(UID_A) is None


def test_unknown_device_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-7"))
    preparer, _ = setup(tmp_path, claim)
    outcome = preparer.prepare(ref_of(claim))
    assert 'device "gpu-7"' in outcome.error
    assert f"(known: {KNOWN})" in outcome.error


def test_claim_with_another_uid_is_refused(tmp_path: Path) -> None:
    recreated = claim_json(UID_B, result("gpu-0"), name="c")
    preparer, _ = setup(tmp_path, recreated)
    outcome = preparer.prepare(ClaimRef(namespace="default", name="c", uid=UID_A))
    assert outcome.error == (
        f"ResourceClaim default/c has UID {UID_B}, kubelet asked for {UID_A}: "
        "the claim was deleted and re-created"
    )
    assert preparer.store.claims() == {}


def test_missing_claim_is_refused(tmp_path: Path) -> None:
    preparer, _ = setup(tmp_path)
    outcome = preparer.prepare(ClaimRef(namespace="ns", name="gone", uid=UID_A))
    assert outcome.error == "ResourceClaim ns/gone not found"


def test_unallocated_claim_is_refused(tmp_path: Path) -> None:
    claim = claim_json(UID_A)
    del claim["status"]["allocation"]
    preparer, _ = setup(tmp_path, claim)
    outcome = preparer.prepare(ref_of(claim))
    assert "status.allocation: missing; the claim is not allocated yet" in outcome.error


def test_invalid_opaque_config_names_the_field(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-0"), config=[gpu_config("Foo", requests=["gpu"])])
    preparer, _ = setup(tmp_path, claim)
    outcome = preparer.prepare(ref_of(claim))
    assert outcome.devices == ()
    assert outcome.error.startswith(
        "invalid device config: config[0] (FromClaim, requests [gpu]): sharing.strategy: "
        'unsupported value "Foo"'
    )
    for allowed in ("Exclusive", "TimeSlicing", "MPS"):
        assert allowed in outcome.error
    assert not spec_file(tmp_path, UID_A).exists()
    assert preparer.store.get(UID_A) is None


def test_mps_on_two_whole_gpus_of_one_claim_is_refused(tmp_path: Path) -> None:
    claim = claim_json(
        UID_A,
        result("gpu-0", request="a"),
        result("gpu-1", request="b"),
        config=[gpu_config("MPS")],
    )
    preparer, _ = setup(tmp_path, claim)
    outcome = preparer.prepare(ref_of(claim))
    assert outcome.devices == ()
    assert outcome.error == (
        'sharing.strategy: MPS on devices allocated whole ("gpu-0", "gpu-1"): a claim may '
        "hold one, since each runs an MPS daemon of its own and a container reaches one "
        "daemon; ask for each MPS device in a claim of its own"
    )
    assert not spec_file(tmp_path, UID_A).exists()
    assert preparer.store.get(UID_A) is None


def test_mps_on_a_mig_device_is_recorded_as_mps(tmp_path: Path) -> None:
    devices = node_devices("a100-40gb-mig:1")
    name = "gpu-0-mig-1g5gb-9-0"
    mps = gpu_config("MPS", requests=["mig"])
    mps["opaque"]["parameters"]["kind"] = "MigDeviceConfig"
    claim = claim_json(UID_A, result(name, request="mig"), config=[mps])
    preparer = make_preparer(tmp_path, MemoryClaims(claim), devices=devices)
    assert preparer.prepare(ref_of(claim)).error == ""
    record = preparer.store.get(UID_A)
    assert record is not None
    assert [d.sharing for d in record.devices] == ["MPS"]


def test_a_failed_claim_does_not_block_a_good_one(tmp_path: Path) -> None:
    good = claim_json(UID_B, result("gpu-0"))
    preparer, _ = setup(tmp_path, good)
    assert preparer.prepare(ClaimRef(namespace="default", name="x", uid=UID_A)).error
    assert preparer.prepare(ref_of(good)).error == ""


# ---- per-claim locks ----------------------------------------------------------------------


def _holder(
    locks: _KeyedLocks, key: str, entered: threading.Event, leave: threading.Event
) -> threading.Thread:
    def run() -> None:
        with locks.hold(key):
            entered.set()
            leave.wait(DEADLINE)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_keyed_locks_serialize_one_key() -> None:
    locks = _KeyedLocks()
    first_in, first_out = threading.Event(), threading.Event()
    second_in, second_out = threading.Event(), threading.Event()
    first = _holder(locks, UID_A, first_in, first_out)
    assert first_in.wait(DEADLINE)
    second = _holder(locks, UID_A, second_in, second_out)
    # The second holder has registered and waits for the lock the first one holds.
    wait_until(lambda: locks._locks[UID_A][1] == 2, what="the second holder to queue")
    assert not second_in.is_set()

    first_out.set()
    assert second_in.wait(DEADLINE)
    second_out.set()
    first.join(DEADLINE)
    second.join(DEADLINE)
    assert locks._locks == {}  # dropped when unused


def test_keyed_locks_do_not_serialize_different_keys() -> None:
    locks = _KeyedLocks()
    a_in, b_in, leave = threading.Event(), threading.Event(), threading.Event()
    a = _holder(locks, UID_A, a_in, leave)
    b = _holder(locks, UID_B, b_in, leave)
    try:
        # Both are inside at the same time.
        assert a_in.wait(DEADLINE)
        assert b_in.wait(DEADLINE)
    finally:
        leave.set()
        a.join(DEADLINE)
        b.join(DEADLINE)
    assert locks._locks == {}


def test_keyed_lock_is_released_when_the_body_raises() -> None:
    locks = _KeyedLocks()
    with pytest.raises(RuntimeError), locks.hold(UID_A):
        raise RuntimeError("boom")
    assert locks._locks == {}
    with locks.hold(UID_A):
        pass


def test_driver_constant_matches_the_spec_file_name(tmp_path: Path) -> None:
    assert spec_file(tmp_path, UID_A).name == f"k8s.{DRIVER}-claim_{UID_A}.json"


def test_a_claim_may_use_a_device_an_admin_access_claim_holds(tmp_path: Path) -> None:
    monitor = claim_json(UID_A, result("gpu-1", admin_access=True), name="monitor")
    user = claim_json(UID_B, result("gpu-1"), name="user")
    preparer = make_preparer(tmp_path, MemoryClaims(monitor, user))
    assert preparer.prepare(ref_of(monitor)).error == ""
    assert preparer.prepare(ref_of(user)).error == ""


def test_a_stuck_peer_instance_gives_a_claim_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepare_module, "STATE_LOCK_TIMEOUT", 0.2)
    claim = claim_json(UID_A, result("gpu-0"))
    preparer = make_preparer(tmp_path, MemoryClaims(claim))
    with FileLock(tmp_path / "state" / "checkpoint.lock"):  # another instance holds it
        outcome = preparer.prepare(ref_of(claim))
    assert "still locked" in outcome.error


# ---- an API server that hangs --------------------------------------------------------


class HangingClaims:
    """A claim reader whose reads block until released (a SIGSTOPped API server)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.waiting = threading.Semaphore(0)

    def get_claim(self, namespace: str, name: str, *, cached: bool = False) -> Any:
        self.waiting.release()
        self.release.wait(DEADLINE)
        return None


def test_prepares_waiting_for_a_hung_api_server_are_bounded(tmp_path: Path) -> None:
    claim = claim_json(UID_A, result("gpu-0"))
    preparer, _ = setup(tmp_path, claim)
    assert preparer.prepare(ref_of(claim)).error == ""  # one claim prepared before the hang
    hanging = HangingClaims()
    preparer.claims = hanging
    refs = [ClaimRef("ml", f"c-{i}", f"{i:08x}-0000-4000-8000-000000000000") for i in range(16)]
    threads = [threading.Thread(target=preparer.prepare, args=(r,)) for r in refs]
    for thread in threads:
        thread.start()
    for _ in refs:
        assert hanging.waiting.acquire(timeout=DEADLINE)  # all 16 wait for the API server

    refused = preparer.prepare(ClaimRef("ml", "late", "ffffffff-0000-4000-8000-000000000000"))
    again = preparer.prepare(ref_of(claim))  # answered from the checkpoint
    unprepared = preparer.unprepare(ref_of(claim))  # needs no API server

    hanging.release.set()
    for thread in threads:
        thread.join()
    assert refused.error == (
        "16 prepares are already waiting for the API server; kubelet retries this claim"
    )
    assert again.error == ""
    assert unprepared == ""


def test_a_withheld_device_is_refused_and_a_prepared_claim_kept(tmp_path: Path) -> None:
    kept = claim_json(UID_A, result("gpu-1"), name="kept")
    late = claim_json(UID_B, result("gpu-2"), name="late")
    preparer, _ = setup(tmp_path, kept, late)
    assert preparer.prepare(ref_of(kept)).error == ""
    preparer.withheld = lambda name: "another plugin hands it out" if name != "gpu-0" else None

    outcome = preparer.prepare(ref_of(late))
    assert outcome.error == "device 'gpu-2' is withheld: another plugin hands it out"
    assert preparer.store.get(UID_B) is None
    assert not spec_file(tmp_path, UID_B).exists()
    # Prepared before the conflict: asked again, it is still prepared.
    assert preparer.prepare(ref_of(kept)).error == ""
    preparer.withheld = lambda name: None
    assert preparer.prepare(ref_of(late)).error == ""

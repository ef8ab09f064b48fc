"""MPS daemons at node scale: each GPU's daemon is changed under its own lock.

Calls for different GPUs never wait for each other (threads of one plugin, or two
plugin instances during a rolling update); one GPU is changed by one call at a time;
an older release that takes the node-wide ``mps.lock`` exclusive still keeps a newer
one out (and is kept out by it); a settle after an unprepare waits only for the GPUs
its claim released and never undoes what a prepare of another GPU is doing.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kubelet_client import DRIVER, NODE, FileClaims, claim_json, ref_of, result

from drasil.driver.checkpoint import CHECKPOINT_DIR, CheckpointStore
from drasil.driver.claims.plan import ClaimRef
from drasil.driver.devices import CapacityPolicy, Device
from drasil.driver.files import CRASH_ENV, CRASH_EXIT_CODE, FileLock
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.simulated.nvml import simulated_library
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.vendors.nvidia.mps import daemons as daemons_module
from drasil.kubeletplugin.vendors.nvidia.mps.daemons import (
    DaemonLimits,
    DaemonProgram,
    MpsDaemons,
    MpsError,
)
from drasil.kubeletplugin.vendors.nvidia.mps.shares import GpuEffects

GPU_A = "GPU-5a1e9c1e-0000-4000-8000-000000000001"
GPU_B = "GPU-5a1e9c1e-0000-4000-8000-000000000002"
SHARE = DaemonLimits(20480, 25)
SIMULATED = DaemonProgram.for_backend("simulated")
GIB = 2**30

# A plugin instance in a process of its own holding one GPU's lock (argv: state dir,
# GPU, seconds), saying "held" once it does.
HOLDER = """
import sys, time
from pathlib import Path
from drasil.kubeletplugin.vendors.nvidia.mps.daemons import DaemonProgram, MpsDaemons
daemons = MpsDaemons(Path(sys.argv[1]), program=DaemonProgram.for_backend("simulated"))
with daemons.hold(sys.argv[2]):
    print("held", flush=True)
    time.sleep(float(sys.argv[3]))
"""

# An older release: the node-wide lock taken exclusive around its change.
OLD_RELEASE = """
import sys, time
from pathlib import Path
from drasil.driver.files import CRASH_ENV, CRASH_EXIT_CODE, FileLock
with FileLock(Path(sys.argv[1]) / "mps.lock"):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "state"
    MpsDaemons(tmp_path / "state", program=SIMULATED).sweep(keep=())


@pytest.fixture
def short_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemons_module, "MPS_LOCK_TIMEOUT", 0.5)


def holder(*argv: str) -> subprocess.Popen[str]:
    """A child process running ``argv`` (a script and its arguments), once it holds."""
    child = subprocess.Popen(
        [sys.executable, "-c", *argv], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "held"
    return child


def held_elsewhere(daemons: MpsDaemons, gpu: str) -> tuple[threading.Event, threading.Thread]:
    """Another thread holding ``gpu``'s lock until the event is set."""
    release, holding = threading.Event(), threading.Event()

    def hold() -> None:
        with daemons.hold(gpu):
            holding.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    assert holding.wait(10)
    return release, thread


def test_calls_for_different_gpus_do_not_wait_for_each_other(state: Path) -> None:
    daemons = MpsDaemons(state, program=SIMULATED)
    release, thread = held_elsewhere(daemons, GPU_A)
    try:
        # GPU_A's holder lets go only in the finally below: waiting for it would hang.
        daemon = daemons.ensure(GPU_B, SHARE)
        assert daemons.running(GPU_B) == daemon
        assert daemons.stop(GPU_B)
        with daemons.hold(GPU_A, wait=False) as held:
            assert not held  # busy: left to its holder
    finally:
        release.set()
        thread.join()
    with daemons.hold(GPU_A, wait=False) as held:
        assert held


def test_one_gpu_is_changed_by_one_call_at_a_time(state: Path, short_wait: None) -> None:
    daemons = MpsDaemons(state, program=SIMULATED)
    release, thread = held_elsewhere(daemons, GPU_A)
    try:
        with pytest.raises(
            MpsError, match=f"GPU {GPU_A} is being changed by another call.*retries"
        ):
            daemons.ensure(GPU_A, SHARE)
    finally:
        release.set()
        thread.join()
    assert daemons.ensure(GPU_A, SHARE).gpu_uuid == GPU_A


def test_the_lock_is_reentrant_in_a_thread_and_forgotten_when_unused(state: Path) -> None:
    daemons = MpsDaemons(state, program=SIMULATED)
    with daemons.hold(GPU_A) as outer:
        with daemons.hold(GPU_A) as inner:
            assert outer
            assert inner
            daemons.ensure(GPU_A, SHARE)  # takes it a third time
        assert daemons.stop(GPU_A)
    assert daemons._locks._locks == {}  # MIG UUIDs come and go: no entry is kept


def test_two_plugin_instances_change_different_gpus_at_once(state: Path, short_wait: None) -> None:
    daemons = MpsDaemons(state, program=SIMULATED)
    state.mkdir(parents=True)
    other = holder(HOLDER, str(state), GPU_A, "30")
    try:
        with daemons.hold(GPU_B) as held:  # the node-wide lock is shared by both
            assert held
        with daemons.hold(GPU_A, wait=False) as held:
            assert not held
        with pytest.raises(MpsError, match="another plugin instance"):
            daemons.ensure(GPU_A, SHARE)
    finally:
        other.kill()
        other.wait()
    with daemons.hold(GPU_A) as held:  # the holder's end released it
        assert held


def test_an_older_release_holding_the_node_lock_keeps_changes_out(
    state: Path, short_wait: None
) -> None:
    daemons = MpsDaemons(state, program=SIMULATED)
    state.mkdir(parents=True)
    old = holder(OLD_RELEASE, str(state), "30")
    try:
        with pytest.raises(MpsError, match=r"an older plugin instance .*mps\.lock"):
            daemons.ensure(GPU_B, SHARE)
    finally:
        old.kill()
        old.wait()
    # And the older release waits while a newer one holds any GPU.
    with daemons.hold(GPU_B), pytest.raises(TimeoutError):
        FileLock(state / "mps.lock", timeout=0.2).acquire()
    lock = FileLock(state / "mps.lock", timeout=0.2)
    lock.acquire()
    lock.release()


# ---- settle, with a Preparer -------------------------------------------------------------


def shareable(root: Path) -> dict[str, Device]:
    """Both GPUs of the profile published for shares, as --gpu-sharing consumable does."""
    lib = simulated_library("h100-80gb:2", node_name=NODE, state_file=root / "gpus.json")
    found = {d.name: d for d in discover(lib, node_name=NODE).devices}
    policies = {
        "memory": CapacityPolicy(default=GIB, minimum=GIB, step=GIB),
        "computePercent": CapacityPolicy(default=0, minimum=0, step=1, maximum=100),
    }
    for name in ("gpu-0", "gpu-1"):
        found[name] = dataclasses.replace(
            found[name],
            capacity={**found[name].capacity, "computePercent": 100},
            allow_multiple_allocations=True,
            capacity_policies=policies,
        )
    return found


def preparer(root: Path) -> tuple[Preparer, GpuEffects]:
    state, cdi = root / "state", root / "cdi"
    state.mkdir(parents=True, exist_ok=True)
    cdi.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore(state / CHECKPOINT_DIR)
    store.load()
    p = Preparer(
        driver=DRIVER,
        pool=NODE,
        devices=shareable(root),
        claims=FileClaims(root / "claims"),
        store=store,
        cdi_root=cdi,
        state_dir=state,
    )
    lib = simulated_library("h100-80gb:2", node_name=NODE, state_file=root / "gpus.json")
    daemons = MpsDaemons(state, program=SIMULATED)
    effects = GpuEffects(lib, daemons, store=store, state_lock=p.state_lock, devices=p.devices)
    p.effects = effects
    return p, effects


def share(root: Path, uid: str, device: str) -> ClaimRef:
    entry = result(device, share_id=f"share-{uid[:4]}")
    entry["consumedCapacity"] = {"memory": "20Gi"}
    claim = claim_json(uid, entry, name=f"c-{uid[:4]}", namespace="ml")
    FileClaims(root / "claims").put(claim)
    return ref_of(claim)


def test_an_unprepare_settles_its_gpu_without_waiting_for_a_busy_other(
    tmp_path: Path, state: Path, short_wait: None, caplog: pytest.LogCaptureFixture
) -> None:
    p, effects = preparer(tmp_path)
    on_0 = share(tmp_path, "aaaaaaaa-0000-4000-8000-00000000000a", "gpu-0")
    on_1 = share(tmp_path, "bbbbbbbb-0000-4000-8000-00000000000b", "gpu-1")
    assert p.prepare(on_0).error == ""
    assert p.prepare(on_1).error == ""
    gpu_0, gpu_1 = p.devices["gpu-0"].uuid, p.devices["gpu-1"].uuid
    # gpu-0's claim is gone from the checkpoint but its GPU is busy (a call of its own).
    release, thread = held_elsewhere(effects.daemons, gpu_0)
    try:
        with p.state_lock():
            p.store.remove(on_0.uid)
        assert p.unprepare(on_1) == ""
        # A settle that waited for gpu-0's lock would have given up (0.5 s) and said so.
        assert not [r for r in caplog.records if r.getMessage() == "settling GPU state failed"]
        assert effects.daemons.running(gpu_1) is None  # its own GPU settled
        assert effects.daemons.running(gpu_0) is not None  # left to the busy holder
    finally:
        release.set()
        thread.join()
    assert effects.settle() == [
        f"stopped the MPS daemon of GPU {gpu_0}",
        f"restored compute mode 0 of GPU {gpu_0}",
    ]


def test_a_settle_never_stops_a_daemon_a_prepare_recorded_meanwhile(
    tmp_path: Path, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, effects = preparer(tmp_path)
    first = share(tmp_path, "aaaaaaaa-0000-4000-8000-00000000000a", "gpu-0")
    assert p.prepare(first).error == ""
    gpu_0 = p.devices["gpu-0"].uuid
    second = share(tmp_path, "cccccccc-0000-4000-8000-00000000000c", "gpu-0")
    # The settle of the first claim's unprepare found gpu-0 unneeded; before it takes
    # the GPU's lock, a prepare of the second share records its claim and starts.
    real = effects._to_settle

    def then_a_prepare() -> list[str]:
        found = real()
        assert found == [gpu_0]
        assert p.prepare(second).error == ""
        return found

    monkeypatch.setattr(effects, "_to_settle", then_a_prepare)
    assert p.unprepare(first) == ""
    daemon = effects.daemons.running(gpu_0)
    assert daemon is not None  # asked again under the lock: the second share needs it
    assert p.store.gpus()[gpu_0].mps is not None


# ---- the plugin killed in the middle of parallel starts and stops ------------------------

# Kubelet's calls for several claims at once, in threads of one plugin process (argv: the
# test's folder, root, operation, then namespace/name/uid of each claim); killed (os._exit)
# when any thread reaches the crash point, wherever the others are then.
PARALLEL_CHILD = """
import sys, threading
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import test_mps_locks as here
from drasil.driver.claims.plan import ClaimRef
p, _ = here.preparer(Path(sys.argv[2]))
call = p.prepare if sys.argv[3] == "prepare" else p.unprepare
refs = [ClaimRef(*ref.split("/")) for ref in sys.argv[4:]]
threads = [threading.Thread(target=call, args=(ref,)) for ref in refs]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
"""
SHARES = [  # two GPUs, two shares on each
    ("aaaaaaaa-0000-4000-8000-00000000000a", "gpu-0"),
    ("bbbbbbbb-0000-4000-8000-00000000000b", "gpu-0"),
    ("cccccccc-0000-4000-8000-00000000000c", "gpu-1"),
    ("dddddddd-0000-4000-8000-00000000000d", "gpu-1"),
]
START_POINTS = [
    "prepare-after-started",
    "mps-after-start",
    "mps-record-after-rename",
    "prepare-after-share",
    "prepare-after-cdi",
]
STOP_POINTS = [
    "unprepare-after-cdi",
    "unprepare-after-removed",
    "mps-after-stop",
    "settle-after-stop",
]


def killed_at(root: Path, point: str, operation: str, refs: list[ClaimRef]) -> None:
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV} | {CRASH_ENV: point}
    claims = [f"{r.namespace}/{r.name}/{r.uid}" for r in refs]
    child = [sys.executable, "-c", PARALLEL_CHILD, str(Path(__file__).parent), str(root)]
    done = subprocess.run(
        [*child, operation, *claims],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == CRASH_EXIT_CODE, done.stderr


def in_parallel(call: Callable[[ClaimRef], Any], refs: list[ClaimRef]) -> list[Any]:
    with ThreadPoolExecutor(len(refs)) as pool:
        return list(pool.map(call, refs))


def restarted(root: Path) -> tuple[Preparer, GpuEffects]:
    """The plugin after the kill: a new Preparer, and the start-up resume."""
    p, effects = preparer(root)
    effects.resume()
    return p, effects


def daemons_match_claims(p: Preparer, effects: GpuEffects) -> None:
    """No daemon without a prepared share on its GPU, no prepared share without one."""
    wanted = {
        p.devices[held.device_name].uuid for r in p.store.claims().values() for held in r.devices
    }
    running = {gpu for gpu in effects.daemons._known_gpus() if effects.daemons.running(gpu)}
    assert running == wanted


@pytest.mark.parametrize("point", START_POINTS)
def test_parallel_prepares_killed_anywhere_are_finished_by_the_repeated_calls(
    tmp_path: Path, state: Path, point: str
) -> None:
    refs = [share(tmp_path, uid, device) for uid, device in SHARES]
    killed_at(tmp_path, point, "prepare", refs)
    p, effects = restarted(tmp_path)
    daemons_match_claims(p, effects)
    assert [r.error for r in in_parallel(p.prepare, refs)] == [""] * 4
    daemons_match_claims(p, effects)
    assert len(p.store.gpus()) == 2
    assert in_parallel(p.unprepare, refs) == [""] * 4
    assert effects.daemons.sweep(keep=()) == []  # none left
    assert p.store.gpus() == {}


@pytest.mark.parametrize("point", STOP_POINTS)
def test_parallel_unprepares_killed_anywhere_are_finished_by_the_repeated_calls(
    tmp_path: Path, state: Path, point: str
) -> None:
    p, _ = preparer(tmp_path)
    refs = [share(tmp_path, uid, device) for uid, device in SHARES]
    assert [r.error for r in in_parallel(p.prepare, refs)] == [""] * 4
    killed_at(tmp_path, point, "unprepare", refs)
    p, effects = restarted(tmp_path)
    daemons_match_claims(p, effects)
    assert in_parallel(p.unprepare, refs) == [""] * 4
    assert effects.daemons.sweep(keep=()) == []
    assert p.store.gpus() == {}
    assert p.store.claims() == {}


# A control daemon a killed plugin started, still coming up: its pid file follows.
COMING_UP = """
import os, sys, time
time.sleep(0.5)
(open(sys.argv[1] + "/nvidia-cuda-mps-control.pid", "w")).write(f"{os.getpid()}\\n")
time.sleep(30)
"""


def test_a_daemon_still_starting_is_waited_for_not_started_twice(state: Path) -> None:
    daemons = MpsDaemons(state, program=SIMULATED)
    pipe = daemons._pipe_dir(GPU_A)
    pipe.mkdir(parents=True)
    env = dict(os.environ, DRASIL_MPS_GPU=GPU_A)
    child = subprocess.Popen([sys.executable, "-c", COMING_UP, str(pipe), "-d"], env=env)
    try:
        launcher = daemons_module.ProcessLauncher()
        wait_for_it = time.monotonic()
        while not daemons_module.starting_daemons(GPU_A):
            assert time.monotonic() - wait_for_it < 10
            time.sleep(0.01)
        adopted = launcher.adopt(daemons._spot(GPU_A))
        assert adopted is not None
        assert adopted.pid == child.pid
        assert launcher.adopt(daemons._spot(GPU_B)) is None  # none starts for another GPU
    finally:
        child.kill()
        child.wait()
    assert daemons_module.starting_daemons(GPU_A) == []

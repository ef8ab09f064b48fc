"""A daemon that dies under its clients is found, said, and replaced by the next prepare.

Real stand-in daemons (processes), killed as the OOM killer or an operator would; the
watch's look is called directly (``poll``) rather than on its timer.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from test_mps_locks import SIMULATED, held_elsewhere, preparer, share

from drasil.driver.health import HealthTracker
from drasil.driver.simulated.nvml import simulated_library
from drasil.kubeletplugin.vendors.nvidia.mps.daemons import (
    MpsDaemons,
    is_mount_point,
    process_start_time,
)
from drasil.kubeletplugin.vendors.nvidia.mps.watch import DIED_REASON, DaemonWatch

UID_A = "aaaaaaaa-0000-4000-8000-00000000000a"
UID_B = "bbbbbbbb-0000-4000-8000-00000000000b"
UID_C = "cccccccc-0000-4000-8000-00000000000c"
NODE = "n1"


@pytest.fixture(autouse=True)
def no_daemon_left(tmp_path: Path) -> Any:
    yield
    MpsDaemons(tmp_path / "state", program=SIMULATED).sweep(keep=())


class Api:
    """The claims' Pods as the API server has them, and the Events posted."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def get_claim(
        self, namespace: str, name: str, *, cached: bool = False
    ) -> Mapping[str, Any] | None:
        pod = {"resource": "pods", "name": f"pod-{name}", "uid": f"uid-{name}"}
        return {
            "metadata": {"name": name, "namespace": namespace},
            "status": {"reservedFor": [pod]},
        }

    def post_event(self, **event: Any) -> bool:
        self.events.append(event)
        return True


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while process_start_time(pid) is not None:
        assert time.monotonic() < deadline, f"pid {pid} still runs"
        time.sleep(0.02)


def compute_mode(root: Path, index: int) -> int:
    lib = simulated_library("h100-80gb:2", node_name=NODE, state_file=root / "gpus.json")
    lib.init()
    return lib.device_compute_mode(lib.device_handle_by_index(index))


def wait_for(what: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_killed_daemon_is_said_until_its_claims_are_gone(tmp_path: Path) -> None:
    p, effects = preparer(tmp_path)
    first, second = share(tmp_path, UID_A, "gpu-0"), share(tmp_path, UID_B, "gpu-0")
    assert p.prepare(first).error == ""
    assert p.prepare(second).error == ""
    gpu = p.devices["gpu-0"].uuid
    health = HealthTracker(p.devices.values())
    told: list[tuple[str, str]] = []
    api = Api()
    watch = DaemonWatch(
        effects, health, node_event=lambda reason, message: told.append((reason, message)), api=api
    )
    assert watch.poll() == []  # alive: nothing said
    old = effects.daemons.running(gpu)
    assert old is not None
    kill(old.pid)

    [death] = watch.poll()
    assert death.gpu == gpu
    assert {c.claim_uid for c in death.clients} == {UID_A, UID_B}
    unhealthy = health.unhealthy()
    assert set(unhealthy) == {"gpu-0"}
    assert f"MPS daemon of GPU {gpu} (pid {old.pid}) died" in unhealthy["gpu-0"]
    assert "restart the Pod" in unhealthy["gpu-0"]
    assert health.tainted() == set()  # the GPU stays schedulable: a new claim gets a daemon
    [(reason, message)] = told
    assert reason == DIED_REASON
    assert gpu in message
    assert "ml/c-aaaa" in message
    assert "ml/c-bbbb" in message
    wait_for(lambda: len(api.events) == 2)
    assert {e["involved"]["name"] for e in api.events} == {"pod-c-aaaa", "pod-c-bbbb"}
    assert all(e["reason"] == DIED_REASON for e in api.events)
    assert watch.poll() == []  # said once

    # A new Pod's claim on that GPU gets a new daemon; the old claims stay unhealthy.
    third = share(tmp_path, UID_C, "gpu-0")
    assert p.prepare(third).error == ""
    new = effects.daemons.running(gpu)
    assert new is not None
    assert new.pid != old.pid
    assert new.limits == old.limits  # the checkpoint kept them
    assert watch.poll() == []
    assert set(health.unhealthy()) == {"gpu-0"}
    # That one dies too: said again, and the first one's claims stay unhealthy with it.
    kill(new.pid)
    [again] = watch.poll()
    assert {c.claim_uid for c in again.clients} == {UID_A, UID_B, UID_C}
    assert len(told) == 2
    # The third claim's Pod goes and another Pod takes the claim (same UID, prepared
    # anew, a new daemon): not a client of the dead one, even between two looks.
    assert p.unprepare(third) == ""
    assert p.prepare(third).error == ""
    assert p.unprepare(first) == ""
    assert p.unprepare(second) == ""
    watch.poll()
    assert health.unhealthy() == {}  # the dead daemons' clients are gone

    # Nothing the dead daemon held is left once the last claim goes.
    assert p.unprepare(third) == ""
    assert effects.daemons.running(gpu) is None
    assert p.store.gpus() == {}
    assert compute_mode(tmp_path, 0) == 0
    folder = effects.daemons._folder(gpu)
    assert list((folder / "pipe").iterdir()) == []
    assert not is_mount_point(folder / "shm")


def test_a_gpu_being_changed_is_not_taken_for_dead(tmp_path: Path) -> None:
    p, effects = preparer(tmp_path)
    assert p.prepare(share(tmp_path, UID_A, "gpu-0")).error == ""
    gpu = p.devices["gpu-0"].uuid
    health = HealthTracker(p.devices.values())
    watch = DaemonWatch(effects, health, node_event=lambda reason, message: None)
    daemon = effects.daemons.running(gpu)
    assert daemon is not None
    release, thread = held_elsewhere(effects.daemons, gpu)
    try:
        kill(daemon.pid)  # as a stop in progress would leave it for a moment
        assert watch.poll() == []
        assert health.unhealthy() == {}
    finally:
        release.set()
        thread.join()
    assert [d.gpu for d in watch.poll()] == [gpu]


def test_the_watch_runs_until_stopped_and_survives_a_failed_look(tmp_path: Path) -> None:
    p, effects = preparer(tmp_path)
    health = HealthTracker(p.devices.values())
    watch = DaemonWatch(effects, health, node_event=lambda reason, message: None, interval=0.01)
    looks: list[int] = []

    def failing() -> list[object]:
        looks.append(1)
        raise OSError("the state dir went away")

    watch.poll = failing  # type: ignore[method-assign]
    stop = threading.Event()
    thread = threading.Thread(target=watch.run, args=(stop,))
    thread.start()
    wait_for(lambda: len(looks) >= 3)
    stop.set()
    thread.join(5)
    assert not thread.is_alive()

"""One Event per distinct message per object: the memory behind EventRecorder."""

from __future__ import annotations

from drasil.controller.events import EventMemory, ObjectRef


def test_each_message_is_claimed_once_per_object_and_reason() -> None:
    memory = EventMemory()

    assert memory.claim("uid-1", "InvalidDeviceConfig", "a")
    assert not memory.claim("uid-1", "InvalidDeviceConfig", "a")
    assert memory.claim("uid-1", "InvalidDeviceConfig", "b")
    assert memory.claim("uid-1", "Unsatisfiable", "a")
    assert memory.claim("uid-2", "InvalidDeviceConfig", "a")


def test_a_problem_that_went_away_and_came_back_is_news() -> None:
    memory = EventMemory()
    memory.claim("uid-1", "Unsatisfiable", "a")
    memory.claim("uid-1", "Unsatisfiable", "b")

    memory.keep_only("uid-1", "Unsatisfiable", ["b"])

    assert memory.claim("uid-1", "Unsatisfiable", "a")
    assert not memory.claim("uid-1", "Unsatisfiable", "b")


def test_unclaim_and_forget() -> None:
    memory = EventMemory()
    memory.claim("uid-1", "r", "a")
    memory.unclaim("uid-1", "r", "a")
    assert memory.claim("uid-1", "r", "a")

    memory.forget("uid-1")
    assert len(memory) == 0
    assert memory.claim("uid-1", "r", "a")


def test_object_ref_from_json() -> None:
    ref = ObjectRef.of(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"namespace": "ml", "name": "c", "uid": "u"},
        }
    )

    assert str(ref) == "ResourceClaim ml/c"
    assert ref.involved() == {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "namespace": "ml",
        "name": "c",
        "uid": "u",
    }

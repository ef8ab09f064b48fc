"""Hooks and fixtures shared by the unit and component tests."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import pytest

from drasil.api.limits import allow_nesting
from drasil.driver.devices import DeviceType, Vendor
from drasil.kubeletplugin.gpucheck import cdicheck


def pytest_sessionstart(session: pytest.Session) -> None:
    # What every drasil process does where it starts: tests compile selectors and
    # decode objects as deep as the API server stores.
    allow_nesting()


@pytest.fixture(scope="session")
def schema_validator() -> jsonschema.Draft7Validator:
    """The official CDI JSON Schema (kubeletplugin/gpucheck/cdi-schema.md says which)."""
    validator: jsonschema.Draft7Validator = cdicheck.schema_validator()
    return validator


THIRD_VENDOR = Path(__file__).parents[1] / "e2e" / "harness" / "thirdvendor"


@pytest.fixture
def third_vendor(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The vendor package of e2e/harness/thirdvendor installed (on ``sys.path``, its
    entry point found) for one test: the vendor and device type it declares are
    forgotten afterwards, as they would be in a process that never installed it."""
    monkeypatch.syspath_prepend(str(THIRD_VENDOR))
    monkeypatch.setattr(Vendor, "_known", dict(Vendor._known))
    monkeypatch.setattr(DeviceType, "_known", dict(DeviceType._known))
    monkeypatch.setattr(DeviceType, "_vendors", dict(DeviceType._vendors))
    sys.modules.pop("acme_vendor", None)
    yield THIRD_VENDOR
    sys.modules.pop("acme_vendor", None)


@pytest.fixture
def make_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], None]]:
    """Binds a unix socket at a path (a kind of entry that is not a regular file);
    closed after the test."""
    bound: list[socket.socket] = []

    def bind(path: Path) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        monkeypatch.chdir(path.parent)  # a socket path may not be longer than 107 bytes
        sock.bind(path.name)
        bound.append(sock)

    yield bind
    for sock in bound:
        sock.close()

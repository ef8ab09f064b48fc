"""Hooks and fixtures shared by the unit and component tests."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import pytest

from drasil.api.limits import allow_nesting
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

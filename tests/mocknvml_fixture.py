"""Fixtures for tests that run pynvml in-process against drasil's mock NVML (e2e.harness.mocknvml).

A process can only ever hold one libnvidia-ml.so.1 and pynvml loads it once, so the mock
is compiled and preloaded once per session (`mock_nvml_lib`); each test gets its own
node through `mock_node(profile, ...)`, which points the library at the node's config
(DRASIL_MOCK_NVML_CONFIG, re-read at the next 0 -> 1 init) and, at teardown, fails the
test if it left NVML initialised, then resets the mock.

Import the fixtures into a test module (`from mocknvml_fixture import mock_node,
mock_nvml_lib`), or list this module in tests/conftest.py's `pytest_plugins`.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.harness import mocknvml
from e2e.harness.mocknvml import MockNode

MockNodeFactory = Callable[..., MockNode]


@pytest.fixture(scope="session")
def mock_nvml_lib() -> ctypes.CDLL:
    """The compiled mock, loaded into this process (RTLD_GLOBAL) before pynvml's load."""
    return mocknvml.preload(mocknvml.compiled_mock())


@pytest.fixture
def mock_node(
    mock_nvml_lib: ctypes.CDLL, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[MockNodeFactory]:
    """`mock_node(profile, node_name="node-a", **make_mock_node kwargs)`: a node under
    tmp_path that the mock serves from the next init on."""
    counter = itertools.count()
    mocknvml.reset(mock_nvml_lib)

    def make(profile: str, *, node_name: str = "node-a", **kwargs: Any) -> MockNode:
        node = mocknvml.make_mock_node(
            tmp_path / f"node-{next(counter)}", profile, node_name=node_name, **kwargs
        )
        monkeypatch.setenv(mocknvml.CONFIG_ENV, str(node.config_path))
        return node

    yield make
    left = mocknvml.init_count(mock_nvml_lib)
    mocknvml.reset(mock_nvml_lib)
    assert left == 0, f"the test left the mock NVML initialised ({left} inits)"

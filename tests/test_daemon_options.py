"""What users see of the daemons' options stays as it was: ``--help`` of both daemons
and the environment variables each reads (the chart sets them), against the texts
recorded in ``tests/golden/`` before the options were declared once each (issue 51).

A change a user should see is made in the golden files too, on purpose:
``DRASIL_UPDATE_GOLDEN=1 pytest tests/test_daemon_options.py`` writes them.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from drasil.controller import options as controller_options
from drasil.kubeletplugin import options as plugin_options

GOLDEN = Path(__file__).parent / "golden"
PARSERS: dict[str, Callable[..., Any]] = {
    "kubelet-plugin": plugin_options.parse_options,
    "controller": controller_options.parse_options,
}
# The one flag each daemon needs to start.
REQUIRED = {"kubelet-plugin": ["--node-name=n1"], "controller": []}


class _Recording(dict[str, str]):
    """An environment that notes every variable read from it."""

    def __init__(self, values: Mapping[str, str]) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return super().__contains__(key)


@contextlib.contextmanager
def _columns(width: int) -> Iterator[None]:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def _help(parse: Callable[..., Any]) -> str:
    out = io.StringIO()
    with _columns(100), contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse(["--help"], {"POD_NAME": "pod-0"})
    return out.getvalue()


def _env_read(daemon: str) -> str:
    env = _Recording({"POD_NAME": "pod-0"})
    PARSERS[daemon](REQUIRED[daemon], env)
    return "".join(f"{name}\n" for name in sorted(env.read))


def _check(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("DRASIL_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed: what users see of the options"


@pytest.mark.parametrize("daemon", sorted(PARSERS))
def test_help_is_what_users_saw(daemon: str) -> None:
    _check(f"{daemon}-help.txt", _help(PARSERS[daemon]))


@pytest.mark.parametrize("daemon", sorted(PARSERS))
def test_the_environment_read_is_what_the_chart_sets(daemon: str) -> None:
    _check(f"{daemon}-env.txt", _env_read(daemon))

"""The package layout of docs/design.md#layout: every package folder is installed as drasil.*."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"api": "drasil.api", "driver": "drasil.driver"}
FOLDERS |= {"kubeletplugin": "drasil.kubeletplugin", "controller": "drasil.controller"}


def _pyproject() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _package_folders() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found[".".join((package, *rel.parts))] = init.parent
    return found


def test_every_package_folder_is_listed_in_pyproject() -> None:
    setuptools = _pyproject()["tool"]["setuptools"]  # type: ignore[index]
    listed = set(setuptools["packages"])
    assert set(_package_folders()) == listed
    assert setuptools["package-dir"] == {pkg: folder for folder, pkg in FOLDERS.items()}


def test_packages_import_from_their_folders() -> None:
    for name, folder in _package_folders().items():
        module = importlib.import_module(name)
        assert Path(module.__file__ or "").parent == folder, name


def test_typed_marker_in_every_top_package() -> None:
    for folder in FOLDERS:
        assert (ROOT / folder / "py.typed").is_file(), folder

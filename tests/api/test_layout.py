"""The package layout of docs/design.md#layout: every package folder is installed as drasil.*."""

from __future__ import annotations

import ast
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


# The layout of docs/design.md#layout: per package folder, its top-level modules and
# sub-packages (with a trailing "/"). A new module must find its subsystem's
# sub-package, or be added here and in docs/design.md on purpose.
LAYOUT: dict[str, set[str]] = {
    "api": {
        "checkpoint",
        "config",
        "devicepool",
        "documents",
        "limits",
        "nvidiaconfig",
        "quantity",
        "kubelet/",
        "schemas/",
    },
    "driver": {
        "checkpoint",
        "checkpointdisk",
        "cli",
        "devicepools",
        "devices",
        "health",
        "endpoints",
        "hostresources",
        "files",
        "flags",
        "apierrors",
        "migrecords",
        "kubeapi",
        "keptalive",
        "logs",
        "objects",
        "cdi/",
        "cel/",
        "claims/",
        "discovery/",
        "explain/",
        "slices/",
        "nvidia/",
        "amd/",
        "simulated/",
        "vfio/",
    },
    "kubeletplugin": {
        "main",
        "metrics",
        "node",
        "options",
        "sockets",
        "dra/",
        "deviceplugin/",
        "vendors/",
        "gpucheck/",
    },
    "controller": {
        "attach",
        "controller",
        "devicepools",
        "devicestatus",
        "events",
        "heap",
        "kopfstorage",
        "leader",
        "main",
        "metrics",
        "operator",
        "options",
        "pending",
        "stalls",
        "poolsync",
        "state",
        "reconcilers/",
    },
}


def _top_level(folder: Path) -> set[str]:
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    packages = {f"{p.parent.name}/" for p in folder.glob("*/__init__.py")}
    return modules | packages


def test_every_module_is_in_the_layout() -> None:
    for folder, expected in LAYOUT.items():
        found = _top_level(ROOT / folder)
        assert found - expected == set(), (
            f"{folder}/ has modules outside the layout: put them in the sub-package of "
            "their subsystem, or add them to LAYOUT and docs/design.md#layout"
        )
        assert expected - found == set(), f"{folder}/: LAYOUT names modules that are gone"
    assert set(LAYOUT) == set(FOLDERS)


def test_every_sub_package_says_what_it_holds_and_who_uses_it() -> None:
    for name, folder in _package_folders().items():
        if name.startswith("drasil.api.kubelet") or name == "drasil.api.schemas":
            continue  # generated stubs and data
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc, f"{name}: __init__.py needs a docstring"
        assert len(doc.split()) >= 12, f"{name}: say what the package holds and who uses it"


def _design_bullets() -> dict[str, str]:
    """docs/design.md#layout's bullets by the folder they start with (``driver/cel``)."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n### Dependency rules\n", 1)[0]
    bullets = {}
    for line in section.splitlines():
        if line.startswith("- `") and "/`" in line:
            bullets[line[3 : line.index("/`")]] = line
    return bullets


def test_design_names_every_module_of_every_package() -> None:
    # Sub-packages too: the layout in the design is the newcomer's map, so a module
    # it does not name (or a bullet for a folder that is gone) fails here.
    bullets = _design_bullets()
    for name, folder in _package_folders().items():
        rel = folder.relative_to(ROOT).as_posix()
        if rel.startswith("api/kubelet/") or rel == "api/schemas":
            continue  # generated stubs and data, described with their parent
        assert rel in bullets, f"docs/design.md#layout has no bullet for {rel}/ ({name})"
        for module in sorted(folder.glob("*.py")):
            generated = module.stem.endswith(("_pb2", "_pb2_grpc"))
            if module.stem == "__init__" or generated:
                continue
            assert f"`{module.name}`" in bullets[rel], (
                f"docs/design.md#layout: the bullet of {rel}/ does not name {module.name}"
            )

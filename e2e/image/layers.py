"""The two layers of the image: Debian's Python 3.11 (base) and our venv (app).

- base: the packages of `e2e.image.debian`, unpacked with `dpkg-deb -x` into a
  merged-/usr tree, documentation other than copyright files left out (SKIP), bytecode
  precompiled, with `/etc/passwd` and `/etc/group` of user 65532. Cached on its own
  (`base-<key>.tar.gz` and its .json), keyed by the Debian packages and what here
  shapes it.
- app: the venv `/opt/drasil` written directly: `pyvenv.cfg`,
  `bin/python -> /usr/bin/python3.11`, site-packages by `pip install --target` for
  cp311/manylinux at the versions `.venv` has, console scripts from the wheel's entry
  points, bytecode precompiled (`unchecked-hash`: the root filesystem is read-only).
"""

from __future__ import annotations

import compileall
import hashlib
import importlib.metadata
import json
import os
import py_compile
import re
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from e2e import oci, paths
from e2e.binaries import Writer
from e2e.image.debian import ROOTS, STOP, DebPackage, download
from e2e.image.tools import FORMAT, ImageBuildError, images_dir, run
from e2e.oci import Entry, Layer

PYTHON = "python3.11"
VENV = "opt/drasil"
SITE_PACKAGES = f"{VENV}/lib/{PYTHON}/site-packages"
# Paths of the packages not worth shipping (docs, manuals, lintian overrides); copyright
# files are kept, as Debian's licences ask.
SKIP = re.compile(r"^usr/share/(doc/[^/]+/(?!copyright$).*|man/.*|info/.*|lintian/.*)$")
# Top-level directories that Debian 12 merges into /usr.
MERGED = ("bin", "sbin", "lib", "lib64")
PLATFORMS = (
    "manylinux_2_36_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)
SOURCE_PARTS = ("pyproject.toml", "README.md", "api", "driver", "kubeletplugin", "controller")


# ---- trees of files ----------------------------------------------------------------


def _merged_usr(rel: str) -> str:
    top, _, rest = rel.partition("/")
    return f"usr/{top}/{rest}".rstrip("/") if top in MERGED else rel


def tree_entries(
    root: Path,
    *,
    rename: Callable[[str], str] | None = None,
    skip: Callable[[str], bool] | None = None,
) -> list[Entry]:
    """Every file, directory and symlink under `root` (hard links become copies), at
    `rename(path)`, without those `skip(renamed path)` refuses."""
    entries: dict[str, Entry] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames) + sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            arcname = rename(rel) if rename else rel
            if skip is not None and skip(arcname):
                continue
            mode = path.lstat().st_mode & 0o7777
            if path.is_symlink():
                entry = Entry(arcname, 0o777, link=os.readlink(path))
            elif path.is_dir():
                entry = Entry(arcname, mode)
            else:
                entry = Entry(arcname, mode, path)
            seen = entries.get(arcname)
            if seen is not None and (seen.content, seen.link) != (entry.content, entry.link):
                if entry.content is None and entry.link is None:
                    continue  # the same directory reached twice (lib/ and usr/lib/)
                raise ImageBuildError(f"{arcname} comes from two places")
            entries[arcname] = entry
    return list(entries.values())


def compile_tree(tree: Path, *, prefix: str) -> None:
    """Precompile .py under `tree` as if it lived at /`prefix`, hash-based (no mtimes)."""
    compileall.compile_dir(
        str(tree),
        quiet=2,
        stripdir=str(tree),
        prependdir=f"/{prefix}",
        workers=0,
        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
    )


# ---- the base layer: Debian's Python ---------------------------------------------------

PASSWD = (
    b"root:x:0:0:root:/root:/usr/sbin/nologin\n"
    b"drasil:x:65532:65532:drasil:/nonexistent:/usr/sbin/nologin\n"
)
GROUP = b"root:x:0:\ndrasil:x:65532:\n"


def base_layer(debs: Sequence[DebPackage], out: Writer) -> Layer:
    """The base layer of `debs` (from the cache, else built into it)."""
    recipe = json.dumps([FORMAT, [d.__dict__ for d in debs]]).encode() + _base_recipe()
    key = hashlib.sha256(recipe).hexdigest()[:20]
    layer = images_dir() / f"base-{key}.tar.gz"
    meta_path = layer.with_suffix(".json")
    if layer.exists() and meta_path.exists():
        return _cached_layer(layer, json.loads(meta_path.read_text()))
    print(f"e2e.image: base layer from {len(debs)} Debian packages", file=out, flush=True)
    with tempfile.TemporaryDirectory(prefix="drasil-image-base-") as tmp:
        work = Path(tmp)
        (work / "debs").mkdir()
        staging = work / "root"
        staging.mkdir()
        for deb in download(debs, work / "debs"):
            run(f"dpkg-deb -x {deb.name}", ["dpkg-deb", "-x", str(deb), str(staging)])
        compile_tree(staging / "usr" / "lib" / PYTHON, prefix=f"usr/lib/{PYTHON}")
        entries = tree_entries(
            staging, rename=_merged_usr, skip=lambda a: bool(SKIP.match(a)) or a in MERGED
        )
        entries += [Entry(top, 0o777, link=f"usr/{top}") for top in MERGED]
        entries += [
            Entry("etc/passwd", 0o644, PASSWD),
            Entry("etc/group", 0o644, GROUP),
            Entry("tmp", 0o1777),
            Entry("proc", 0o555),
            Entry("sys", 0o555),
            Entry("dev", 0o755),
            Entry("root", 0o700),
        ]
        tmp_layer = layer.with_name(f".{layer.name}.tmp-{os.getpid()}")
        try:
            written = oci.write_layer(entries, tmp_layer, compress=True)
        except BaseException:
            tmp_layer.unlink(missing_ok=True)
            raise
        meta = {
            "diff_id": written.diff_id,
            "digest": written.digest,
            "size": written.size,
            "debian": {d.name: d.version for d in debs},
        }
        os.replace(tmp_layer, layer)
        paths.write_atomic(meta_path, json.dumps(meta, indent=1))
    return _cached_layer(layer, meta)


def _cached_layer(path: Path, meta: dict[str, Any]) -> Layer:
    return Layer(path, meta["diff_id"], meta["digest"], meta["size"], oci.MEDIA_LAYER_GZIP)


def _base_recipe() -> bytes:
    """The parts of this file that shape the base layer (not the app layer's)."""
    return json.dumps(
        [ROOTS, sorted(STOP), SKIP.pattern, MERGED, PASSWD.hex(), GROUP.hex()]
    ).encode()


# ---- the app layer: our wheel in a venv ------------------------------------------------


def _copy_source(into: Path) -> Path:
    src = into / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".mypy_cache", "*.egg-info")
    for part in SOURCE_PARTS:
        path = paths.CHECKOUT / part
        if path.is_dir():
            shutil.copytree(path, src / part, ignore=ignore)
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / part)
    return src


def build_wheel(into: Path) -> Path:
    """Our wheel, from a copy of the source (setuptools would write into the tree)."""
    src = _copy_source(into)
    dist = into / "dist"
    run(
        "pip wheel (drasil)",
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dist), str(src)],
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    (wheel,) = dist.glob("drasil-*.whl")
    return wheel


def wheel_content_hash(wheel: Path) -> str:
    """A hash of what the wheel holds, not of its zip bytes (which carry timestamps)."""
    sha = hashlib.sha256()
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            sha.update(name.encode() + b"\0" + hashlib.sha256(z.read(name)).digest())
    return sha.hexdigest()


def pinned_versions() -> str:
    """pip constraints: every distribution of the running environment but ours."""
    lines = {
        f"{dist.metadata['Name']}=={dist.version}"
        for dist in importlib.metadata.distributions()
        if dist.metadata["Name"] and dist.metadata["Name"].lower() != "drasil"
    }
    return "\n".join(sorted(lines, key=str.lower)) + "\n"


CONSOLE_SCRIPT = """#!/{venv}/bin/python
import sys

from {module} import {func}

if __name__ == "__main__":
    sys.exit({func}())
"""


def app_layer(wheel: Path, constraints: str, work: Path, python_version: str) -> Layer:
    """The app layer: the venv of `wheel` and its dependencies (`constraints`)."""
    root = _app_tree(wheel, constraints, work, python_version)
    return oci.write_layer(tree_entries(root), work / "app.tar.gz", compress=True)


def _app_tree(wheel: Path, constraints: str, work: Path, python_version: str) -> Path:
    root = work / "app"
    site = root / SITE_PACKAGES
    (work / "constraints.txt").write_text(constraints)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-compile",
        "--no-warn-script-location",
        "--target",
        str(site),
        "--only-binary=:all:",
        "--implementation=cp",
        "--python-version=3.11",
        "--abi=cp311",
        *(f"--platform={p}" for p in PLATFORMS),
        "--constraint",
        str(work / "constraints.txt"),
        str(wheel),
    ]
    run(
        "pip install (the image's site-packages)",
        cmd,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    shutil.rmtree(site / "bin", ignore_errors=True)  # scripts with this machine's shebang
    venv = root / VENV
    bin_dir = venv / "bin"
    bin_dir.mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(
        f"home = /usr/bin\ninclude-system-site-packages = false\nversion = {python_version}\n"
    )
    os.symlink(f"/usr/bin/{PYTHON}", bin_dir / "python")
    os.symlink("python", bin_dir / "python3")
    os.symlink("python", bin_dir / PYTHON)
    (entry_points,) = site.glob("drasil-*.dist-info/entry_points.txt")
    scripts = _console_scripts(entry_points.read_text())
    for name, (module, func) in scripts.items():
        script = bin_dir / name
        script.write_text(CONSOLE_SCRIPT.format(venv=VENV, module=module, func=func))
        script.chmod(0o755)
    compile_tree(site, prefix=SITE_PACKAGES)
    contents = {
        "python": {
            d.metadata["Name"]: d.version
            for d in importlib.metadata.distributions(path=[str(site)])
        },
        "console_scripts": sorted(scripts),
    }
    (venv / "image-contents.json").write_text(json.dumps(contents, indent=1, sort_keys=True))
    return root


def _console_scripts(text: str) -> dict[str, tuple[str, str]]:
    scripts: dict[str, tuple[str, str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "console_scripts" and "=" in line:
            name, target = (s.strip() for s in line.split("=", 1))
            module, func = target.split(":")
            scripts[name] = (module, func)
    return scripts

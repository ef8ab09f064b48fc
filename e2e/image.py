"""drasil's container image, built locally as an OCI archive: no registry, no Docker engine.

The `Dockerfile` at the top of the repository builds the image for registries. No Docker
engine runs where the tests run, and no registry is reachable, so this module builds an
image with the same layout from the same inputs, in Python:

- base: the Dockerfile starts from `python:3.11-slim-bookworm` (Debian 12, CPython 3.11
  built from source in `/usr/local`). Here it is Debian 12's own `python3.11` (3.11.2
  with Debian's fixes): `apt-get download` of `python3.11-minimal`,
  `libpython3.11-stdlib`, `libstdc++6` and their dependencies (minus those only dpkg's
  maintainer scripts use, `STOP`), unpacked with `dpkg-deb -x` into a merged-/usr tree,
  documentation other than copyright files left out.
- our code: both build a wheel of the project (here from a copy of the source tree).
- install: the Dockerfile makes a venv `/opt/drasil` with the wheel and its dependencies
  and no pip. Here the same venv is written directly: `pyvenv.cfg`,
  `bin/python -> /usr/bin/python3.11`, its site-packages by `pip install --target` for
  cp311/manylinux, console scripts from the wheel's entry points.
- versions: the Dockerfile resolves dependencies within pyproject.toml's bounds at build
  time; here they are pinned to what `.venv` has installed (what the tests ran with).
- the same user `65532:65532`, `PATH`, and entrypoint `/opt/drasil/bin/drasil`; the chart
  runs `drasil-kubelet-plugin` / `drasil-controller` from `PATH`.
- neither has compilers, pip or setuptools; this one has no shell or coreutils either.

Two layers, base and app, each a deterministic gzipped tar (sorted, root-owned, fixed
mtime), so the same inputs give the same digests. Bytecode is precompiled
(`unchecked-hash` .pyc): the root filesystem is read-only in the chart.

Archives are cached in `<cache>/images/drasil/` under a key made of everything they are
built from (this file, the wheel's content, the pinned Python versions, the Debian
package versions); a warm `build_image()` builds only the wheel (a few seconds) to learn
its content hash. The base layer has its own cache entry keyed by the Debian packages;
the newest three archives (and two base layers) are kept.

    python -m e2e.image build                     # prints the archive and the image name
    python -m e2e.image import --ctr PATH --address SOCKET

`import_image()` loads an archive into containerd's `k8s.io` namespace with
`ctr images import`, where kubelet finds it (`image.pullPolicy: Never`).
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import fcntl
import gzip
import hashlib
import importlib.metadata
import io
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from e2e import paths

# Bump when what this module writes changes in a way the inputs do not show.
FORMAT = 1
REPOSITORY = "localhost/drasil"
MTIME = 0
PYTHON = "python3.11"
VENV = "opt/drasil"
SITE_PACKAGES = f"{VENV}/lib/{PYTHON}/site-packages"
USER = "65532:65532"
ENV = (
    f"PATH=/{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG=C.UTF-8",
    "PYTHONDONTWRITEBYTECODE=1",
    "PYTHONUNBUFFERED=1",
)
ENTRYPOINT = (f"/{VENV}/bin/drasil",)
# What the image needs of Debian; everything they depend on comes along.
ROOTS = ("python3.11-minimal", "libpython3.11-stdlib", "libstdc++6", "libgcc-s1")
# Dependencies only dpkg's maintainer scripts use (readline-common's install-info
# trigger, debconf prompts); an image that is never dpkg-configured does not need them.
STOP = frozenset({"dpkg", "install-info", "debconf", "perl-base", "tar"})
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

MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"

REPO = Path(__file__).resolve().parent.parent


class ImageBuildError(RuntimeError):
    """A step of the image build failed; says which and why."""


@dataclass(frozen=True)
class LocalImage:
    """An OCI archive in the cache and the name it imports as."""

    name: str  # localhost/drasil:local-<key>
    archive: Path
    manifest_digest: str
    config: dict[str, Any]
    layers: tuple[str, ...]  # blob digests, base first

    @property
    def repository(self) -> str:
        return self.name.rsplit(":", 1)[0]

    @property
    def tag(self) -> str:
        return self.name.rsplit(":", 1)[1]


@dataclass(frozen=True)
class DebPackage:
    name: str
    version: str
    sha256: str


# ---- small helpers ---------------------------------------------------------------------


def images_dir() -> Path:
    return paths.cache_root() / "images" / "drasil"


def _run(step: str, cmd: Sequence[str], **kwargs: Any) -> str:
    try:
        done = subprocess.run(
            list(cmd), capture_output=True, text=True, check=False, timeout=900, **kwargs
        )
    except OSError as e:
        raise ImageBuildError(f"{step}: cannot run {cmd[0]}: {e}") from e
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-30:])
        raise ImageBuildError(f"{step} failed ({done.returncode}): {' '.join(cmd)}\n{tail}")
    return done.stdout


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    """Two sessions building at once would race on the same cache files."""
    images_dir().mkdir(parents=True, exist_ok=True)
    with open(images_dir() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


class _Hashing(io.RawIOBase):
    """A write-only stream that hashes and counts what passes through to `sink`."""

    def __init__(self, sink: IO[bytes]) -> None:
        self.sink = sink
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self.sha.update(chunk)
        self.size += len(chunk)
        self.sink.write(chunk)
        return len(chunk)


# ---- Debian packages -------------------------------------------------------------------


def _ensure_apt_lists() -> None:
    if any(APT_LISTS.glob("*Packages*")):
        return
    probe = subprocess.run(
        ["apt-cache", "show", "--no-all-versions", ROOTS[0]],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0 or "Version:" not in probe.stdout:
        _run("apt-get update (no package lists yet)", ["apt-get", "update", "-q"])


def _parse_depends(text: str) -> dict[str, list[list[str]]]:
    """`apt-cache depends` output -> package -> OR-groups of alternatives (virtual
    names replaced by their providers, in apt's order)."""
    deps: dict[str, list[list[str]]] = {}
    current: list[list[str]] | None = None
    group: list[str] = []
    virtual = False
    for line in text.splitlines():
        if not line.startswith(" "):
            current = deps.setdefault(line.strip(), [])
            group, virtual = [], False
            continue
        assert current is not None
        match = re.match(r"^ (\|| )(PreDepends|Depends): (.+)$", line)
        if match:
            alternative, name = match.group(1) == "|", match.group(3).strip()
            virtual = name.startswith("<")
            if not virtual:
                group.append(name)
            if not alternative:
                current.append(group)
                group = []
        elif virtual and line.startswith("    "):
            # Providers of the virtual name of the group just closed (or still open).
            target = current[-1] if current and not group else group
            target.append(line.strip())
    return deps


def _resolve(roots: Iterable[str]) -> list[str]:
    """The dependency closure of `roots`, choosing the first alternative, without STOP."""
    wanted: list[str] = []
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        batch = sorted({p for p in todo if p not in seen and p not in STOP})
        todo = []
        if not batch:
            break
        seen.update(batch)
        wanted += batch
        text = _run(
            "apt-cache depends",
            [
                "apt-cache",
                "depends",
                "--no-recommends",
                "--no-suggests",
                "--no-conflicts",
                "--no-breaks",
                "--no-replaces",
                "--no-enhances",
                *batch,
            ],
        )
        for groups in _parse_depends(text).values():
            for alternatives in groups:
                if not alternatives:
                    continue
                # A group satisfied by something already chosen (or deliberately left
                # out) needs nothing new.
                if any(a in seen or a in STOP for a in alternatives):
                    continue
                todo.append(alternatives[0])
    return sorted(wanted)


APT_LISTS = Path("/var/lib/apt/lists")


def _apt_lists_state() -> str:
    """Changes whenever `apt-get update` brought new package indexes."""
    state = [
        (p.name, p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(APT_LISTS.glob("*Packages*"))
    ]
    return hashlib.sha256(json.dumps([state, ROOTS, sorted(STOP)]).encode()).hexdigest()[:20]


def debian_packages() -> list[DebPackage]:
    """The Debian packages of the base layer, at the versions apt would fetch now
    (remembered per state of apt's package lists: apt-cache takes seconds)."""
    _ensure_apt_lists()
    remembered = images_dir() / f"debian-{_apt_lists_state()}.json"
    if remembered.exists():
        return [DebPackage(**d) for d in json.loads(remembered.read_text())]
    debs = _debian_packages()
    images_dir().mkdir(parents=True, exist_ok=True)
    _write_atomic(remembered, json.dumps([d.__dict__ for d in debs], indent=1).encode())
    return debs


def _debian_packages() -> list[DebPackage]:
    names = _resolve(ROOTS)
    text = _run("apt-cache show", ["apt-cache", "show", "--no-all-versions", *names])
    found: dict[str, DebPackage] = {}
    for record in text.strip().split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in record.splitlines() if ": " in line and line[0] != " "
        )
        name = fields.get("Package", "")
        if name in names and name not in found:
            found[name] = DebPackage(name, fields["Version"], fields["SHA256"])
    missing = sorted(set(names) - set(found))
    if missing:
        raise ImageBuildError(f"apt-cache show knows no candidate for {missing}")
    return [found[n] for n in names]


def _download(debs: Sequence[DebPackage], into: Path) -> list[Path]:
    _run(
        "apt-get download",
        ["apt-get", "download", "-q", *(f"{d.name}={d.version}" for d in debs)],
        cwd=into,
    )
    files = []
    for deb in debs:
        (path,) = into.glob(f"{deb.name}_*.deb")
        if hashlib.sha256(path.read_bytes()).hexdigest() != deb.sha256:
            raise ImageBuildError(f"{path.name}: SHA256 differs from the package index")
        files.append(path)
    return files


# ---- deterministic layers --------------------------------------------------------------


def _merged_usr(rel: str) -> str:
    top, _, rest = rel.partition("/")
    return f"usr/{top}/{rest}".rstrip("/") if top in MERGED else rel


def _write_layer(
    entries: Sequence[tuple[str, Path | bytes | None, str | None, int]], target: Path
) -> tuple[str, str, int]:
    """Write a gzipped tar of `entries` (arcname, file path or bytes or None for a
    directory, symlink target, mode). Returns (diff_id, digest, size)."""
    with open(target, "wb") as raw:
        compressed = _Hashing(raw)
        with gzip.GzipFile(fileobj=compressed, mode="wb", mtime=MTIME, compresslevel=6) as gz:
            plain = _Hashing(gz)  # type: ignore[arg-type]
            with tarfile.open(fileobj=plain, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for arcname, content, link, mode in sorted(entries, key=lambda e: e[0]):
                    info = tarfile.TarInfo(arcname)
                    info.mtime = MTIME
                    info.uid = info.gid = 0
                    info.uname = info.gname = "root"
                    info.mode = mode
                    if link is not None:
                        info.type = tarfile.SYMTYPE
                        info.linkname = link
                        tar.addfile(info)
                    elif content is None:
                        info.type = tarfile.DIRTYPE
                        tar.addfile(info)
                    elif isinstance(content, bytes):
                        info.size = len(content)
                        tar.addfile(info, io.BytesIO(content))
                    else:
                        info.size = content.stat().st_size
                        with open(content, "rb") as f:
                            tar.addfile(info, f)
    return (
        f"sha256:{plain.sha.hexdigest()}",
        f"sha256:{compressed.sha.hexdigest()}",
        compressed.size,
    )


Entry = tuple[str, Path | bytes | None, str | None, int]


def _tree_entries(root: Path, *, rename: Any = None, skip: Any = None) -> list[Entry]:
    """Every file, directory and symlink under `root` (hard links become copies)."""
    entries: dict[str, Entry] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames) + sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            arcname = rename(rel) if rename else rel
            if skip is not None and skip(arcname):
                continue
            st = path.lstat()
            if path.is_symlink():
                entry: Entry = (arcname, None, os.readlink(path), 0o777)
            elif path.is_dir():
                entry = (arcname, None, None, st.st_mode & 0o7777)
            else:
                entry = (arcname, path, None, st.st_mode & 0o7777)
            if arcname in entries and entries[arcname][1:3] != entry[1:3]:
                if entry[1] is None and entry[2] is None:
                    continue  # the same directory reached twice (lib/ and usr/lib/)
                raise ImageBuildError(f"{arcname} comes from two places")
            entries[arcname] = entry
    return list(entries.values())


def _parents(entries: list[Entry]) -> list[Entry]:
    have = {e[0] for e in entries}
    dirs = set()
    for arcname, *_ in entries:
        parts = arcname.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    return entries + [(d, None, None, 0o755) for d in sorted(dirs - have)]


def _compile(tree: Path, *, prefix: str) -> None:
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


def _base_layer(debs: Sequence[DebPackage], out: Any) -> tuple[Path, dict[str, Any]]:
    recipe = json.dumps([FORMAT, [d.__dict__ for d in debs]]).encode() + _base_recipe()
    key = hashlib.sha256(recipe).hexdigest()[:20]
    layer = images_dir() / f"base-{key}.tar.gz"
    meta_path = layer.with_suffix(".json")
    if layer.exists() and meta_path.exists():
        return layer, json.loads(meta_path.read_text())
    print(f"e2e.image: base layer from {len(debs)} Debian packages", file=out, flush=True)
    with tempfile.TemporaryDirectory(prefix="drasil-image-base-") as tmp:
        work = Path(tmp)
        (work / "debs").mkdir()
        staging = work / "root"
        staging.mkdir()
        for deb in _download(debs, work / "debs"):
            _run(f"dpkg-deb -x {deb.name}", ["dpkg-deb", "-x", str(deb), str(staging)])
        _compile(staging / "usr" / "lib" / PYTHON, prefix=f"usr/lib/{PYTHON}")
        entries = _tree_entries(
            staging, rename=_merged_usr, skip=lambda a: bool(SKIP.match(a)) or a in MERGED
        )
        entries += [(top, None, f"usr/{top}", 0o777) for top in MERGED]
        entries += [
            ("etc/passwd", PASSWD, None, 0o644),
            ("etc/group", GROUP, None, 0o644),
            ("tmp", None, None, 0o1777),
            ("proc", None, None, 0o555),
            ("sys", None, None, 0o555),
            ("dev", None, None, 0o755),
            ("root", None, None, 0o700),
        ]
        tmp_layer = layer.with_name(f".{layer.name}.tmp-{os.getpid()}")
        try:
            diff_id, digest, size = _write_layer(_parents(entries), tmp_layer)
        except BaseException:
            tmp_layer.unlink(missing_ok=True)
            raise
        meta = {
            "diff_id": diff_id,
            "digest": digest,
            "size": size,
            "debian": {d.name: d.version for d in debs},
        }
        os.replace(tmp_layer, layer)
        _write_atomic(meta_path, json.dumps(meta, indent=1).encode())
    return layer, meta


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
        path = REPO / part
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
    _run(
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
    _run(
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
    _compile(site, prefix=SITE_PACKAGES)
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


# ---- the OCI archive -------------------------------------------------------------------


def _python_version(debs: Sequence[DebPackage]) -> str:
    version = next(d.version for d in debs if d.name == "python3.11-minimal")
    return version.split("-")[0]


def build_image(*, out: Any = None) -> LocalImage:
    """Build (or find in the cache) the image; returns its archive and name."""
    out = out if out is not None else sys.stderr
    with _lock(), tempfile.TemporaryDirectory(prefix="drasil-image-") as tmp:
        work = Path(tmp)
        wheel = build_wheel(work)
        debs = debian_packages()
        constraints = pinned_versions()
        key = hashlib.sha256(
            json.dumps(
                {
                    "format": FORMAT,
                    "module": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
                    "wheel": wheel_content_hash(wheel),
                    "constraints": constraints,
                    "debian": [d.__dict__ for d in debs],
                },
                sort_keys=True,
            ).encode()
        ).hexdigest()
        name = f"{REPOSITORY}:local-{key[:16]}"
        archive = images_dir() / f"drasil-{key[:16]}.oci.tar"
        meta_path = archive.with_suffix(".json")
        if archive.exists() and meta_path.exists():
            return _load(name, archive, meta_path)
        base, base_meta = _base_layer(debs, out)
        print(f"e2e.image: app layer ({wheel.name} and its dependencies)", file=out, flush=True)
        app_root = _app_tree(wheel, constraints, work, _python_version(debs))
        app_layer = work / "app.tar.gz"
        diff_id, digest, size = _write_layer(_parents(_tree_entries(app_root)), app_layer)
        config = _config(
            [base_meta["diff_id"], diff_id],
            labels={
                "org.opencontainers.image.title": "drasil",
                "org.opencontainers.image.version": _wheel_version(wheel),
                "org.opencontainers.image.description": "drasil DRA driver (local build)",
                "dev.drasil.image.build": "e2e.image",
            },
        )
        layers = [
            (base, base_meta["digest"], base_meta["size"]),
            (app_layer, digest, size),
        ]
        manifest_digest = _write_archive(archive, name=name, config=config, layers=layers)
        meta = {
            "name": name,
            "manifest": manifest_digest,
            "config": config,
            "layers": [d for _, d, _ in layers],
        }
        _write_atomic(meta_path, json.dumps(meta, indent=1).encode())
        print(f"e2e.image: {name} -> {archive}", file=out, flush=True)
        _prune()
        return _load(name, archive, meta_path)


KEEP_ARCHIVES = 3  # every source change makes a new ~55 MB archive


def _prune() -> None:
    """Drop all but the newest archives and base layers (each also has a .json)."""
    for pattern, keep in (("drasil-*.oci.tar", KEEP_ARCHIVES), ("base-*.tar.gz", 2)):
        found = sorted(images_dir().glob(pattern), key=lambda f: f.stat().st_mtime, reverse=True)
        for old in found[keep:]:
            old.with_suffix(".json").unlink(missing_ok=True)  # as build_image names them
            old.unlink(missing_ok=True)


def _wheel_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def _load(name: str, archive: Path, meta_path: Path) -> LocalImage:
    meta = json.loads(meta_path.read_text())
    return LocalImage(
        name=name,
        archive=archive,
        manifest_digest=meta["manifest"],
        config=meta["config"],
        layers=tuple(meta["layers"]),
    )


def _config(diff_ids: list[str], *, labels: dict[str, str]) -> dict[str, Any]:
    created = "1970-01-01T00:00:00Z"
    return {
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "config": {
            "User": USER,
            "Env": list(ENV),
            "Entrypoint": list(ENTRYPOINT),
            "WorkingDir": "/",
            "Labels": labels,
        },
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [
            {"created": created, "created_by": "e2e.image: Debian python3.11 (base)"},
            {"created": created, "created_by": "e2e.image: /opt/drasil venv (app)"},
        ],
    }


def _write_archive(
    archive: Path, *, name: str, config: dict[str, Any], layers: Sequence[tuple[Path, str, int]]
) -> str:
    config_bytes = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {
            "mediaType": MEDIA_CONFIG,
            "digest": _digest(config_bytes),
            "size": len(config_bytes),
        },
        "layers": [{"mediaType": MEDIA_LAYER, "digest": d, "size": s} for _, d, s in layers],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest_digest = _digest(manifest_bytes)
    index = {
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [
            {
                "mediaType": MEDIA_MANIFEST,
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                # containerd names the image after the first; OCI tools read the second.
                "annotations": {
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1],
                },
            }
        ],
    }
    small: list[tuple[str, bytes]] = [
        ("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
        ("index.json", json.dumps(index, sort_keys=True).encode()),
        (f"blobs/sha256/{_digest(config_bytes)[7:]}", config_bytes),
        (f"blobs/sha256/{manifest_digest[7:]}", manifest_bytes),
    ]
    tmp = archive.with_name(f".{archive.name}.tmp-{os.getpid()}")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for dirname in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(dirname)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, MTIME
            tar.addfile(info)
        for arcname, data in small:
            info = tarfile.TarInfo(arcname)
            info.size, info.mode, info.mtime = len(data), 0o644, MTIME
            tar.addfile(info, io.BytesIO(data))
        for path, digest, size in layers:
            info = tarfile.TarInfo(f"blobs/sha256/{digest[7:]}")
            info.size, info.mode, info.mtime = size, 0o644, MTIME
            with open(path, "rb") as f:
                tar.addfile(info, f)
    os.replace(tmp, archive)
    return manifest_digest


# ---- using the image -------------------------------------------------------------------


def unpack(image: LocalImage, into: Path) -> Path:
    """The image's root filesystem: its layers extracted in order into `into`."""
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(image.archive) as outer:
        for digest in image.layers:
            member = outer.extractfile(f"blobs/sha256/{digest[7:]}")
            assert member is not None
            with tarfile.open(fileobj=member, mode="r|gz") as layer:
                layer.extractall(into, filter="tar")
    return into


# A container without a container runtime, for tests of the image: the child unshares
# its mount namespace, bind-mounts what a Pod would mount (hostPath dirs, the service
# account token), mounts tmpfs, /proc and /dev, makes the image's root read-only,
# chroots into it, takes the uid/gid, drops every capability (bounding set included),
# sets no_new_privs and execs the command: what `securityContext: {runAsUser: 0,
# capabilities: {drop: [ALL]}, allowPrivilegeEscalation: false,
# readOnlyRootFilesystem: true}` gives a container. It shares the host's network.
_SANDBOX = r"""
import ctypes, json, os, sys
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None
    flags = ctypes.c_ulong(flags)
    check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {dst}")
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT = 1, 2, 4, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
check(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
mount(None, "/", None, MS_REC | MS_PRIVATE)
root = spec["root"]
mount(root, root, None, MS_BIND | MS_REC)
for target, source in spec["binds"]:
    mount(source, root + target, None, MS_BIND)
for target in spec["tmpfs"]:
    mount("tmpfs", root + target, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=1777")
mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV)
mount("/dev", root + "/dev", None, MS_BIND | MS_REC)
mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
os.chroot(root)
os.chdir(spec["workdir"])
for cap in range(64):
    libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; EINVAL past the last cap
os.setgroups([])
os.setgid(spec["gid"])
os.setuid(spec["uid"])
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]
check(libc.syscall(126, ctypes.byref(Header(0x20080522, 0)), (Data * 2)()), "capset")
check(libc.prctl(38, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
os.execve(spec["argv"][0], spec["argv"], spec["env"])
"""


def sandbox_command(
    rootfs: Path,
    argv: Sequence[str],
    *,
    binds: dict[str, Path],
    env: dict[str, str],
    uid: int = 0,
    gid: int = 0,
    tmpfs: Sequence[str] = ("/tmp",),
) -> list[str]:
    """A command line that runs `argv` from the unpacked image `rootfs` like a
    container (see _SANDBOX); needs root. `binds` maps container paths to host paths;
    their mount points are made in `rootfs`, which must be a scratch copy."""
    for target in [*binds, *tmpfs, "/proc", "/dev"]:
        (rootfs / target.lstrip("/")).mkdir(parents=True, exist_ok=True)
    spec = {
        "root": str(rootfs),
        "binds": [[target, str(source)] for target, source in binds.items()],
        "tmpfs": list(tmpfs),
        "workdir": "/",
        "uid": uid,
        "gid": gid,
        "argv": list(argv),
        "env": env,
    }
    return [sys.executable, "-c", _SANDBOX, json.dumps(spec)]


def image_env(image: LocalImage) -> dict[str, str]:
    """The image config's Env as a dict (what a runtime starts the container with)."""
    return dict(e.split("=", 1) for e in image.config["config"]["Env"])


def import_image(
    image: LocalImage, *, ctr: Path, address: str | Path, namespace: str = "k8s.io"
) -> None:
    """Load the archive into containerd (`ctr images import`), unpacked for its default
    snapshotter, in the namespace kubelet's CRI uses."""
    _run(
        f"ctr images import {image.name}",
        [
            str(ctr),
            "--address",
            str(address),
            "--namespace",
            namespace,
            "images",
            "import",
            str(image.archive),
        ],
    )
    listed = _run(
        "ctr images ls",
        [str(ctr), "--address", str(address), "--namespace", namespace, "images", "ls", "-q"],
    )
    if image.name not in listed.split():
        raise ImageBuildError(f"ctr imported {image.archive} but lists no {image.name}:\n{listed}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.image", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="build (or find cached) and print archive and name")
    imp = commands.add_parser("import", help="build if needed and import into containerd")
    imp.add_argument("--ctr", required=True, type=Path)
    imp.add_argument("--address", required=True)
    imp.add_argument("--namespace", default="k8s.io")
    args = parser.parse_args(argv)
    try:
        image = build_image()
        if args.command == "import":
            import_image(image, ctr=args.ctr, address=args.address, namespace=args.namespace)
    except ImageBuildError as e:
        print(e, file=sys.stderr)
        return 1
    print(image.archive)
    print(image.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())

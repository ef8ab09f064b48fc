"""The Debian packages of the image's base layer: Debian 12's own Python 3.11.

`debian_packages()` resolves the dependency closure of ROOTS with apt-cache (without
STOP, what only dpkg's maintainer scripts use) at the versions apt would fetch now;
`download()` fetches exactly those with `apt-get download` and checks their SHA256
against the package index.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from e2e import paths
from e2e.image.tools import ImageBuildError, images_dir, run

# What the image needs of Debian; everything they depend on comes along.
ROOTS = ("python3.11-minimal", "libpython3.11-stdlib", "libstdc++6", "libgcc-s1")
# Dependencies only dpkg's maintainer scripts use (readline-common's install-info
# trigger, debconf prompts); an image that is never dpkg-configured does not need them.
STOP = frozenset({"dpkg", "install-info", "debconf", "perl-base", "tar"})
APT_LISTS = Path("/var/lib/apt/lists")


@dataclass(frozen=True)
class DebPackage:
    name: str
    version: str
    sha256: str


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
        run("apt-get update (no package lists yet)", ["apt-get", "update", "-q"])


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
        text = run(
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
    paths.write_atomic(remembered, json.dumps([d.__dict__ for d in debs], indent=1))
    return debs


def _debian_packages() -> list[DebPackage]:
    names = _resolve(ROOTS)
    text = run("apt-cache show", ["apt-cache", "show", "--no-all-versions", *names])
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


def download(debs: Sequence[DebPackage], into: Path) -> list[Path]:
    run(
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

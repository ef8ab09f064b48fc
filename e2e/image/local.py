"""`build_image()`: drasil's image from the cache, or built into it, as an OCI archive.

Archives are cached in `<cache>/images/drasil/` under a key made of everything they are
built from (the modules of this package that shape the image and `e2e.oci`, the wheel's
content, the pinned Python versions, the Debian package versions); a warm call builds
only the wheel (a few seconds) to learn its content hash. The newest three archives
(and two base layers) are kept.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e import oci, paths
from e2e.binaries import Writer
from e2e.image import debian, layers, tools
from e2e.image.debian import DebPackage
from e2e.image.layers import VENV
from e2e.image.tools import FORMAT, images_dir

REPOSITORY = "localhost/drasil"
USER = "65532:65532"
ENV = (
    f"PATH=/{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG=C.UTF-8",
    "PYTHONDONTWRITEBYTECODE=1",
    "PYTHONUNBUFFERED=1",
)
ENTRYPOINT = (f"/{VENV}/bin/drasil",)
# The sources whose change changes the image although no input does.
_HERE = Path(__file__).resolve().parent
SHAPED_BY = (
    _HERE.parent / "oci.py",
    *(_HERE / f"{m}.py" for m in ("debian", "layers", "local", "tools")),
)
KEEP_ARCHIVES = 3  # every source change makes a new ~55 MB archive


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


def _python_version(debs: Sequence[DebPackage]) -> str:
    version = next(d.version for d in debs if d.name == "python3.11-minimal")
    return version.split("-")[0]


def _key(wheel: Path, constraints: str, debs: Sequence[DebPackage]) -> str:
    sources = hashlib.sha256(b"".join(p.read_bytes() for p in SHAPED_BY)).hexdigest()
    recipe = {
        "format": FORMAT,
        "module": sources,
        "wheel": layers.wheel_content_hash(wheel),
        "constraints": constraints,
        "debian": [d.__dict__ for d in debs],
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def build_image(*, out: Writer | None = None) -> LocalImage:
    """Build (or find in the cache) the image; returns its archive and name."""
    progress = out if out is not None else sys.stderr
    with tools.lock(), tempfile.TemporaryDirectory(prefix="drasil-image-") as tmp:
        work = Path(tmp)
        wheel = layers.build_wheel(work)
        debs = debian.debian_packages()
        constraints = layers.pinned_versions()
        key = _key(wheel, constraints, debs)
        name = f"{REPOSITORY}:local-{key[:16]}"
        archive = images_dir() / f"drasil-{key[:16]}.oci.tar"
        meta_path = archive.with_suffix(".json")
        if archive.exists() and meta_path.exists():
            return _load(name, archive, meta_path)
        base = layers.base_layer(debs, progress)
        print(
            f"e2e.image: app layer ({wheel.name} and its dependencies)", file=progress, flush=True
        )
        app = layers.app_layer(wheel, constraints, work, _python_version(debs))
        config = _config(
            [base, app],
            labels={
                "org.opencontainers.image.title": "drasil",
                "org.opencontainers.image.version": _wheel_version(wheel),
                "org.opencontainers.image.description": "drasil DRA driver (local build)",
                "dev.drasil.image.build": "e2e.image",
            },
        )
        manifest_digest = oci.write_archive(archive, name=name, config=config, layers=[base, app])
        meta = {
            "name": name,
            "manifest": manifest_digest,
            "config": config,
            "layers": [base.digest, app.digest],
        }
        paths.write_atomic(meta_path, json.dumps(meta, indent=1))
        print(f"e2e.image: {name} -> {archive}", file=progress, flush=True)
        _prune()
        return _load(name, archive, meta_path)


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


def _config(image_layers: Sequence[oci.Layer], *, labels: dict[str, str]) -> dict[str, Any]:
    return oci.image_config(
        image_layers,
        ["e2e.image: Debian python3.11 (base)", "e2e.image: /opt/drasil venv (app)"],
        User=USER,
        Env=list(ENV),
        Entrypoint=list(ENTRYPOINT),
        Labels=labels,
    )

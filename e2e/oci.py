"""OCI image archives written byte by byte, the one writer of every image the harness
builds (`e2e.node_images`, `e2e.image`).

An archive is an OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/...`: the
layers, a config, a manifest) packed into a tar, which `ctr images import` loads into
containerd under the name in the index's annotations. Every tar written here is
deterministic (entries sorted, parents before children, root-owned, mtime 0, PAX), so
the same inputs give the same digests and image IDs.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

MTIME = 0
CREATED = "1970-01-01T00:00:00Z"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"
MEDIA_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
# ctr names an imported image after the first annotation; other tools read the second
# (a tag only).
ANNOTATION_NAME = "io.containerd.image.name"
ANNOTATION_REF = "org.opencontainers.image.ref.name"


@dataclass(frozen=True)
class Entry:
    """One entry of a tar: a file (`content` bytes, or a file to copy), a symlink
    (`link`), or else a directory."""

    path: str  # relative, no leading slash
    mode: int
    content: bytes | Path | None = None
    link: str | None = None


@dataclass(frozen=True)
class Layer:
    """A layer blob written by `write_layer`."""

    path: Path
    diff_id: str  # the digest of the uncompressed tar
    digest: str  # the digest of the blob
    size: int
    media_type: str


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def with_parents(entries: Iterable[Entry]) -> list[Entry]:
    """`entries` and a directory (0755) for every parent that has no entry."""
    listed = list(entries)
    have = {e.path for e in listed}
    dirs: set[str] = set()
    for e in listed:
        parts = e.path.split("/")[:-1]
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return listed + [Entry(d, 0o755) for d in sorted(dirs - have)]


def write_tar(entries: Iterable[Entry], fileobj: Stream) -> None:
    """A deterministic tar of `entries` (and their parents) into `fileobj`."""
    with tarfile.open(fileobj=fileobj, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for e in sorted(with_parents(entries), key=lambda e: e.path):
            info = tarfile.TarInfo(e.path)
            info.mtime = MTIME
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mode = e.mode
            if e.link is not None:
                info.type = tarfile.SYMTYPE
                info.linkname = e.link
                tar.addfile(info)
            elif e.content is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif isinstance(e.content, bytes):
                info.size = len(e.content)
                tar.addfile(info, io.BytesIO(e.content))
            else:
                info.size = e.content.stat().st_size
                with open(e.content, "rb") as f:
                    tar.addfile(info, f)


class Stream(Protocol):
    """What `write_tar` writes to (tarfile's file object): a binary file, a GzipFile."""

    def read(self, size: int, /) -> bytes: ...
    def write(self, b: bytes, /) -> object: ...
    def tell(self) -> int: ...
    def seek(self, pos: int, /) -> object: ...
    def close(self) -> object: ...


class _Hashing:
    """A write-only stream that hashes and counts what passes through to `sink`."""

    def __init__(self, sink: Stream) -> None:
        self.sink = sink
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, b: bytes, /) -> int:
        self.sha.update(b)
        self.size += len(b)
        self.sink.write(b)
        return len(b)

    def read(self, size: int, /) -> bytes:
        raise io.UnsupportedOperation("write-only")

    def tell(self) -> int:
        return self.size

    def seek(self, pos: int, /) -> int:
        raise io.UnsupportedOperation("write-only")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def write_layer(entries: Iterable[Entry], target: Path, *, compress: bool) -> Layer:
    """A layer blob of `entries` at `target`: a plain tar, or gzipped (level 6, no name
    or mtime in the header) with `compress`."""
    with open(target, "wb") as raw:
        blob = _Hashing(raw)
        if not compress:
            write_tar(entries, blob)
            sha = blob.sha.hexdigest()
            return Layer(target, f"sha256:{sha}", f"sha256:{sha}", blob.size, MEDIA_LAYER)
        with gzip.GzipFile(fileobj=blob, mode="wb", mtime=MTIME, compresslevel=6) as gz:
            plain = _Hashing(gz)
            write_tar(entries, plain)
    return Layer(
        target,
        f"sha256:{plain.sha.hexdigest()}",
        f"sha256:{blob.sha.hexdigest()}",
        blob.size,
        MEDIA_LAYER_GZIP,
    )


def image_config(layers: Sequence[Layer], history: Sequence[str], **config: Any) -> dict[str, Any]:
    """The config of a linux/amd64 image of `layers`: `config` is its "config" object
    (Env, Entrypoint, User, Labels, ...; WorkingDir defaults to /), `history` says what
    made each layer."""
    return {
        "architecture": "amd64",
        "os": "linux",
        "created": CREATED,
        "config": {"WorkingDir": "/", **config},
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [{"created": CREATED, "created_by": h} for h in history],
    }


def write_archive(
    archive: Path, *, name: str, config: dict[str, Any], layers: Sequence[Layer]
) -> str:
    """The image layout of `layers` and `config`, named `name` (`repo:tag`), as a tar at
    `archive` (replaced atomically); returns the manifest's digest."""
    config_bytes = canonical_json(config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {
            "mediaType": MEDIA_CONFIG,
            "digest": digest(config_bytes),
            "size": len(config_bytes),
        },
        "layers": [
            {"mediaType": layer.media_type, "digest": layer.digest, "size": layer.size}
            for layer in layers
        ],
    }
    manifest_bytes = canonical_json(manifest)
    manifest_digest = digest(manifest_bytes)
    index = {
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [
            {
                "mediaType": MEDIA_MANIFEST,
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {ANNOTATION_NAME: name, ANNOTATION_REF: name.rsplit(":", 1)[1]},
            }
        ],
    }
    blobs: list[Entry] = [
        Entry(f"blobs/sha256/{digest(config_bytes)[7:]}", 0o644, config_bytes),
        Entry(f"blobs/sha256/{manifest_digest[7:]}", 0o644, manifest_bytes),
        *(Entry(f"blobs/sha256/{layer.digest[7:]}", 0o644, layer.path) for layer in layers),
    ]
    layout = [
        Entry("oci-layout", 0o644, json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
        Entry("index.json", 0o644, json.dumps(index, sort_keys=True).encode()),
        *blobs,
    ]
    tmp = archive.with_name(f".{archive.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as out:
            write_tar(layout, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, archive)
    return manifest_digest


def unpack(archive: Path, layers: Sequence[str], into: Path) -> Path:
    """The root filesystem of an image: the blobs `layers` (digests, base first) of
    `archive` extracted in order into `into`."""
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as outer:
        for layer in layers:
            member = outer.extractfile(f"blobs/sha256/{layer[7:]}")
            assert member is not None
            with tarfile.open(fileobj=member, mode="r|*") as tar:
                tar.extractall(into, filter="tar")
    return into

"""Where the harness keeps what it builds and what each cluster run writes, and how it
writes there (atomically) and reads its stamps."""

from __future__ import annotations

import json
import os
from pathlib import Path

from e2e.harness import versions

# The checkout this harness runs from (the folder with e2e/, bench/, charts/).
CHECKOUT = Path(__file__).resolve().parents[2]


def cache_root() -> Path:
    """`$DRASIL_CACHE_DIR`, else `$XDG_CACHE_HOME/drasil`, else `~/.cache/drasil`."""
    override = os.environ.get("DRASIL_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "drasil"


def e2e_root() -> Path:
    return cache_root() / "e2e"


def version_dir() -> Path:
    """Everything built for the pinned Kubernetes release."""
    return e2e_root() / versions.KUBERNETES


def bin_dir() -> Path:
    return version_dir() / "bin"


def work_dir() -> Path:
    """The go.mod (and main.go) of each build, and each build's full Go output."""
    return version_dir() / "work"


def runs_dir() -> Path:
    """One directory per `cluster up`: PKI, kubeconfigs, etcd data, logs, pid files."""
    return e2e_root() / "runs"


def write_atomic(path: Path, data: bytes | str) -> None:
    """Replace `path` with `data` at once: a reader sees the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if isinstance(data, str):
        tmp.write_text(data)
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)


def read_stamp(path: Path) -> dict[str, dict[str, object]]:
    """A stamp file of the cache (what each cached item was built from); empty when it
    is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}

"""An earlier commit's source tree, exported from this checkout's git history.

The upgrade test installs the chart and image of a pinned earlier commit and upgrades
them to this checkout's. Its tree is `git archive`d once into
`<cache>/e2e/sources/<commit>/` (a commit's tree never changes), so later runs only
look it up. A shallow clone fetches that one commit from its origin first; where that
fails too, the error says so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from e2e.harness import paths

_COMMIT = re.compile(r"[0-9a-f]{40}")
_DONE = ".exported"


class SourceError(RuntimeError):
    """The commit cannot be exported from this checkout."""


def exported(commit: str) -> Path:
    """The tree of ``commit`` (a full hash), exported once into the cache."""
    if not _COMMIT.fullmatch(commit):
        raise SourceError(f"{commit!r} is not a full commit hash (40 hex digits)")
    dest = paths.e2e_root() / "sources" / commit
    if (dest / _DONE).exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{commit}-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        _extract(commit, tree)
        (tree / _DONE).write_text(commit + "\n")
        shutil.rmtree(dest, ignore_errors=True)  # a half export of a crashed run
        tree.rename(dest)
    return dest


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["git", "-C", str(paths.CHECKOUT), *args], capture_output=True, check=False, timeout=120
    )


def _ensure_commit(commit: str) -> None:
    """A shallow clone lacks earlier commits: fetch just that one from its origin."""
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0:
        return
    _git("fetch", "--quiet", "--depth=1", "origin", commit)


def _extract(commit: str, into: Path) -> None:
    _ensure_commit(commit)
    archive = into.parent / "tree.tar"
    with archive.open("wb") as out:
        done = subprocess.run(
            ["git", "-C", str(paths.CHECKOUT), "archive", "--format=tar", commit],
            stdout=out,
            stderr=subprocess.PIPE,
            text=False,
            check=False,
            timeout=120,
        )
    if done.returncode != 0:
        raise SourceError(
            f"git archive {commit} failed in {paths.CHECKOUT}: "
            f"{done.stderr.decode(errors='replace').strip()} (a shallow clone lacks earlier "
            "commits: `git fetch --unshallow`)"
        )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")

"""The image build's inputs, read without building: the Dockerfile's default bases and
where the sandbox mounts inside an image root (tools.image). The built image itself is
checked in e2e/test_image.py; which archives the cache keeps is checked on empty files."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tools.image import ImageBuildError, local
from tools.image.golang import MIN_GO
from tools.image.local import dockerfile_arg
from tools.image.run import resolve_in


def test_the_go_stage_defaults_to_a_go_the_toolkit_builds_with() -> None:
    """The public Go image of the hook stage is a Debian 12 one, as the Python base, of
    a Go the toolkit's go.mod accepts; the local stand-in checks the host's Go alike."""
    image = dockerfile_arg("GO_IMAGE")
    match = re.fullmatch(r"docker\.io/library/golang:(\d+)\.(\d+)-bookworm", image)
    assert match is not None, image
    assert (int(match[1]), int(match[2])) >= MIN_GO
    assert dockerfile_arg("PYTHON_IMAGE").endswith("-bookworm")


def test_mount_targets_resolve_symlinks_inside_the_image(tmp_path: Path) -> None:
    """Debian's /var/run -> /run: the sandbox mounts at /run/..., inside the image, never
    where the link points on the host."""
    (tmp_path / "run").mkdir()
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "run").symlink_to("/run")
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "bin").symlink_to("usr/bin")
    (tmp_path / "loop").symlink_to("loop")
    secrets = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert resolve_in(tmp_path, secrets) == "/run/secrets/kubernetes.io/serviceaccount"
    assert resolve_in(tmp_path, "/bin/../bin/sh") == "/usr/bin/sh"
    assert resolve_in(tmp_path, "/../../tmp") == "/tmp"
    with pytest.raises(ImageBuildError, match="too many symlinks"):
        resolve_in(tmp_path, "/loop/x")


def test_an_archive_taken_from_the_cache_outlives_newer_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """_prune keeps the archives used last, not those built last: the upgrade test's
    earlier release, built once and then taken from the cache, stays."""
    monkeypatch.setattr(local, "images_dir", lambda: tmp_path)
    monkeypatch.setattr(local.steps, "image_exists", lambda name: False)
    archives = {}
    for age, key in enumerate(("earlier", "a", "b", "c")):  # "earlier" built first
        archive = tmp_path / f"drasil-{key}.oci.tar"
        archive.write_text(key)
        archive.with_suffix(".json").write_text("{}")
        os.utime(archive, (1000 + age, 1000 + age))
        archives[key] = archive
    local._mark_used(archives["earlier"])
    local._prune()
    assert sorted(p.name for p in tmp_path.glob("*.oci.tar")) == [
        "drasil-b.oci.tar",
        "drasil-c.oci.tar",
        "drasil-earlier.oci.tar",
    ]
    assert not archives["a"].with_suffix(".json").exists()

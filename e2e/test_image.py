"""The image the Dockerfile builds (e2e.image, buildah), started and looked into.

Each command runs in a container of the built image (`buildah from` + `buildah run`,
chroot isolation: the image's user, environment and root filesystem, no OCI runtime),
as a user would `docker run` it: the three commands answer, the user is not root, no
pip is left, the labels and manifest annotations say what the image is, and every
distribution in it is the version constraints.txt pins.
"""

from __future__ import annotations

import json
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from e2e.image import ImageBuildError, LocalImage, build_image
from e2e.image.__main__ import main as image_main
from e2e.image.constraints import pinned
from e2e.image.local import SOURCE, project_version, revision
from e2e.image.run import resolve_in

USER = "65532:65532"


@pytest.fixture(scope="module")
def image() -> LocalImage:
    return build_image()


@pytest.fixture(scope="module")
def container(image: LocalImage) -> Iterator[str]:
    name = subprocess.run(
        ["buildah", "from", "--quiet", "--pull-never", image.name],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()
    yield name
    subprocess.run(["buildah", "rm", name], capture_output=True, check=False, timeout=120)


def run_in(container: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """`argv` in the container, as the image's user, with the image's environment."""
    return subprocess.run(
        ["buildah", "run", "--isolation=chroot", container, "--", *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_the_three_commands_answer_inside_the_image(container: str) -> None:
    version = run_in(container, "drasil", "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"drasil {project_version()}"
    for command, words in (
        ("drasil-kubelet-plugin", "--node-name"),
        ("drasil-controller", "--driver-name"),
    ):
        helped = run_in(container, command, "--help")
        assert helped.returncode == 0, helped.stderr
        assert helped.stdout.startswith(f"usage: {command}")
        assert words in helped.stdout


def test_it_runs_as_the_non_root_user_with_no_pip(image: LocalImage, container: str) -> None:
    config = image.config["config"]
    assert config["User"] == USER
    assert config["Entrypoint"] == ["/opt/drasil/bin/drasil"]
    ids = run_in(container, "id", "-u")
    assert ids.stdout.strip() == "65532"
    no_pip = run_in(container, "python3", "-m", "pip", "--version")
    assert no_pip.returncode != 0
    assert "No module named pip" in no_pip.stderr
    # Nothing the build mounted (the host pip's CA bundle) stayed behind.
    leftovers = run_in(container, "ls", "-A", "/mnt")
    assert leftovers.returncode == 0
    assert leftovers.stdout == ""


def test_labels_and_annotations_say_version_revision_source(image: LocalImage) -> None:
    expected = {
        "org.opencontainers.image.version": project_version(),
        "org.opencontainers.image.revision": revision(),
        "org.opencontainers.image.source": SOURCE,
    }
    labels = image.config["config"]["Labels"]
    assert expected.items() <= labels.items()
    assert expected.items() <= image.annotations.items()
    assert labels["org.opencontainers.image.title"] == "drasil"


def test_every_distribution_in_the_image_is_the_pinned_version(container: str) -> None:
    listing = run_in(
        container,
        "python3",
        "-c",
        "import importlib.metadata as m, json; "
        "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))",
    )
    assert listing.returncode == 0, listing.stderr
    installed = {canonicalize_name(k): v for k, v in json.loads(listing.stdout).items()}
    assert installed.pop(canonicalize_name("drasil")) == project_version()
    pins = pinned()
    assert {name: pins.get(name) for name in installed} == installed


def test_make_image_writes_the_archive_to_dist_and_tags_the_version(
    image: LocalImage, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What `make image` runs: the archive in dist/ is the build's, tagged with the
    version in buildah's storage."""
    assert image_main(["build", "--dist", str(tmp_path)]) == 0
    archive = tmp_path / f"drasil-{project_version()}.oci.tar"
    assert f"archive  {archive}" in capsys.readouterr().out
    with tarfile.open(archive) as tar:
        index = tar.extractfile("index.json")
        assert index is not None
        (manifest,) = json.load(index)["manifests"]
    assert manifest["digest"] == image.manifest_digest
    assert manifest["annotations"]["org.opencontainers.image.ref.name"] == image.name
    tagged = f"{image.repository}:{project_version()}"
    assert image_id(tagged) == image_id(image.name)


def image_id(name: str) -> str:
    return subprocess.run(
        ["buildah", "inspect", "--type=image", "--format={{.FromImageID}}", name],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()


@pytest.mark.pure
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

"""The image the Dockerfile builds (tools.image, buildah), started and looked into.

Each command runs in a container of the built image (`buildah from` + `buildah run`,
chroot isolation: the image's user, environment and root filesystem, no OCI runtime),
as a user would `docker run` it: the three commands answer, the user is not root, no
pip is left, the labels and manifest annotations say what the image is, and every
distribution in it is the version constraints.txt pins. NVIDIA's nvidia-cdi-hook is
where the plugin looks for it, at the Dockerfile's pinned version, and static: copied
out of the image it runs on this host with nothing of the image.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from drasil.kubeletplugin.options import BUNDLED_CDI_HOOK
from e2e.harness import versions
from tools.image import LocalImage, build_image
from tools.image.__main__ import main as image_main
from tools.image.constraints import pinned
from tools.image.local import SOURCE, dockerfile_arg, project_version, revision

USER = "65532:65532"
HOOK = "/opt/drasil/bin/nvidia-cdi-hook"
# The hooks drasil's CDI specs use (driver/nvidia/driveredits.py), as NVIDIA's generator.
HOOK_COMMANDS = (
    "create-symlinks",
    "update-ldcache",
    "enable-cuda-compat",
    "disable-device-node-modification",
)
PT_DYNAMIC, PT_INTERP = 2, 3


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


def test_the_image_carries_nvidia_cdi_hook_at_the_pinned_version(container: str) -> None:
    """Where the plugin copies it from by default (kubeletplugin/options.py), root's and
    executable by all, the toolkit version the Dockerfile pins (the same the e2e
    harness builds nvidia-ctk at, the oracle of the specs' driver files), with the
    hooks our specs name."""
    assert HOOK == BUNDLED_CDI_HOOK
    pinned_version = dockerfile_arg("NVIDIA_CTK_VERSION")
    assert pinned_version == versions.NVIDIA_CONTAINER_TOOLKIT
    version = run_in(container, HOOK, "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"NVIDIA CDI Hook version {pinned_version.removeprefix('v')}"
    helped = run_in(container, HOOK, "--help")
    assert helped.returncode == 0, helped.stderr
    for command in HOOK_COMMANDS:
        assert command in helped.stdout, helped.stdout
    mode = run_in(container, "stat", "--format=%a %u:%g", HOOK)
    assert mode.stdout.strip() == "755 0:0", mode.stderr


def _program_header_types(elf: bytes) -> list[int]:
    """p_type of every program header of a 64-bit little-endian ELF file."""
    assert elf[:4] == b"\x7fELF", "not an ELF file"
    assert elf[4] == 2, "not a 64-bit ELF file"
    assert elf[5] == 1, "not little-endian"
    (phoff,) = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    return [struct.unpack_from("<I", elf, phoff + i * phentsize)[0] for i in range(phnum)]


def test_the_hook_is_static_and_runs_on_the_host_outside_the_image(
    container: str, tmp_path: Path
) -> None:
    """The container runtime runs hooks on the host, whatever its C library: the binary
    has no ELF interpreter and no dynamic section, and a copy of it runs here with an
    empty environment."""
    copied = subprocess.run(
        ["buildah", "run", "--isolation=chroot", container, "--", "cat", HOOK],
        capture_output=True,
        check=True,
        timeout=120,
    ).stdout
    types = _program_header_types(copied)
    assert PT_INTERP not in types
    assert PT_DYNAMIC not in types
    host_copy = tmp_path / "nvidia-cdi-hook"
    host_copy.write_bytes(copied)
    os.chmod(host_copy, 0o755)
    ran = subprocess.run(
        [str(host_copy), "--version"],
        capture_output=True,
        text=True,
        env={},
        check=False,
        timeout=30,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("NVIDIA CDI Hook version ")


def image_id(name: str) -> str:
    return subprocess.run(
        ["buildah", "inspect", "--type=image", "--format={{.FromImageID}}", name],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()

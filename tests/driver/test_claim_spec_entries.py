"""A claim's CDI spec name holding something other than a regular file: read as a
damaged spec (never blocking on a FIFO, never following a symlink), and replaced by
the next write where a rename can replace it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from drasil.driver.cdi import claimspecs as cdi
from drasil.driver.cdi.claimspecs import ClaimDevice, ClaimSpecRequest
from drasil.driver.cdi.spec import CdiSpecError, encode_spec
from drasil.driver.devices import Device, DeviceType

DRIVER = "gpu.drasil.dev"
UID = "0b7c3f2e-8d1a-4c55-9e0f-1a2b3c4d5e6f"
GPU0_UUID = "GPU-11111111-2222-3333-4444-555555555555"


def request() -> ClaimSpecRequest:
    gpu = Device(
        name="gpu-0",
        type=DeviceType.GPU,
        uuid=GPU0_UUID,
        minor=0,
        attributes={"uuid": GPU0_UUID},
        capacity={"memory": 80 * 2**30},
    )
    return ClaimSpecRequest(
        claim_uid=UID, namespace="team-a", name="train", devices=(ClaimDevice(gpu),)
    )


def spec_at(root: Path) -> Path:
    return cdi.spec_path(root, driver=DRIVER, claim_uid=UID)


def make_directory(path: Path) -> None:
    path.mkdir()


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def make_symlink(path: Path) -> None:
    # A valid spec elsewhere: following the link would read it as this claim's.
    target = path.parent.parent / "elsewhere.json"
    target.write_bytes(encode_spec(cdi.build_claim_spec(request(), driver=DRIVER)))
    path.symlink_to(target)


KINDS: dict[str, tuple[Callable[[Path], None], str]] = {
    "directory": (make_directory, "a directory"),
    "fifo": (make_fifo, "a FIFO"),
    "symlink": (make_symlink, "a symlink"),
}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    cdi_root = tmp_path / "cdi"
    cdi_root.mkdir()
    return cdi_root


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_spec_that_is_not_a_file_is_a_spec_error(root: Path, kind: str) -> None:
    make, words = KINDS[kind]
    make(spec_at(root))
    with pytest.raises(CdiSpecError, match=f"{UID}.json: not a regular file \\({words}\\)"):
        cdi.read_claim_spec(root, driver=DRIVER, claim_uid=UID)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_write_replaces_a_fifo_or_symlink_without_opening_it(root: Path, kind: str) -> None:
    KINDS[kind][0](spec_at(root))
    elsewhere = root.parent / "elsewhere.json"
    before = elsewhere.read_bytes() if elsewhere.exists() else None

    path = cdi.write_claim_spec(request(), cdi_root=root, driver=DRIVER)

    assert path.is_file()
    assert not path.is_symlink()
    assert cdi.read_claim_spec(root, driver=DRIVER, claim_uid=UID) is not None
    if before is not None:
        assert elsewhere.read_bytes() == before  # the target was neither read nor written


@pytest.mark.timeout(20)
def test_a_write_moves_a_directory_aside_and_writes_the_spec(root: Path) -> None:
    """A rename cannot replace a directory: it is kept aside for a person, as the
    checkpoint keeps a corrupt file, and the claim gets its spec."""
    make_directory(spec_at(root))
    (spec_at(root) / "inside").write_text("kept")

    path = cdi.write_claim_spec(request(), cdi_root=root, driver=DRIVER)

    assert path.is_file()
    assert cdi.read_claim_spec(root, driver=DRIVER, claim_uid=UID) is not None
    (aside,) = root.glob(f"*{UID}*.corrupt-*")
    assert (aside / "inside").read_text() == "kept"
    assert list(root.glob("*.tmp")) == []

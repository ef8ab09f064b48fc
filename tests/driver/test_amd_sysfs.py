"""The sysfs readers' small parts: gfx names, locations, bounded reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from drasil.driver.amd.sysfs import (
    MAX_FILE_BYTES,
    SysfsError,
    gfx_target_name,
    location_of,
    read_dev,
    read_properties,
    read_text,
    slot_key,
)


@pytest.mark.parametrize(
    ("version", "name"),
    [
        (90402, "gfx942"),
        (90010, "gfx90a"),
        (90500, "gfx950"),
        (90400, "gfx940"),
        (110000, "gfx1100"),
    ],
)
def test_gfx_target_name(version: int, name: str) -> None:
    assert gfx_target_name(version) == name


def test_location_and_slot() -> None:
    assert location_of("0000:05:00.0") == (0, 0x500)
    assert location_of("0001:c1:02.3") == (1, 0xC113)
    # A partition's index sits in the function bits: same slot.
    assert slot_key(0, 0x503) == slot_key(0, 0x500) != slot_key(0, 0x600)


def test_read_text_is_bounded(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(b"x" * (MAX_FILE_BYTES * 3))
    assert len(read_text(big)) == MAX_FILE_BYTES


def test_read_dev_errors_name_the_file(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.write_text("226\n")
    with pytest.raises(SysfsError, match=r"dev holds '226', not major:minor"):
        read_dev(dev)
    with pytest.raises(SysfsError, match="missing"):
        read_dev(tmp_path / "nope")


def test_read_properties(tmp_path: Path) -> None:
    props = tmp_path / "properties"
    props.write_text("simd_count 912\nsimd_per_cu 4\n\n")
    assert read_properties(props) == {"simd_count": 912, "simd_per_cu": 4}
    props.write_text("simd_count many\n")
    with pytest.raises(SysfsError, match="not a number"):
        read_properties(props)

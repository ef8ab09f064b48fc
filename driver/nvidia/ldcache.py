"""Two binary formats the driver-file discovery reads: ``ld.so.cache`` and ELF's SONAME.

Both are read from a driver root that may belong to another distribution than the
plugin's image (a driver container's, a host's), so neither ``ldconfig -p`` nor the
image's dynamic loader can be asked: the bytes are parsed here, with every offset
checked, and a damaged file reads as "no entries" rather than an exception.

``ld.so.cache`` (glibc's ``elf/cache.c``): an optional old-format part (magic
``ld.so-1.7.0``, ``nlibs`` entries of 12 bytes) followed, 8-byte aligned, by the new
format: magic ``glibc-ld.so.cache`` + version ``1.1``, ``nlibs``, ``len_strings``,
flags, padding, an extension offset and three unused words (48 bytes), then ``nlibs``
entries of 24 bytes (``flags``, ``key``, ``value``, ``osversion``, ``hwcap``); key and
value are offsets of NUL-terminated strings from the start of the new-format part.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Final

_OLD_MAGIC: Final = b"ld.so-1.7.0"
_NEW_MAGIC: Final = b"glibc-ld.so.cache1.1"
_NEW_HEADER: Final = struct.Struct("<20sIIB3xI12x")
_NEW_ENTRY: Final = struct.Struct("<iIIIQ")
_OLD_HEADER_SIZE: Final = 16  # 11-byte magic padded to 12, then nlibs
_OLD_ENTRY_SIZE: Final = 12
# Entry flags: the type in the low byte (1 = ELF), the architecture in the next.
_FLAG_TYPE_ELF: Final = 0x0001
_ARCH_BITS: Final = {0x0300: 64, 0x0A00: 64, 0x0500: 64, 0x0000: 32, 0x0800: 32, 0x0900: 32}
MAX_CACHE_BYTES: Final = 64 << 20  # a real cache is well under 1 MiB


@dataclass(frozen=True)
class CacheEntry:
    """One library the cache knows: its name (``libcuda.so.1``), path and word size."""

    name: str
    path: str
    bits: int


def read_ld_cache(path: Path) -> list[CacheEntry]:
    """The entries of an ``ld.so.cache``; ``[]`` when it is missing or not one."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CACHE_BYTES + 1)
    except OSError:
        return []
    if len(data) > MAX_CACHE_BYTES:
        return []
    return parse_ld_cache(data)


def parse_ld_cache(data: bytes) -> list[CacheEntry]:
    """The entries of cache bytes in either layout; ``[]`` for bytes that are not one."""
    start = _new_format_start(data)
    if start is None or len(data) < start + _NEW_HEADER.size:
        return []
    magic, nlibs, _len_strings, _flags, _ext = _NEW_HEADER.unpack_from(data, start)
    if magic != _NEW_MAGIC:
        return []
    table = start + _NEW_HEADER.size
    if table + nlibs * _NEW_ENTRY.size > len(data):
        return []
    entries = []
    for index in range(nlibs):
        flags, key, value, _os, _hwcap = _NEW_ENTRY.unpack_from(data, table + index * 24)
        entry = _entry(data, start, flags, key, value)
        if entry is not None:
            entries.append(entry)
    return entries


def _new_format_start(data: bytes) -> int | None:
    if data.startswith(_NEW_MAGIC):
        return 0
    if not data.startswith(_OLD_MAGIC) or len(data) < _OLD_HEADER_SIZE:
        return None
    nlibs: int = struct.unpack_from("<I", data, 12)[0]
    end = _OLD_HEADER_SIZE + nlibs * _OLD_ENTRY_SIZE
    return (end + 7) & ~7


def _entry(data: bytes, start: int, flags: int, key: int, value: int) -> CacheEntry | None:
    if not flags & _FLAG_TYPE_ELF:
        return None
    bits = _ARCH_BITS.get(flags & 0xFF00)
    name, path = _string(data, start + key), _string(data, start + value)
    if bits is None or not name or not path:
        return None
    return CacheEntry(name=name, path=path, bits=bits)


def _string(data: bytes, offset: int) -> str | None:
    if not 0 <= offset < len(data):
        return None
    end = data.find(b"\0", offset, offset + 4096)
    if end < 0:
        return None
    try:
        return data[offset:end].decode()
    except UnicodeDecodeError:
        return None


# --- ELF ------------------------------------------------------------------------------

_DT_NULL: Final = 0
_DT_STRTAB: Final = 5
_DT_SONAME: Final = 14
_PT_LOAD: Final = 1
_PT_DYNAMIC: Final = 2
_PT_INTERP: Final = 3
MAX_ELF_HEADERS: Final = 256
_Segment = tuple[int, int, int, int, int]  # type, file offset, address, file size, memory size


def elf_soname(path: Path) -> str | None:
    """The ``DT_SONAME`` of a shared object (``libcuda.so.1``); ``None`` if it has none
    or is not ELF. Reads only the program headers and the dynamic section."""
    try:
        with path.open("rb") as f:
            return _soname(f.read(1 << 16), f)
    except (OSError, struct.error, ValueError):
        return None


def elf_interpreter(path: Path) -> str | None:
    """The ``PT_INTERP`` of an executable, the loader the kernel opens by that path
    (``/lib64/ld-linux-x86-64.so.2``); ``None`` if it names none (static, a script) or
    is not ELF."""
    try:
        with path.open("rb") as f:
            found = _headers(f.read(1 << 16), f)
            if found is None:
                return None
            interp = next((s for s in found[2] if s[0] == _PT_INTERP), None)
            if interp is None:
                return None
            f.seek(interp[1])
            return f.read(min(interp[3], 4096)).split(b"\0", 1)[0].decode() or None
    except (OSError, struct.error, ValueError):
        return None


def _headers(head: bytes, f: BinaryIO) -> tuple[bool, str, list[_Segment]] | None:
    """Width, byte order and program headers of an ELF file; None if not ELF."""
    if head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
        return None
    wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
    if wide:
        phoff, phentsize, phnum = (
            _unpack(order + "Q", head, 32),
            _u16(order, head, 54),
            _u16(order, head, 56),
        )
    else:
        phoff, phentsize, phnum = (
            _unpack(order + "I", head, 28),
            _u16(order, head, 42),
            _u16(order, head, 44),
        )
    if phnum > MAX_ELF_HEADERS:
        return None
    return wide, order, [_segment(f, order, wide, phoff + i * phentsize) for i in range(phnum)]


def _soname(head: bytes, f: BinaryIO) -> str | None:
    found = _headers(head, f)
    if found is None:
        return None
    wide, order, segments = found
    dynamic = next((s for s in segments if s[0] == _PT_DYNAMIC), None)
    if dynamic is None:
        return None
    entries = _dynamic_entries(f, order, wide, offset=dynamic[1], size=dynamic[4])
    strtab = next((v for tag, v in entries if tag == _DT_STRTAB), None)
    soname = next((v for tag, v in entries if tag == _DT_SONAME), None)
    if strtab is None or soname is None:
        return None
    # DT_STRTAB is an address: map it to a file offset through the loadable segments.
    for kind, offset, vaddr, filesz, _memsz in segments:
        if kind == _PT_LOAD and vaddr <= strtab < vaddr + filesz:
            f.seek(offset + (strtab - vaddr) + soname)
            name = f.read(256).split(b"\0", 1)[0]
            return name.decode() or None
    return None


def _unpack(fmt: str, data: bytes, offset: int) -> int:
    value: int = struct.unpack_from(fmt, data, offset)[0]
    return value


def _u16(order: str, data: bytes, offset: int) -> int:
    return _unpack(order + "H", data, offset)


def _segment(f: BinaryIO, order: str, wide: bool, at: int) -> _Segment:
    f.seek(at)
    if wide:
        kind, _flags, offset, vaddr, _paddr, filesz, memsz = struct.unpack(
            order + "IIQQQQQ", f.read(48)
        )
    else:
        kind, offset, vaddr, _paddr, filesz, memsz = struct.unpack(order + "IIIIII", f.read(24))
    return kind, offset, vaddr, filesz, memsz


def _dynamic_entries(
    f: BinaryIO, order: str, wide: bool, *, offset: int, size: int
) -> list[tuple[int, int]]:
    fmt = order + ("qQ" if wide else "iI")
    step = struct.calcsize(fmt)
    f.seek(offset)
    data = f.read(min(size, 1 << 16))
    entries = []
    for at in range(0, len(data) - step + 1, step):
        tag, value = struct.unpack_from(fmt, data, at)
        if tag == _DT_NULL:
            break
        entries.append((tag, value))
    return entries

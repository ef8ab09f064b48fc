"""The probe's own interpreter, found on the host: the one thing in the sandbox that
the CDI spec does not give. The host's python3 runs a short query that imports what
the probe imports (ctypes, json) and prints the files it maps; those, its standard
library, the ELF interpreter, the links on the way to each and each shared object's
SONAME link make a ``Runtime`` the sandbox binds read-only at the same paths."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Literal

from drasil.driver.cdi.ldcache import elf_soname
from drasil.kubeletplugin.gpucheck.sandbox import Link, Runtime

_RUNTIME_QUERY = (
    "import ctypes, json, sys, sysconfig\n"
    "maps = [l.split(None, 5)[5].strip() for l in open('/proc/self/maps') if len(l.split()) > 5]\n"
    "paths = sysconfig.get_paths()\n"
    "print(json.dumps({'maps': sorted({m for m in maps if m.startswith('/')}),\n"
    "  'stdlib': [paths['stdlib'], paths['platstdlib']]}))\n"
)


def symlink_chain(path: str) -> tuple[list[Link], str]:
    """The links met on the way to ``path`` (each as its text) and the real path."""
    links: list[Link] = []
    parts = [p for p in Path(path).parts if p != "/"]
    done = "/"
    hops = 0
    while parts:
        here = os.path.join(done, parts.pop(0))
        if os.path.islink(here) and hops < 40:
            hops += 1
            text = os.readlink(here)
            links.append(Link(path=here, target=text, origin="runtime"))
            rest = [p for p in Path(text).parts if p != "/"]
            done = "/" if text.startswith("/") else done
            parts = rest + parts
            continue
        done = os.path.normpath(here)
    return links, done


def _interpreter(executable: str) -> str | None:
    """The ELF program interpreter (PT_INTERP) the kernel opens by its path."""
    data = Path(executable).read_bytes()[:65536]
    if data[:4] != b"\x7fELF" or data[4] != 2:  # 64-bit only
        return None
    order: Literal["little", "big"] = "little" if data[5] == 1 else "big"
    phoff = int.from_bytes(data[32:40], order)
    phentsize = int.from_bytes(data[54:56], order)
    for i in range(int.from_bytes(data[56:58], order)):
        at = phoff + i * phentsize
        if int.from_bytes(data[at : at + 4], order) == 3:  # PT_INTERP
            offset = int.from_bytes(data[at + 8 : at + 16], order)
            size = int.from_bytes(data[at + 32 : at + 40], order)
            return data[offset : offset + size].rstrip(b"\0").decode()
    return None


def soname_link(path: str) -> Link | None:
    """``libffi.so.8 -> libffi.so.8.1.2`` beside a mapped file: the loader asks for the
    SONAME, ``/proc/self/maps`` names the file."""
    try:
        soname = elf_soname(Path(path))
    except (OSError, ValueError):
        return None
    if not soname or soname == os.path.basename(path):
        return None
    return Link(os.path.join(os.path.dirname(path), soname), os.path.basename(path), "runtime")


def probe_runtime(python: str) -> Runtime:
    """What ``python`` maps and reads to run the probe (it imports ctypes and json)."""
    executable = os.path.realpath(python)
    done = subprocess.run(
        [executable, "-I", "-S", "-c", _RUNTIME_QUERY],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    found = json.loads(done.stdout)
    links: list[Link] = []
    files = [m for m in found["maps"] if os.path.isfile(m) and m != executable]
    interpreter = _interpreter(executable)
    for path in [*([interpreter] if interpreter else []), *files]:
        chain, real = symlink_chain(path)
        links += chain
        if real != executable and real not in files:
            files.append(real)
    links += [link for f in files if (link := soname_link(f)) is not None]
    directories = tuple(dict.fromkeys(os.path.realpath(d) for d in found["stdlib"]))
    unique_links = tuple({(x.path): x for x in links}.values())
    return Runtime(executable, directories, tuple(files), unique_links)

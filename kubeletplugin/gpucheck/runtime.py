"""The probe's own interpreter, found on the host: the one thing in the sandbox that
the CDI spec does not give. The host's python3 runs a short query that imports what
the probe imports (ctypes, json) and prints the files it maps; those, its standard
library, the ELF interpreter, the links on the way to each and each shared object's
SONAME link make a ``Runtime`` the sandbox binds read-only at the same paths.

With it goes the rest of glibc beside the libc it maps (``GLIBC``): a container image
brings its own C library, and the driver's libraries link against parts of it the
interpreter may not map (580.159.04's ``libcuda.so`` needs ``libdl.so.2``, its
``libnvidia-ml.so`` ``libpthread.so.0``; a CDI spec never carries them)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from drasil.driver.nvidia.ldcache import elf_interpreter, elf_soname
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


# glibc's libraries by SONAME, as an image's /usr/lib has them.
GLIBC = ("libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1")


def glibc_files(mapped: list[str]) -> list[str]:
    """The ``GLIBC`` libraries beside the mapped ``libc.so.6`` (the paths the loader
    asks for, links and all), those that exist."""
    libc = next((m for m in mapped if os.path.basename(m).startswith("libc.so")), None)
    if libc is None:
        return []
    folder = os.path.dirname(libc)
    return [p for name in GLIBC if os.path.exists(p := os.path.join(folder, name))]


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
    interpreter = elf_interpreter(Path(executable))
    for path in [*([interpreter] if interpreter else []), *files, *glibc_files(files)]:
        chain, real = symlink_chain(path)
        links += chain
        if real != executable and real not in files:
            files.append(real)
    links += [link for f in files if (link := soname_link(f)) is not None]
    directories = tuple(dict.fromkeys(os.path.realpath(d) for d in found["stdlib"]))
    unique_links = tuple({(x.path): x for x in links}.values())
    return Runtime(executable, directories, tuple(files), unique_links)

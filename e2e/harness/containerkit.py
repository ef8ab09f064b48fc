"""The container kit of `make gpu-check`'s container step (drasil.kubeletplugin.gpucheck.container).

`build_kit(dest)` writes `dest/`: `bin/` with the pinned containerd, containerd-shim-runc-v2,
runc, ctr and nvidia-cdi-hook of the e2e harness (built when missing), `lib/` with the shared
objects runc links beyond glibc (libseccomp; a GPU machine may lack them), `image.oci.tar`
(the probe image, whose `/usr/local/bin/gpu-kernel` runs a PTX kernel) and `kit.json` naming
the image and the probe. `link=True` (the e2e tests) links the binaries and the image
instead of copying them.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from pathlib import Path

from e2e.harness import node_images, versions
from e2e.harness.binaries import Writer, ensure_binaries

BINARIES = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "nvidia-cdi-hook")


def _place(source: Path, target: Path, *, link: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if link:
        target.symlink_to(source.resolve())
    else:
        shutil.copyfile(source, target)
        shutil.copymode(source, target)


def _needed_libraries(binary: Path) -> list[Path]:
    """The libraries `binary` loads (ldd) that are not glibc's, resolved on this host."""
    listed = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=False)
    found = []
    for line in listed.stdout.splitlines():
        name, _, rest = line.strip().partition(" => ")
        path = rest.split(" (")[0].strip()
        # glibc is on every machine; runc's other NEEDED libraries travel with the kit.
        if name and name not in node_images.GLIBC_LIBRARIES and path.startswith("/"):
            found.append(Path(path))
    return found


def build_kit(dest: Path, *, link: bool = False, out: Writer | None = None) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    binaries = ensure_binaries(list(BINARIES), out=out)
    for name in BINARIES:
        _place(binaries[name], dest / "bin" / name, link=link)
    for library in _needed_libraries(binaries["runc"]):
        # By its NEEDED name (the SONAME link), the file it leads to copied.
        _place(Path(os.path.realpath(library)), dest / "lib" / library.name, link=link)
    image = node_images.ensure_probe_image(out=out)
    _place(image.archive, dest / "image.oci.tar", link=link)
    facts = {
        "image": versions.PROBE_IMAGE,
        "probe": node_images.KERNEL_IN_IMAGE,
        "machine": platform.machine(),  # the harness builds for this machine only
    }
    (dest / "kit.json").write_text(json.dumps(facts, indent=2) + "\n")
    return dest

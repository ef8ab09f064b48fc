"""drasil's container image, built locally as an OCI archive: no registry, no Docker engine.

The `Dockerfile` at the top of the repository builds the image for registries. No Docker
engine runs where the tests run, and no registry is reachable, so this package builds an
image with the same layout from the same inputs, in Python:

- base: the Dockerfile starts from `python:3.11-slim-bookworm` (Debian 12, CPython 3.11
  built from source in `/usr/local`). Here it is Debian 12's own `python3.11` (3.11.2
  with Debian's fixes): `apt-get download` of `python3.11-minimal`,
  `libpython3.11-stdlib`, `libstdc++6` and their dependencies (minus those only dpkg's
  maintainer scripts use, `STOP`), unpacked with `dpkg-deb -x` into a merged-/usr tree,
  documentation other than copyright files left out.
- our code: both build a wheel of the project (here from a copy of the source tree).
- install: the Dockerfile makes a venv `/opt/drasil` with the wheel and its dependencies
  and no pip. Here the same venv is written directly: `pyvenv.cfg`,
  `bin/python -> /usr/bin/python3.11`, its site-packages by `pip install --target` for
  cp311/manylinux, console scripts from the wheel's entry points.
- versions: the Dockerfile resolves dependencies within pyproject.toml's bounds at build
  time; here they are pinned to what `.venv` has installed (what the tests ran with).
- the same user `65532:65532`, `PATH`, and entrypoint `/opt/drasil/bin/drasil`; the chart
  runs `drasil-kubelet-plugin` / `drasil-controller` from `PATH`.
- neither has compilers, pip or setuptools; this one has no shell or coreutils either.

Two layers, base and app, each a deterministic gzipped tar written by `e2e.oci`, so the
same inputs give the same digests. Bytecode is precompiled (`unchecked-hash` .pyc): the
root filesystem is read-only in the chart.

Archives are cached in `<cache>/images/drasil/` under a key made of everything they are
built from (the modules that shape the image, the wheel's content, the pinned Python
versions, the Debian package versions); a warm `build_image()` builds only the wheel (a
few seconds) to learn its content hash. The base layer has its own cache entry keyed by
the Debian packages; the newest three archives (and two base layers) are kept.

    python -m e2e.image build                     # prints the archive and the image name
    python -m e2e.image import --ctr PATH --address SOCKET

`import_image()` loads an archive into containerd's `k8s.io` namespace with
`ctr images import`, where kubelet finds it (`image.pullPolicy: Never`).

- `debian`: the Debian packages of the base layer (apt-cache, apt-get download);
- `layers`: the base layer (Debian's Python) and the app layer (our venv);
- `local`: `build_image()`, `LocalImage`, the cache of archives;
- `run`: using the image (unpack, `sandbox_command`, `import_image`);
- `sandbox`: the program `sandbox_command` runs, a file run as a script;
- `tools`: the build's error, running a host tool as a step, the cache dir and lock.
"""

from e2e.image.local import LocalImage, build_image
from e2e.image.run import image_env, import_image, sandbox_command, unpack
from e2e.image.tools import ImageBuildError

__all__ = [
    "ImageBuildError",
    "LocalImage",
    "build_image",
    "image_env",
    "import_image",
    "sandbox_command",
    "unpack",
]

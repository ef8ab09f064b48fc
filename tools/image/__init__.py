"""drasil's container image: the Dockerfile built with buildah, from Debian's packages.

`make image` and the tests build the repository's `Dockerfile` with buildah (installed
with apt-get when missing; RUN steps in a chroot, no OCI runtime or registry needed).
No registry is reachable where the tests run, so the Dockerfile's bases are built
locally and passed as build arguments: `PYTHON_IMAGE` (by default the public
`python:3.11-slim-bookworm`) from Debian 12's packages by mmdebstrap (`tools.image.base`),
and `GO_IMAGE` (by default `golang:1.26-bookworm`, the stage that builds NVIDIA's
`nvidia-cdi-hook` from the Go module proxy) from Debian 12's gcc and libc6-dev with the
host's Go toolchain (`tools.image.golang`); dependencies are pinned by constraints.txt
(`tools.image.constraints`) and the Dockerfile's `NVIDIA_CTK_VERSION`.

The result is an image in buildah's local storage, `localhost/drasil:<version>-<key>`,
and its OCI archive `<cache>/images/drasil/drasil-<key>.oci.tar`; the key is made of
every input (Dockerfile, build context, bases, version, revision), so a warm build only
hashes the context. Labels and manifest annotations: `org.opencontainers.image.version`,
`.revision` (git commit), `.source`.

    python -m tools.image build [--dist dist]   # make image: also dist/drasil-<version>.oci.tar
    python -m tools.image import --ctr PATH --address SOCKET
    python -m tools.image constraints           # rewrite constraints.txt from .venv

`import_image()` loads an archive into containerd's `k8s.io` namespace with
`ctr images import`, where kubelet finds it (`image.pullPolicy: Never`).

- `base`: the local base image (mmdebstrap, imported into buildah);
- `golang`: the local Go image of the hook stage (mmdebstrap and the host's GOROOT);
- `constraints`: constraints.txt from the running environment;
- `local`: `build_image()`, `LocalImage`, the cache of archives;
- `run`: using the image (unpack, `sandbox_command`, `import_image`);
- `sandbox`: the program `sandbox_command` runs, a file run as a script;
- `tools`: the build's error, running buildah and other host tools, the cache and lock.
"""

from tools.image.local import LocalImage, build_image
from tools.image.run import image_env, import_image, sandbox_command, unpack
from tools.image.steps import ImageBuildError

__all__ = [
    "ImageBuildError",
    "LocalImage",
    "build_image",
    "image_env",
    "import_image",
    "sandbox_command",
    "unpack",
]

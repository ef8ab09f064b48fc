"""Build the pinned upstream binaries once, from the Go module proxy, into the cache.

`python -m e2e.harness.build` builds whatever is missing or out of date into
`<cache>/e2e/<kubernetes-version>/bin/` (see `e2e.harness.paths`), and the node's images (see
`e2e.harness.node_images`), and reports progress on stderr. With a warm cache it starts no Go
process and returns in milliseconds: each installed binary has a recipe hash (versions,
go.mod, package, flags) in `bin/.stamp.json`, and only a binary whose recipe changed, or
that is missing, is rebuilt.

k8s.io/kubernetes cannot be `go install`ed: its go.mod requires the staging modules at
v0.0.0. Our own go.mod (written to `<cache>/e2e/<version>/work/kubernetes/`) requires it
at the pinned release and replaces every staging module with its published v0.Y.Z.

What is built: `e2e.harness.recipes`; building and installing it: `e2e.harness.binaries`;
the images: `e2e.harness.node_images`. This module is the command line and `ensure_all`.
"""

from __future__ import annotations

import argparse
import sys
import time

from e2e.harness import node_images, paths
from e2e.harness.binaries import HOST_TOOLS, BuildError, Writer, ensure_binaries, ensure_host_tools
from e2e.harness.recipes import BINARY_NAMES


def ensure_all(*, out: Writer | None = None) -> None:
    """Every binary, host tool and node image the harness uses, built if missing.

    Raises BuildError or node_images.ImageError naming the failed step."""
    ensure_binaries(out=out)
    ensure_host_tools(HOST_TOOLS, out=out)
    node_images.ensure_images(out=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.harness.build",
        description="Build the pinned Kubernetes, etcd, helm and node binaries (containerd, "
        "runc, CNI plugins) and the node's images into the cache; install missing host "
        "tools (gcc, iproute2, dpkg) with apt-get.",
    )
    parser.add_argument("names", nargs="*", help=f"subset of {', '.join(BINARY_NAMES)}")
    parser.add_argument("--print-dir", action="store_true", help="print the bin directory")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        if args.names:
            ensure_binaries(args.names)
        else:
            ensure_all()
    except (BuildError, node_images.ImageError) as e:
        print(e, file=sys.stderr)
        return 1
    print(
        f"build: up to date in {paths.bin_dir()} ({time.monotonic() - started:.2f}s)",
        file=sys.stderr,
    )
    if args.print_dir:
        print(paths.bin_dir())
    return 0


if __name__ == "__main__":
    sys.exit(main())

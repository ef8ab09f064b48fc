"""python -m tools.image build [--dist DIR] | import --ctr PATH --address SOCKET | constraints"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import tools.image
from tools.image.constraints import FILE, write_constraints
from tools.image.local import LocalImage, build_image
from tools.image.run import import_image
from tools.image.steps import ImageBuildError, buildah


def to_dist(image: LocalImage, dist: Path) -> Path:
    """`dist/drasil-<version>.oci.tar` (a copy of the cached archive) and the local tag
    `localhost/drasil:<version>` beside the build's own."""
    dist.mkdir(parents=True, exist_ok=True)
    target = dist / f"drasil-{image.version}.oci.tar"
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.copyfile(image.archive, tmp)
    tmp.replace(target)
    buildah("buildah tag", "tag", image.name, f"{image.repository}:{image.version}")
    return target


def _build(dist: Path | None) -> int:
    started = time.monotonic()
    image = build_image()
    print(f"image    {image.name}")
    archive = image.archive
    if dist is not None:
        archive = to_dist(image, dist)
        print(f"tagged   {image.repository}:{image.version}")
    print(f"archive  {archive} ({archive.stat().st_size / 1e6:.0f} MB)")
    for key, value in sorted(image.annotations.items()):
        print(f"{key.removeprefix('org.opencontainers.image.'):8} {value}")
    print(f"took     {time.monotonic() - started:.1f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.image", description=(tools.image.__doc__ or "").split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build (or find cached) and print the image")
    build.add_argument("--dist", type=Path, help="also copy the archive into DIR and tag it")
    imp = commands.add_parser("import", help="build if needed and import into containerd")
    imp.add_argument("--ctr", required=True, type=Path)
    imp.add_argument("--address", required=True)
    imp.add_argument("--namespace", default="k8s.io")
    commands.add_parser("constraints", help=f"write {FILE.name} from this environment")
    args = parser.parse_args(argv)
    try:
        if args.command == "constraints":
            write_constraints()
            print(FILE)
            return 0
        if args.command == "build":
            return _build(args.dist)
        image = build_image()
        import_image(image, ctr=args.ctr, address=args.address, namespace=args.namespace)
        print(image.name)
    except ImageBuildError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""python -m e2e.image build | import --ctr PATH --address SOCKET [--namespace NS]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import e2e.image
from e2e.image.local import build_image
from e2e.image.run import import_image
from e2e.image.tools import ImageBuildError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.image", description=(e2e.image.__doc__ or "").split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="build (or find cached) and print archive and name")
    imp = commands.add_parser("import", help="build if needed and import into containerd")
    imp.add_argument("--ctr", required=True, type=Path)
    imp.add_argument("--address", required=True)
    imp.add_argument("--namespace", default="k8s.io")
    args = parser.parse_args(argv)
    try:
        image = build_image()
        if args.command == "import":
            import_image(image, ctr=args.ctr, address=args.address, namespace=args.namespace)
    except ImageBuildError as e:
        print(e, file=sys.stderr)
        return 1
    print(image.archive)
    print(image.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())

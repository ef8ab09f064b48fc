"""python -m tools.cluster up | down | status | env [--run-dir DIR]"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from e2e.harness.binaries import BuildError
from e2e.harness.cluster import rundir
from e2e.harness.cluster.control_plane import Cluster
from e2e.harness.cluster.node import DEFAULT_PROFILE, NodeError, describe
from e2e.harness.cluster.rundir import ClusterError


def _pick(run_dir: Path | None) -> Cluster:
    """The run of --run-dir, else the newest of this checkout (never another's)."""
    return Cluster(rundir.pick(run_dir))


def _fresh(run_dir: Path | None) -> Path | None:
    """`up --run-dir DIR`: DIR, made if missing, and empty (None: a new run dir under
    the cache)."""
    if run_dir is None:
        return None
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if any(run_dir.iterdir()):
        raise ClusterError(f"{run_dir} is not empty; `up --run-dir` needs a new directory")
    return run_dir


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--fake-nodes: {text!r} is not a number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"--fake-nodes: {value} is negative")
    return value


def _run_dir_arg(args: argparse.Namespace) -> str:
    return f" --run-dir {shlex.quote(str(args.run_dir))}" if args.run_dir else ""


def _up(args: argparse.Namespace) -> int:
    if args.device_plugin and not args.with_node:
        raise ClusterError("--device-plugin needs --with-node (it runs beside that kubelet)")
    cluster = Cluster(_fresh(args.run_dir), out=sys.stderr)
    print(f"cluster: run dir {cluster.run_dir}", file=sys.stderr)
    seconds = cluster.up(
        with_node=args.with_node,
        node_profile=args.profile,
        fake_nodes=args.fake_nodes,
        fleet_profile=args.profile,
    )
    if args.device_plugin and cluster.node is not None:
        try:
            cluster.node.start_device_plugin()
        except (NodeError, RuntimeError, TimeoutError) as e:
            cluster.down()
            raise ClusterError(f"device plugin: {e}") from e
    print(
        f"cluster: up in {seconds:.1f}s; API server {cluster.server}\n"
        f"cluster: logs in {cluster.logs_dir}\n"
        f"cluster: export $(.venv/bin/python -m tools.cluster env{_run_dir_arg(args)})   "
        f"# then kubectl, or pytest e2e against it",
        file=sys.stderr,
    )
    if cluster.node is not None:
        print(f"cluster: {describe(cluster.node)}", file=sys.stderr)
    if args.fake_nodes:
        print(
            f"cluster: {args.fake_nodes} KWOK nodes ({args.profile} each), fleet publisher "
            f"at {cluster.fleet.publisher_url() if cluster.fleet else '?'}; audit log "
            f"{cluster.audit_log}",
            file=sys.stderr,
        )
    print(f"KUBECONFIG={shlex.quote(str(cluster.kubeconfig))}")
    return 0


def _down(args: argparse.Namespace) -> int:
    cluster = _pick(args.run_dir)
    cluster.down()
    print(f"cluster: stopped {cluster.run_dir}", file=sys.stderr)
    return 0


def _status(args: argparse.Namespace) -> int:
    status = _pick(args.run_dir).status()
    print(status.format())
    return 0 if status.running else 1


def _env(args: argparse.Namespace) -> int:
    kubeconfig = shlex.quote(str(_pick(args.run_dir).kubeconfig))
    print(f"KUBECONFIG={kubeconfig}")
    # The tests only ever use a cluster named by this variable, never KUBECONFIG.
    print(f"DRASIL_E2E_KUBECONFIG={kubeconfig}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.cluster",
        description="A local Kubernetes control plane with DRA (etcd, kube-apiserver, "
        "kube-controller-manager, kube-scheduler) on 127.0.0.1, and optionally a real "
        "node (containerd, kubelet, the drasil kubelet plugin).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a new cluster in a new run directory")
    up.add_argument(
        "--with-node",
        action="store_true",
        help="also a real node: containerd, kubelet and the drasil kubelet plugin",
    )
    up.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"simulated GPUs of the node's plugin, and of each fake node (default "
        f"{DEFAULT_PROFILE})",
    )
    up.add_argument(
        "--fake-nodes",
        type=_count,
        default=0,
        metavar="N",
        help="also N KWOK nodes whose pools (--profile each) one fleet publisher publishes "
        "with drasil's slice code (docs/scale.md)",
    )
    up.add_argument(
        "--device-plugin",
        action="store_true",
        help="with --with-node: also run the plugin in device-plugin mode, so the node "
        "advertises drasil.dev/gpu in its capacity (docs/device-plugin.md)",
    )
    up.add_argument(
        "--run-dir",
        type=Path,
        help="a new or empty directory to run in (default: a new one under the cache); "
        "down, status and env then find it only with --run-dir",
    )
    up.set_defaults(func=_up)
    for name, func, text in (
        ("down", _down, "stop everything a run started"),
        ("status", _status, "show what runs and whether it is healthy (exit 1 if not)"),
        ("env", _env, "print KUBECONFIG=... for `export $(python -m tools.cluster env)`"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument(
            "--run-dir",
            type=Path,
            help="the run to act on (default: the most recent one started from this checkout)",
        )
        p.set_defaults(func=func)
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
    except (ClusterError, BuildError) as e:
        print(f"cluster: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("cluster: interrupted", file=sys.stderr)
        return 130
    return result


if __name__ == "__main__":
    sys.exit(main())

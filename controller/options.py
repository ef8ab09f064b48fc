"""Flags of ``drasil-controller``; a flag wins over its environment variable."""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from drasil.driver.endpoints import parse_addr
from drasil.driver.logs import LOG_FORMATS, LogFormat

DEFAULT_DRIVER = "gpu.drasil.dev"
FIELD_MANAGER = "drasil-controller"


class OptionsError(ValueError):
    """A flag or environment variable with a value the controller cannot run with."""


@dataclass(frozen=True)
class LeaderElection:
    """The Lease that picks the one replica that acts (client-go's defaults)."""

    enabled: bool
    name: str
    namespace: str
    identity: str
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0


@dataclass(frozen=True)
class ControllerOptions:
    driver_name: str
    kubeconfig: str | None
    explain_after: float
    metrics_addr: str
    health_addr: str
    log_format: LogFormat
    verbosity: int
    leader: LeaderElection
    resync_period: float = 300.0
    stall_after: float = 60.0


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="drasil-controller",
        exit_on_error=False,
        description="drasil's cluster daemon: publishes DevicePools as ResourceSlices, checks "
        "the opaque configs of claims, explains claims that stay pending.",
    )
    p.add_argument("--driver-name", default=env.get("DRIVER_NAME", DEFAULT_DRIVER))
    p.add_argument("--kubeconfig", default=env.get("KUBECONFIG"), help="in-cluster if absent")
    p.add_argument(
        "--explain-after",
        type=float,
        default=env.get("EXPLAIN_AFTER", "10"),
        help="seconds a claim may wait for allocation before it is explained, once "
        "kube-scheduler has tried its Pod (default 10; a Pod only queued: --stall-after)",
    )
    p.add_argument(
        "--stall-after",
        type=float,
        default=env.get("STALL_AFTER", "60"),
        help="seconds a pending claim may look satisfiable before a SchedulerNotRetried "
        "Event says its wait is not capacity; also when a claim whose Pods are only queued "
        "is first explained (default 60)",
    )
    p.add_argument("--metrics-addr", default=env.get("METRICS_ADDR", ":9402"))
    p.add_argument("--health-addr", default=env.get("HEALTH_ADDR", ":9403"))
    p.add_argument("--log-format", choices=LOG_FORMATS, default=env.get("LOG_FORMAT", "text"))
    p.add_argument("-v", "--v", dest="verbosity", type=int, default=env.get("V", "0"))
    p.add_argument(
        "--resync-period",
        type=float,
        default=env.get("RESYNC_PERIOD", "300"),
        help="seconds between re-publishing every DevicePool (repairs edited slices)",
    )
    _leader_flags(p, env)
    return p


def _leader_flags(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    p.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=env.get("LEADER_ELECT", "true").lower() not in ("false", "0", "no"),
        help="run only while holding the Lease, so replicas never act twice (default on)",
    )
    p.add_argument("--leader-elect-lease-name", default="drasil-controller")
    p.add_argument(
        "--leader-elect-namespace",
        default=env.get("POD_NAMESPACE", "kube-system"),
        help="namespace of the Lease (env POD_NAMESPACE, else kube-system)",
    )
    p.add_argument("--leader-elect-identity", default=env.get("POD_NAME") or _default_identity())
    p.add_argument("--leader-elect-lease-duration", type=float, default=15.0)
    p.add_argument("--leader-elect-renew-deadline", type=float, default=10.0)
    p.add_argument("--leader-elect-retry-period", type=float, default=2.0)


def _default_identity() -> str:
    # Unique per process, readable in `kubectl get lease`: host, then a random suffix.
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise OptionsError(message)


def _check_leader(ns: argparse.Namespace) -> None:
    duration, deadline, retry = (
        ns.leader_elect_lease_duration,
        ns.leader_elect_renew_deadline,
        ns.leader_elect_retry_period,
    )
    _check(retry > 0, "--leader-elect-retry-period must be positive")
    # As client-go: a leader must give up before anyone may take over.
    _check(
        duration > deadline > retry,
        f"--leader-elect-lease-duration ({duration:g}) > --leader-elect-renew-deadline "
        f"({deadline:g}) > --leader-elect-retry-period ({retry:g}) must hold",
    )


def parse_options(argv: Sequence[str], env: Mapping[str, str] | None = None) -> ControllerOptions:
    """Parse flags, falling back to the environment, and check what argparse cannot."""
    env = os.environ if env is None else env
    try:
        ns = _parser(env).parse_args(list(argv))
    except (argparse.ArgumentError, ValueError) as err:  # also bad numbers in env defaults
        raise OptionsError(str(err)) from None
    _check(ns.explain_after > 0, f"--explain-after: {ns.explain_after:g} is not positive")
    _check(ns.stall_after > 0, f"--stall-after: {ns.stall_after:g} is not positive")
    _check(ns.resync_period > 0, f"--resync-period: {ns.resync_period:g} is not positive")
    _check(ns.log_format in LOG_FORMATS, f"--log-format: {ns.log_format!r} is not json or text")
    for flag, value in (("--metrics-addr", ns.metrics_addr), ("--health-addr", ns.health_addr)):
        try:
            parse_addr(value)
        except ValueError as err:
            raise OptionsError(f"{flag}: {err}") from None
    _check_leader(ns)
    return ControllerOptions(
        driver_name=ns.driver_name,
        kubeconfig=ns.kubeconfig,
        explain_after=ns.explain_after,
        metrics_addr=ns.metrics_addr,
        health_addr=ns.health_addr,
        log_format=ns.log_format,
        verbosity=int(ns.verbosity),
        resync_period=ns.resync_period,
        stall_after=ns.stall_after,
        leader=LeaderElection(
            enabled=ns.leader_elect,
            name=ns.leader_elect_lease_name,
            namespace=ns.leader_elect_namespace,
            identity=ns.leader_elect_identity,
            lease_duration=ns.leader_elect_lease_duration,
            renew_deadline=ns.leader_elect_renew_deadline,
            retry_period=ns.leader_elect_retry_period,
        ),
    )

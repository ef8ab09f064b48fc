"""Flags of ``drasil-controller``; a flag wins over its environment variable."""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from drasil.driver import flags
from drasil.driver.flags import option, section
from drasil.driver.logs import LOG_FORMATS, LogFormat

DEFAULT_DRIVER = "gpu.drasil.dev"
FIELD_MANAGER = "drasil-controller"


class OptionsError(ValueError):
    """A flag or environment variable with a value the controller cannot run with."""


def _positive(flag: str) -> Callable[[float], float]:
    def check(value: float) -> float:
        _check(value > 0, f"{flag}: {value:g} is not positive")
        return value

    return check


def _not_no(text: str) -> bool:
    return text.lower() not in ("false", "0", "no")


def _identity(value: str | None) -> str:
    return value or _default_identity()


@dataclass(frozen=True)
class LeaderElection:
    """The Lease that picks the one replica that acts (client-go's defaults)."""

    enabled: bool = option(
        "--leader-elect",
        env="LEADER_ELECT",
        default="true",
        truth=_not_no,
        help="run only while holding the Lease, so replicas never act twice (default on)",
    )
    name: str = option("--leader-elect-lease-name", default="drasil-controller")
    namespace: str = option(
        "--leader-elect-namespace",
        env="POD_NAMESPACE",
        default="kube-system",
        help="namespace of the Lease (env POD_NAMESPACE, else kube-system)",
    )
    identity: str = option("--leader-elect-identity", env="POD_NAME", convert=_identity)
    lease_duration: float = option("--leader-elect-lease-duration", default="15.0", kind=float)
    renew_deadline: float = option("--leader-elect-renew-deadline", default="10.0", kind=float)
    retry_period: float = option("--leader-elect-retry-period", default="2.0", kind=float)


@dataclass(frozen=True)
class ControllerOptions:
    """The controller's settings, each declared once with its flag and environment
    variable (``drasil.driver.flags``), in the order ``--help`` lists them."""

    driver_name: str = option("--driver-name", env="DRIVER_NAME", default=DEFAULT_DRIVER)
    kubeconfig: str | None = option("--kubeconfig", env="KUBECONFIG", help="in-cluster if absent")
    explain_after: float = option(
        "--explain-after",
        env="EXPLAIN_AFTER",
        default="10",
        kind=float,
        convert=_positive("--explain-after"),
        help="seconds a claim may wait for allocation before it is explained, once "
        "kube-scheduler has tried its Pod (default 10; a Pod only queued: --stall-after)",
    )
    stall_after: float = option(
        "--stall-after",
        env="STALL_AFTER",
        default="60",
        kind=float,
        convert=_positive("--stall-after"),
        help="seconds a pending claim may look satisfiable before a SchedulerNotRetried "
        "Event says its wait is not capacity; also when a claim whose Pods are only queued "
        "is first explained (default 60)",
    )
    metrics_addr: str = option(
        "--metrics-addr",
        env="METRICS_ADDR",
        default=":9402",
        convert=flags.address("--metrics-addr"),
    )
    health_addr: str = option(
        "--health-addr",
        env="HEALTH_ADDR",
        default=":9403",
        convert=flags.address("--health-addr"),
    )
    log_format: LogFormat = option(
        "--log-format", env="LOG_FORMAT", default="text", choices=LOG_FORMATS
    )
    verbosity: int = option("--v", short="-v", dest="verbosity", env="V", default="0", kind=int)
    resync_period: float = option(
        "--resync-period",
        env="RESYNC_PERIOD",
        default="300",
        kind=float,
        convert=_positive("--resync-period"),
        help="seconds between re-publishing every DevicePool (repairs edited slices)",
    )
    leader: LeaderElection = section(LeaderElection)


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    return flags.parser(
        ControllerOptions,
        env,
        error=OptionsError,
        prog="drasil-controller",
        exit_on_error=False,
        description="drasil's cluster daemon: publishes DevicePools as ResourceSlices, checks "
        "the opaque configs of claims, explains claims that stay pending.",
    )


def _default_identity() -> str:
    # Unique per process, readable in `kubectl get lease`: host, then a random suffix.
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise OptionsError(message)


def _check_leader(leader: LeaderElection) -> None:
    duration, deadline, retry = leader.lease_duration, leader.renew_deadline, leader.retry_period
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
    opts = flags.settings(ControllerOptions, ns, env, error=OptionsError)
    _check_leader(opts.leader)
    return opts

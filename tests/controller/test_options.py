"""Flags and environment of drasil-controller."""

from __future__ import annotations

import pytest

from drasil.controller.options import OptionsError, parse_options


def test_defaults() -> None:
    opts = parse_options([], env={})

    assert opts.driver_name == "gpu.drasil.dev"
    assert opts.kubeconfig is None
    assert opts.explain_after == 10
    assert (opts.metrics_addr, opts.health_addr) == (":9402", ":9403")
    assert (opts.log_format, opts.verbosity) == ("text", 0)
    assert opts.leader.enabled
    assert (opts.leader.name, opts.leader.namespace) == ("drasil-controller", "kube-system")
    assert (opts.leader.lease_duration, opts.leader.renew_deadline, opts.leader.retry_period) == (
        15,
        10,
        2,
    )
    assert opts.leader.identity


def test_flags_win_over_the_environment() -> None:
    env = {"DRIVER_NAME": "env.example.com", "POD_NAMESPACE": "drasil", "POD_NAME": "ctl-0"}

    from_env = parse_options([], env=env)
    assert (from_env.driver_name, from_env.leader.namespace, from_env.leader.identity) == (
        "env.example.com",
        "drasil",
        "ctl-0",
    )
    flags = parse_options(
        [
            "--driver-name=flag.example.com",
            "--kubeconfig=/k",
            "--explain-after=2.5",
            "--no-leader-elect",
            "--log-format=json",
            "-v",
            "4",
        ],
        env=env,
    )
    assert (flags.driver_name, flags.kubeconfig, flags.explain_after) == (
        "flag.example.com",
        "/k",
        2.5,
    )
    assert not flags.leader.enabled
    assert (flags.log_format, flags.verbosity) == ("json", 4)


def test_leader_elect_from_the_environment() -> None:
    assert not parse_options([], env={"LEADER_ELECT": "false"}).leader.enabled


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--explain-after=0"], {}, "--explain-after: 0 is not positive"),
        (["--metrics-addr=nope"], {}, "--metrics-addr: address 'nope'"),
        ([], {"LOG_FORMAT": "xml"}, "--log-format"),
        ([], {"EXPLAIN_AFTER": "soon"}, "soon"),
        (["--leader-elect-renew-deadline=20"], {}, "must hold"),
    ],
)
def test_bad_values(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(OptionsError, match=message):
        parse_options(argv, env=env)

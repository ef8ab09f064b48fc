"""Options declared once (``drasil.driver.flags``): one declaration gives the flag, its
environment variable, its default, its checks and the field's value."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from drasil.driver.flags import FlagError, flags_of, option, parser, section, settings


@dataclass(frozen=True)
class Inner:
    on: bool = option("--on", env="ON", default="", truth=lambda t: t == "yes")


@dataclass(frozen=True)
class Settings:
    mode: str = option("--mode", env="MODE", default="a", choices=("a", "b"), help="a or b")
    root: Path = option("--root", env="ROOT", default="/r", absolute=True, convert=Path)
    count: int = option("--count", env="COUNT", default="1", kind=int)
    hidden: str = option(None, env="HIDDEN", default="h")
    inner: Inner = section(Inner)


def parse(argv: list[str], env: dict[str, str]) -> Settings:
    return settings(Settings, parser(Settings, env).parse_args(argv), env)


def test_a_flag_wins_over_its_variable_which_wins_over_the_default() -> None:
    assert parse([], {}) == Settings(
        mode="a", root=Path("/r"), count=1, hidden="h", inner=Inner(False)
    )
    env = {"MODE": "b", "ROOT": "/x", "COUNT": "3", "HIDDEN": "e", "ON": "yes"}
    assert parse([], env) == Settings(
        mode="b", root=Path("/x"), count=3, hidden="e", inner=Inner(True)
    )
    got = parse(["--mode=a", "--count=5", "--no-on"], env)
    assert (got.mode, got.count, got.inner.on) == ("a", 5, False)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MODE": "c"}, r"--mode: unsupported value 'c'; allowed values are \('a', 'b'\)"),
        ({"ROOT": "rel"}, "--root: 'rel' is not an absolute path"),
        ({"COUNT": "many"}, "env COUNT: 'many' is not an integer"),
    ],
)
def test_what_argparse_does_not_check_of_the_environment_is_checked(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(FlagError, match=message):
        parse([], env)


def test_every_flag_is_listed_once_in_declaration_order() -> None:
    assert [f.flag for f in flags_of(Settings)] == ["--mode", "--root", "--count", None, "--on"]

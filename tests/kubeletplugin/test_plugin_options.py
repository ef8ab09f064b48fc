"""Flags of drasil-kubelet-plugin: flag beats env, required values, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from drasil.kubeletplugin.options import OptionsError, parse_options


def test_defaults() -> None:
    opts = parse_options([], {"NODE_NAME": "n1"})
    assert opts.node_name == "n1"
    assert opts.driver_name == "gpu.drasil.dev"
    assert opts.backend == "nvml"
    assert opts.mode == "dra"
    assert opts.registrar_dir == Path("/var/lib/kubelet/plugins_registry")
    assert opts.plugins_dir == Path("/var/lib/kubelet/plugins")
    assert opts.cdi_root == Path("/var/run/cdi")
    assert opts.state_dir == Path("/var/lib/kubelet/plugins/gpu.drasil.dev")
    assert (opts.metrics_addr, opts.health_addr) == (":9400", ":9401")
    assert opts.pod_uid is None
    assert opts.verbosity == 0


def test_env_is_used_without_flags() -> None:
    env = {
        "NODE_NAME": "env-node",
        "DRIVER_NAME": "gpu.example.com",
        "BACKEND": "simulated",
        "SIMULATED_PROFILE": "l4:2",
        "POD_UID": "pod-1",
        "LOG_FORMAT": "json",
        "V": "4",
        "MODE": "device-plugin",
    }
    opts = parse_options(["--plugins-dir", "/p"], env)
    assert opts.node_name == "env-node"
    assert opts.driver_name == "gpu.example.com"
    assert opts.backend == "simulated"
    assert opts.simulated_profile == "l4:2"
    assert opts.pod_uid == "pod-1"
    assert opts.log_format == "json"
    assert opts.verbosity == 4
    assert opts.mode == "device-plugin"
    assert opts.state_dir == Path("/p/gpu.example.com")


def test_flag_beats_env() -> None:
    env = {"NODE_NAME": "env-node", "DRIVER_NAME": "env.example.com", "BACKEND": "nvml", "V": "1"}
    opts = parse_options(
        [
            "--node-name",
            "flag-node",
            "--driver-name",
            "flag.example.com",
            "--backend",
            "simulated",
            "-v",
            "3",
        ],
        env,
    )
    assert (opts.node_name, opts.driver_name, opts.backend, opts.verbosity) == (
        "flag-node",
        "flag.example.com",
        "simulated",
        3,
    )


def test_a_flag_beats_a_bad_env_value() -> None:
    opts = parse_options(["--backend", "simulated"], {"NODE_NAME": "n", "BACKEND": "cuda"})
    assert opts.backend == "simulated"


@pytest.mark.parametrize("env", [{}, {"NODE_NAME": ""}])
def test_node_name_is_required(env: dict[str, str]) -> None:
    with pytest.raises(OptionsError, match=r"--node-name \(or env NODE_NAME\) is required"):
        parse_options([], env)


@pytest.mark.parametrize(
    ("variable", "value", "flag", "allowed"),
    [
        ("BACKEND", "cuda", "--backend", "('nvml', 'simulated')"),
        ("MODE", "classic", "--mode", "('dra', 'device-plugin')"),
        ("LOG_FORMAT", "xml", "--log-format", "'json'"),
    ],
)
def test_bad_env_choice_names_the_allowed_values(
    variable: str, value: str, flag: str, allowed: str
) -> None:
    with pytest.raises(OptionsError) as err:
        parse_options([], {"NODE_NAME": "n", variable: value})
    message = str(err.value)
    assert message.startswith(f"{flag}: unsupported value {value!r}; allowed values are ")
    assert allowed in message


def test_bad_flag_choice_is_an_argparse_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_options(["--backend", "cuda"], {"NODE_NAME": "n"})
    assert exit_info.value.code == 2
    assert "invalid choice: 'cuda'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--metrics-addr", "--health-addr"])
@pytest.mark.parametrize("addr", ["nonsense", ":70000"])
def test_bad_http_address_is_an_options_error(flag: str, addr: str) -> None:
    with pytest.raises(OptionsError, match=flag):
        parse_options([flag, addr], {"NODE_NAME": "n"})


def test_bad_verbosity_env_is_an_options_error() -> None:
    with pytest.raises(OptionsError, match="V"):
        parse_options([], {"NODE_NAME": "n", "V": "debug"})


def test_per_pod_socket_names_carry_a_uid_prefix_that_fits_long_driver_names() -> None:
    from drasil.kubeletplugin.dra.plugin import socket_names
    from drasil.kubeletplugin.sockets import MAX_PATH

    uid = "3f2a9c1b-7d4e-4f6a-9b1c-2d3e4f5a6b7c"
    driver = f"gpu.{'a' * 32}.com"  # 40 characters
    opts = parse_options(["--driver-name", driver], {"NODE_NAME": "n", "POD_UID": uid})
    dra, registration = socket_names(opts)
    assert dra == "dra-3f2a9c1b-7d4e.sock"
    assert registration == f"{driver}-3f2a9c1b-7d4e-reg.sock"
    # Under kubelet's default directories both paths fit a unix socket.
    assert len(f"/var/lib/kubelet/plugins_registry/{registration}") <= MAX_PATH
    assert len(f"/var/lib/kubelet/plugins/{driver}/{dra}") <= MAX_PATH
    assert socket_names(parse_options([], {"NODE_NAME": "n"})) == (
        "dra.sock",
        "gpu.drasil.dev-reg.sock",
    )


def test_help_shows_no_docstring_markup(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_options(["--help"], {})
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: drasil-kubelet-plugin")
    assert "--time-slicing-replicas" in text
    assert "``" not in text


def test_docstring_markup_is_stripped_from_help_texts(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from drasil.kubeletplugin import options

    assert options.plain("``--mode device-plugin``: see ``MODE``") == (
        "--mode device-plugin: see MODE"
    )
    parser = argparse.ArgumentParser(
        prog="p", description="Runs ``x``.", formatter_class=options._PlainHelpFormatter
    )
    parser.add_argument("--flag", help="the ``--flag`` (default ``%(default)s``)", default="d")
    parser.print_help()
    text = capsys.readouterr().out
    assert "Runs x." in text
    assert "the --flag (default d)" in text


def test_vendors_default_to_nvidia_and_take_a_list_or_auto() -> None:
    assert parse_options([], {"NODE_NAME": "n"}).vendors == ("nvidia",)
    both = parse_options(["--vendors", "amd, nvidia"], {"NODE_NAME": "n"})
    assert both.vendors == ("amd", "nvidia")
    assert parse_options([], {"NODE_NAME": "n", "VENDORS": "auto"}).vendors == ("auto",)
    assert parse_options([], {"NODE_NAME": "n"}).amd_sysfs_root == Path("/sys")


@pytest.mark.parametrize("value", ["intel", "auto,amd", "", "nvidia,,cuda"])
def test_bad_vendors_name_the_allowed_values(value: str) -> None:
    with pytest.raises(OptionsError, match=r"--vendors: .*nvidia, amd, nor auto alone"):
        parse_options(["--vendors", value], {"NODE_NAME": "n"})


def test_boot_id_file_defaults_to_the_kernels_and_must_be_absolute() -> None:
    assert parse_options([], {"NODE_NAME": "n"}).boot_id_file == Path(
        "/proc/sys/kernel/random/boot_id"
    )
    opts = parse_options([], {"NODE_NAME": "n", "BOOT_ID_FILE": "/run/rig/boot_id"})
    assert opts.boot_id_file == Path("/run/rig/boot_id")
    with pytest.raises(OptionsError, match="--boot-id-file: 'boot_id' is not an absolute path"):
        parse_options(["--boot-id-file", "boot_id"], {"NODE_NAME": "n"})

"""The `servefleet` command as a user meets it: --version, help that shows defaults, one set
of --log-level choices, and expected failures as one line with a non-zero exit."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from servefleet.cli.logs import LOG_LEVELS
from servefleet.cli.main import SUBCOMMANDS, main, package_version, subcommand_parser

LONG_RUNNING = ["engine", "gateway", "autoscaler", "operator", "up"]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"servefleet {package_version()}"
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", package_version())


def _options(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    """(parser prog, action) for every option of the parser and its sub-parsers."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found += _options(child)
        elif action.option_strings and not isinstance(
            action, argparse._HelpAction | argparse._VersionAction
        ):
            found.append((parser.prog, action))
    return found


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_option_help_shows_its_default(name: str) -> None:
    parser, _ = subcommand_parser(name)
    options = _options(parser)
    assert options
    for prog, action in options:
        text = parser._get_formatter()._expand_help(action)  # what --help prints for it
        assert "default" in text.lower(), f"{prog} {action.option_strings[0]}: {text!r}"


@pytest.mark.parametrize("name", LONG_RUNNING)
def test_log_level_and_format_are_the_same_fixed_choices_everywhere(name: str) -> None:
    parser, _ = subcommand_parser(name)
    by_flag = {a.option_strings[0]: a for _, a in _options(parser)}
    assert tuple(by_flag["--log-level"].choices or ()) == LOG_LEVELS
    assert tuple(by_flag["--log-format"].choices or ()) == ("text", "json")
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["x", "--log-level", "verbose"])
    assert exit_info.value.code == 2
    # Upper case, as charts and old command lines spell it, still parses.
    required = ["--model", "m"] if name == "engine" else ["--config", "c"]
    argv = {"engine": required, "gateway": required, "up": ["f.yaml"]}.get(name, [])
    assert parser.parse_args([*argv, "--log-level", "WARNING"]).log_level == "warning"


def test_bad_flags_are_usage_and_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["engine", "--model", "m", "--bogus"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: unrecognized arguments: --bogus" in err and "Traceback" not in err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["operator", "--health-port", "0"],
        ["autoscaler", "--metrics-port", "0"],
        ["gateway", "--config", "{config}", "--kube-routes"],
    ],
    ids=["operator", "autoscaler", "gateway"],
)
def test_missing_kubeconfig_is_one_line(
    argv: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("deployments: []\n")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("SERVEFLEET_INTERNAL_API_KEY", "internal-key")  # asked for before
    route_key = tmp_path / "route-signing-key"  # so is the operator's route signing key
    route_key.write_text("a-route-signing-key-of-enough-bytes")
    monkeypatch.setenv("SERVEFLEET_ROUTE_SIGNING_KEY_FILE", str(route_key))
    argv = [a.replace("{config}", str(config)) for a in argv]
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "kubeconfig" in line.lower() or "no-such-kubeconfig" in line


def test_up_with_a_missing_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["up", str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml" in _one_error_line(capsys.readouterr().err)


def test_gateway_on_a_busy_port_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    config = tmp_path / "gateway.yaml"
    config.write_text("deployments: []\ninternal_port: null\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["gateway", "--config", str(config), "--port", str(port)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"port {port} on " in line and "--port N" in line

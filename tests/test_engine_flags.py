"""Each engine knob is defined once (`servefleet.api.engine_flags`): the CLI's parser, the
engine's config, the engine's own registries and the README's table are read from it."""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, get_args

import pytest

from servefleet.api.engine_flags import ENGINE_FLAGS, EngineFlag, markdown_table
from servefleet.cli import engine_cmd
from servefleet.engine.config import EngineConfig
from servefleet.engine.kernels import KERNEL_NAMES, MATMUL_NAMES
from servefleet.engine.structured.tool_parsers import TOOL_CALL_PARSERS

README = Path(__file__).resolve().parents[1] / "engine" / "README.md"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    engine_cmd.add_arguments(parser)
    return parser


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def test_the_parser_is_built_from_the_table() -> None:
    actions = _actions(_parser())
    assert set(actions) == {knob.name for knob in ENGINE_FLAGS} | {"log_level", "log_format"}
    for knob in ENGINE_FLAGS:
        action = actions[knob.name]
        assert action.option_strings == [knob.flag], knob.name
        assert action.help == knob.help and action.required == knob.required, knob.name
        if not knob.required:
            assert action.default == knob.default, knob.name
        if knob.kind is bool:  # a switch: given, it turns the default-on feature off
            assert action.nargs == 0 and action.const is (not knob.default), knob.name
        else:
            assert action.type is knob.kind, knob.name
            assert tuple(action.choices or ()) == knob.choices, knob.name


def _allowed(annotation: Any) -> tuple[Any, tuple[str, ...]]:
    """(scalar type, Literal values) of a field's annotation, `| None` dropped."""
    if typing.get_origin(annotation) in (types.UnionType, typing.Union):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        annotation = rest[0] if len(rest) == 1 else annotation
    if typing.get_origin(annotation) is typing.Literal:
        return str, get_args(annotation)
    return annotation, ()


def test_the_config_has_one_field_per_knob_with_its_default_type_and_values() -> None:
    fields = EngineConfig.model_fields
    assert set(fields) == {knob.name for knob in ENGINE_FLAGS}
    for knob in ENGINE_FLAGS:
        field = fields[knob.name]
        assert field.is_required() == knob.required, knob.name
        if not knob.required:
            assert field.default == knob.default, knob.name
        assert field.description == knob.help, knob.name
        scalar, values = _allowed(field.annotation)
        assert values == knob.choices, knob.name
        if knob.name != "speculative_config":  # JSON on the command line, an object here
            assert scalar is knob.kind, knob.name


def test_the_config_applies_the_tables_bounds() -> None:
    bounded = [k for k in ENGINE_FLAGS if k.minimum is not None or k.above is not None]
    assert bounded
    for knob in bounded:
        low = knob.minimum if knob.minimum is not None else knob.above
        assert low is not None
        too_low = knob.kind(low - 1) if knob.minimum is not None else knob.kind(low)
        settings = {"model": "m", knob.name: too_low}
        with pytest.raises(ValueError, match=knob.name):
            EngineConfig.model_validate(settings)
        EngineConfig.model_validate({"model": "m", knob.name: knob.kind(low + 1)})


def test_a_bad_value_is_one_line_naming_the_flag() -> None:
    from pydantic import ValidationError

    args = _parser().parse_args(["--model", "m", "--block-size", "0", "--no-prefix-caching"])
    with pytest.raises(ValidationError) as caught:
        EngineConfig(**engine_cmd.engine_settings(args))
    assert engine_cmd._settings_error(caught.value).startswith("--block-size: ")
    assert engine_cmd.engine_settings(args)["enable_prefix_caching"] is False


def test_the_engines_own_registries_match_the_table() -> None:
    choices = {knob.name: knob.choices for knob in ENGINE_FLAGS}
    assert choices["decode_kernel"] == ("auto", *KERNEL_NAMES)
    assert choices["matmul"] == ("auto", *MATMUL_NAMES)
    assert choices["tool_call_parser"] == TOOL_CALL_PARSERS


def test_the_readme_table_is_the_tables() -> None:
    text = README.read_text()
    start, end = "<!-- engine-flags:start -->\n", "\n<!-- engine-flags:end -->"
    documented = text[text.index(start) + len(start) : text.index(end)]
    assert documented == markdown_table(), (
        "engine/README.md's flag table is stale: "
        "uv run python -m servefleet.api.engine_flags prints the current one"
    )


def test_every_knob_has_a_distinct_flag_and_help() -> None:
    flags = [knob.flag for knob in ENGINE_FLAGS]
    assert len(set(flags)) == len(flags)
    assert all(isinstance(knob, EngineFlag) and knob.help for knob in ENGINE_FLAGS)
    switches = [knob for knob in ENGINE_FLAGS if knob.kind is bool]
    # on by default: a --no-... switch turns it off; off by default: its own flag turns it on
    assert all(
        (knob.default is True and knob.switch and knob.switch.startswith("--no-"))
        or (knob.default is False and knob.switch is None)
        for knob in switches
    )


HELP_IMPORTS = """
import sys
from servefleet.cli.main import main
try:
    main(["engine", "--help"])
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("torch", "pydantic", "servefleet.engine") if m in sys.modules)
print("imported:", ",".join(heavy) or "-", file=sys.stderr)
sys.exit(code)
"""


def test_help_lists_every_flag_without_importing_torch_or_pydantic() -> None:
    done = subprocess.run(
        [sys.executable, "-c", HELP_IMPORTS], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "imported: -"
    for knob in ENGINE_FLAGS:
        assert knob.flag in done.stdout

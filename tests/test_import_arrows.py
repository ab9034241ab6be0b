"""The import arrows of the design, enforced: a request's path only goes down the graph.

Every room may import `api`; `text` and `kube` are shared libraries; nothing but the `cli`
entry point imports `operator`, `local`, `cli` or `bench`; the engine imports only `api` and
`text`; the control plane never imports torch (its image has none). The same table is written
into each room's `ruff.toml` (`flake8-tidy-imports.banned-api`) so editors and `ruff check`
show a wrong arrow where it is typed; this test keeps the two in step and also catches
`importlib.import_module("servefleet....")` strings, which ruff does not see.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# room -> the other servefleet rooms it may import
ALLOWED: dict[str, set[str]] = {
    "api": set(),
    "text": {"api"},
    "kube": {"api"},
    "engine": {"api", "text"},
    "gateway": {"api", "text", "kube"},
    "autoscaler": {"api", "kube"},
    "operator": {"api", "kube"},
    "local": {"api", "text", "kube", "gateway", "autoscaler"},
    "bench": {"api", "text", "engine", "gateway", "autoscaler"},
    "cli": {"api", "text", "kube", "engine", "gateway", "autoscaler", "operator", "local", "bench"},
}
ROOMS = set(ALLOWED)
WITHOUT_TORCH = {"api", "text", "kube", "gateway", "autoscaler", "operator", "local"}
ENTRY_ONLY = {"operator", "local", "cli", "bench"}


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def _sources(room: str) -> list[Path]:
    return sorted((ROOT / room / "servefleet" / room).rglob("*.py"))


def _room_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "servefleet" and parts[1] in ROOMS:
        return parts[1]
    return None


def test_every_room_is_in_the_table() -> None:
    on_disk = {
        top.name
        for top in ROOT.iterdir()
        if (top / "servefleet" / top.name).is_dir() and any(_sources(top.name))
    }
    assert on_disk == ROOMS


def test_rooms_are_namespace_roots_not_packages() -> None:
    """`operator/` is a standard-library name: no room folder may itself be importable."""
    for room in ROOMS:
        assert not (ROOT / room / "__init__.py").exists(), f"{room}/ must not be a package"
        assert not (ROOT / room / "servefleet" / "__init__.py").exists()


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_room_imports_only_what_the_design_allows(room: str) -> None:
    wrong = []
    for path in _sources(room):
        for line, module in _imported_modules(path):
            target = _room_of(module)
            if target is not None and target != room and target not in ALLOWED[room]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
            if room in WITHOUT_TORCH and module.split(".")[0] == "torch":
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports torch")
    assert not wrong, "\n".join(wrong)


def test_only_the_cli_imports_the_entry_rooms() -> None:
    for room, allowed in ALLOWED.items():
        if room != "cli":
            assert not (allowed & ENTRY_ONLY), f"{room} may not import {allowed & ENTRY_ONLY}"


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_ruff_config_bans_the_same_arrows(room: str) -> None:
    config = tomllib.loads((ROOT / room / "ruff.toml").read_text())
    assert config["extend"] == "../pyproject.toml"
    banned = set(config["lint"]["flake8-tidy-imports"].get("banned-api", {}))
    expected = {f"servefleet.{other}" for other in ROOMS - ALLOWED[room] - {room}}
    if room in WITHOUT_TORCH:
        expected.add("torch")
    assert banned == expected


def test_ruff_reports_a_wrong_arrow(tmp_path: Path) -> None:
    """The ruff rule is live, not just written down: a gateway import in the engine fails."""
    import subprocess
    import sys

    probe = ROOT / "engine" / "servefleet" / "engine" / "_arrow_probe.py"
    probe.write_text("from servefleet.gateway import pool\n\nprint(pool)\n")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "TID251", str(probe)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
    finally:
        probe.unlink()
    assert result.returncode == 1, result.stdout + result.stderr
    assert "servefleet.gateway" in result.stdout

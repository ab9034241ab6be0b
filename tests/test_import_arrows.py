"""The import arrows of the design, enforced: a request's path only goes down the graph.

Every room may import `api`; `text` and `kube` are shared libraries; nothing but the `cli`
entry point imports `operator`, `local`, `cli` or `bench`; the engine imports only `api` and
`text`; the control plane never imports torch (its image has none). The same table is written
into each room's `ruff.toml` (`flake8-tidy-imports.banned-api`) so editors and `ruff check`
show a wrong arrow where it is typed; this test keeps the two in step and also catches
`importlib.import_module("servefleet....")` strings, which ruff does not see.

Inside a room the arrows go one way too: no module imports one that imports it back, directly
or round a longer circle, counting imports inside functions and type-only ones
(`if TYPE_CHECKING:`): a circle hidden from the interpreter is still two modules that cannot be
read, changed or tested apart. Break one by moving what both need below both, or by handing
the lower module a callback or a `Protocol` instead of the upper one.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
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


def _module_of(package_dir: Path, package: str, path: Path) -> str:
    parts = [*package.split("."), *path.relative_to(package_dir).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """Every module name an import statement may refer to (submodules and their parents)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = module.split(".")[: None if is_package else -1]
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join([*anchor, *([base] if base else [])])
        yield base
        yield from (f"{base}.{alias.name}" for alias in node.names)
    elif (
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        yield node.args[0].value


def import_graph(package_dir: Path, package: str) -> dict[str, dict[str, int]]:
    """module -> {module of the same package it imports: line}, every import counted (in
    functions, under `if TYPE_CHECKING:`). `from pkg import sub` is an arrow to `sub` alone
    when `sub` is a module, as `import pkg.sub` is: a package's `__init__` is not a module
    its submodules import by being inside it."""
    paths = {_module_of(package_dir, package, p): p for p in sorted(package_dir.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for module, path in paths.items():
        edges = graph.setdefault(module, {})
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = list(_targets(node, module, is_package))
            if isinstance(node, ast.ImportFrom):
                base, named = names[0], names[1:]
                # The submodules named, and the package only for names defined in it.
                names = [n for n in named if n in paths]
                names += [base] if len(names) < len(named) else []
            for name in (n for n in names if n in paths):
                if name != module:
                    edges.setdefault(name, getattr(node, "lineno", 0))
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph.get(module, {}):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def _describe(graph: dict[str, dict[str, int]], group: list[str]) -> str:
    arrows = [
        f"  {a} imports {b} (line {line})"
        for a in group
        for b, line in sorted(graph[a].items())
        if b in group
    ]
    return "a circle:\n" + "\n".join(arrows)


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_no_module_imports_one_that_imports_it_back(room: str) -> None:
    graph = import_graph(ROOT / room / "servefleet" / room, f"servefleet.{room}")
    found = circles(graph)
    assert not found, "\n".join(_describe(graph, group) for group in found)


def test_a_circle_through_a_type_only_import_is_found(tmp_path: Path) -> None:
    package = tmp_path / "servefleet" / "room"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from servefleet.room import a\n")
    (package / "a.py").write_text("from servefleet.room.b import B\n")
    (package / "b.py").write_text("from .sub import c\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from ..a import A\n"
    )
    (package / "d.py").write_text("def f():\n    from servefleet.room import a, e\n")
    (package / "f.py").write_text("from servefleet.room import a, VERSION\n")
    (package / "e.py").write_text("import servefleet.room.d\n")
    graph = import_graph(package, "servefleet.room")
    assert graph["servefleet.room"] == {"servefleet.room.a": 1}
    assert graph["servefleet.room.b"] == {"servefleet.room.sub.c": 1}
    assert graph["servefleet.room.f"] == {"servefleet.room.a": 1, "servefleet.room": 1}
    assert circles(graph) == [
        ["servefleet.room.a", "servefleet.room.b", "servefleet.room.sub.c"],
        ["servefleet.room.d", "servefleet.room.e"],
    ]

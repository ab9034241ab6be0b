"""Engine source trees for the ISA matrix: this checkout, and an older commit beside it.

An older commit is checked out into a temporary `git worktree` and run with this
environment's interpreter, its component folders put first on PYTHONPATH: `servefleet` is a
namespace package spread over the component folders (the editable install lists this
checkout's on a `.pth` line, after PYTHONPATH), so the older tree's `servefleet.engine`,
`servefleet.cli`... win, and a folder it lacks (e.g. `text/`, added later) comes from here.
Which files were imported is checked in a child with the same environment, not assumed.
What the older engine understands is read from its own `--help`, so only those flags go to it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from servefleet.bench.processes import servefleet_command

CURRENT = "current"
# In a copy of the tree without git history (a build machine, a container), the commit it was
# copied from, as the caller knows it; recorded instead of `git rev-parse`.
SOURCE_COMMIT_ENV = "SERVEFLEET_SOURCE_COMMIT"
ISA_ENV_NAME = "SERVEFLEET_MATMUL_ISA"
_PROBE = (
    "import json, servefleet.engine, servefleet.cli.main\n"
    "print(json.dumps({'servefleet.engine': list(servefleet.engine.__path__),"
    " 'servefleet.cli.main': servefleet.cli.main.__file__}))\n"
)
_FLAG = re.compile(r"(--[a-z0-9][a-z0-9-]*)(?: \{([^}]*)\})?")


class SourceTree(BaseModel):
    """One engine build: where it lives, which commit, what it understands."""

    model_config = ConfigDict(frozen=True)

    label: str
    commit: str
    root: str
    pythonpath: list[str]  # component folders put first (empty: this checkout as installed)
    modules: dict[str, object]  # module -> file(s) the child imported
    flags: dict[str, list[str] | None]  # `servefleet engine` flag -> its choices, if listed
    isa_env: bool  # honours SERVEFLEET_MATMUL_ISA

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {**os.environ, **(extra or {})}
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(
                [*self.pythonpath, *filter(None, [os.environ.get("PYTHONPATH")])]
            )
        return env

    def understands(self, flag: str, value: str | None = None) -> bool:
        if flag not in self.flags:
            return False
        choices = self.flags[flag]
        return value is None or choices is None or value in choices


def repo_root() -> Path:
    """The checkout this module lives in (bench/servefleet/bench/ is three folders down)."""
    here = Path(__file__).resolve().parent
    out = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], cwd=here, capture_output=True, text=True
    )
    return Path(out.stdout.strip()) if out.returncode == 0 else here.parents[2]


def describe_commit(root: Path, rev: str = "HEAD") -> str:
    """Short sha, with `+dirty` when it is this checkout and it has uncommitted changes; in a
    copy without git history, $SERVEFLEET_SOURCE_COMMIT (else "unknown")."""
    if rev == "HEAD" and not (root / ".git").exists():
        return os.environ.get(SOURCE_COMMIT_ENV) or "unknown"
    sha = _git(root, "rev-parse", "--short", rev)
    if rev == "HEAD" and _git(root, "status", "--porcelain", "--untracked-files=no"):
        return f"{sha}+dirty"
    return sha


def _git(root: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout.strip()


def component_roots(tree: Path) -> list[Path]:
    """The folders holding a `servefleet/` part of the namespace package."""
    return sorted(p for p in tree.iterdir() if (p / "servefleet").is_dir())


def parse_flags(help_text: str) -> dict[str, list[str] | None]:
    """`--flag` -> its `{a,b}` choices where the help lists them, else None."""
    flags: dict[str, list[str] | None] = {}
    for name, choices in _FLAG.findall(help_text):
        if choices:
            flags[name] = choices.split(",")
        else:
            flags.setdefault(name, None)
    return flags


def inspect_tree(label: str, commit: str, root: Path, pythonpath: list[Path]) -> SourceTree:
    """Ask a child with the tree's environment which modules it imports and what flags exist."""
    path = [str(p) for p in pythonpath]
    env = SourceTree(
        label=label,
        commit=commit,
        root=str(root),
        pythonpath=path,
        modules={},
        flags={},
        isa_env=False,
    ).env()
    probe = _run([sys.executable, "-c", _PROBE], env)
    modules = json.loads(probe.splitlines()[-1])
    if path and not all(
        str(f).startswith(str(root))
        for files in modules.values()
        for f in (files if isinstance(files, list) else [files])
    ):
        raise RuntimeError(f"{label}: the child imported modules outside {root}: {modules}")
    help_text = _run([*servefleet_command(), "engine", "--help"], env)
    engine_dir = root / "engine"
    isa_env = any(ISA_ENV_NAME in f.read_text() for f in engine_dir.rglob("*.py"))
    return SourceTree(
        label=label,
        commit=commit,
        root=str(root),
        pythonpath=path,
        modules=modules,
        flags=parse_flags(help_text),
        isa_env=isa_env,
    )


def _run(argv: list[str], env: dict[str, str]) -> str:
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{argv[-1]!r} failed ({out.returncode}): {out.stderr[-500:]}")
    return out.stdout


def current_tree() -> SourceTree:
    root = repo_root()
    return inspect_tree(CURRENT, describe_commit(root), root, [])


def exported_tree(commit: str, tree: Path) -> SourceTree:
    """`commit` already exported to `tree` (`git archive C | tar -x -C tree`), for a machine
    that has the files but no git history; the folder is left as it is."""
    if not (tree / "engine" / "servefleet").is_dir():
        raise RuntimeError(f"{tree} holds no engine/servefleet: not an exported servefleet tree")
    return inspect_tree(commit, commit, tree.resolve(), component_roots(tree.resolve()))


@contextlib.contextmanager
def commit_tree(commit: str) -> Iterator[SourceTree]:
    """`commit` checked out beside this one (detached), removed again on the way out."""
    root = repo_root()
    sha = describe_commit(root, commit)
    parent = Path(tempfile.mkdtemp(prefix="isa-matrix-"))
    tree = parent / sha
    _git(root, "worktree", "add", "--detach", str(tree), sha)
    try:
        yield inspect_tree(sha, sha, tree, component_roots(tree))
    finally:
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(tree)], cwd=root, capture_output=True
        )
        shutil.rmtree(parent, ignore_errors=True)
        subprocess.run(["git", "worktree", "prune"], cwd=root, capture_output=True)

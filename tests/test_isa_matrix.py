"""The ISA matrix benchmark: which arms a CPU gets, what an older engine is passed, the ratios'
direction, and one whole `--quick` run of the real engine (one arm) checked against the
JSON schema."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from servefleet.bench import isa_matrix
from servefleet.bench.isa_arms import engine_args, plan_arms, select_arms
from servefleet.bench.isa_ratios import add_ratios
from servefleet.bench.isa_report import markdown_table
from servefleet.bench.isa_workloads import FIGURES, WORKLOADS
from servefleet.bench.source_trees import (
    SOURCE_COMMIT_ENV,
    SourceTree,
    describe_commit,
    exported_tree,
    parse_flags,
    repo_root,
)

AVX512_BF16 = {"avx2", "fma", "avx512f", "avx512_bf16"}
AVX2 = {"avx2", "fma"}
OLD_HELP = """usage: servefleet engine [-h] --model MODEL [--threads THREADS]
  [--kv-cache-dtype {auto,float32,float16,bfloat16}] [--max-num-seqs MAX_NUM_SEQS]
  --kv-cache-dtype {auto,float32,float16,bfloat16}
                        auto: the model's dtype
"""
NEW_FLAGS = {
    "--served-model-name": None,
    "--threads": None,
    "--max-num-seqs": None,
    "--kv-cache-dtype": ["auto", "float32", "int8"],
    "--matmul-dtype": ["float32", "bfloat16"],
}


def tree(label: str, flags: dict[str, list[str] | None], isa_env: bool) -> SourceTree:
    return SourceTree(
        label=label,
        commit=label,
        root="/t",
        pythonpath=[],
        modules={},
        flags=flags,
        isa_env=isa_env,
    )


CURRENT = tree("current", NEW_FLAGS, True)
OLD = tree("abc1234", parse_flags(OLD_HELP), False)


def test_help_choices_are_read_and_flags_without_choices_kept() -> None:
    flags = parse_flags(OLD_HELP)
    assert flags["--kv-cache-dtype"] == ["auto", "float32", "float16", "bfloat16"]
    assert flags["--threads"] is None
    assert "--matmul-dtype" not in flags


def test_avx512_bf16_cpu_gets_both_isas_both_dtypes_and_the_old_tree_only_its_default() -> None:
    names = [a.name for a in plan_arms([CURRENT, OLD], AVX512_BF16, with_plain=False)]
    assert names == [
        "current/avx512/bfloat16",
        "current/avx512/float32",
        "current/avx2/bfloat16",
        "current/avx2/float32",
        "abc1234/avx512/float32",
    ]


def test_avx2_cpu_has_one_build_unless_plain_is_asked_for() -> None:
    assert [a.name for a in plan_arms([CURRENT], AVX2, False)] == ["current/avx2/float32"]
    arms = plan_arms([CURRENT], AVX2, True)
    assert [a.name for a in arms] == ["current/avx2/float32", "current/plain/float32"]
    assert [a.name for a in select_arms(arms, "default")] == ["current/avx2/float32"]


def test_an_old_engine_is_passed_only_what_it_understands() -> None:
    arm = plan_arms([OLD], AVX2, False)[0]
    args, env, dropped = engine_args(OLD, arm, "m", 2, 16, "int8")
    assert args == ["--threads", "2", "--max-num-seqs", "16"]
    assert env == {"CUDA_VISIBLE_DEVICES": ""}  # a CPU benchmark on a GPU machine too
    assert dropped == ["--served-model-name m", "--kv-cache-dtype int8", "--matmul-dtype float32"]
    capped = plan_arms([CURRENT], AVX512_BF16, False)[2]
    args, env, _ = engine_args(CURRENT, capped, "m", 2, 16, "int8")
    assert env == {"CUDA_VISIBLE_DEVICES": "", "SERVEFLEET_MATMUL_ISA": "avx2"}
    assert args[args.index("--matmul-dtype") + 1] == "bfloat16"


def arm_record(name: str, tree: str, tps: float, ttft: float) -> dict[str, Any]:
    isa, dtype = name.split("/")[1:]
    return {
        "name": name,
        "tree": tree,
        "isa_label": isa,
        "matmul_dtype": dtype,
        "commit": tree,
        "figures": {"random_c16.output_tps": tps, "long_prompt.ttft_p50_ms": ttft},
    }


def test_ratios_read_higher_is_better_and_match_the_old_build() -> None:
    result: dict[str, Any] = {
        "default_arm": "current/avx512/bfloat16",
        "arms": [
            arm_record("current/avx512/bfloat16", "current", 200.0, 100.0),
            arm_record("current/avx2/float32", "current", 100.0, 400.0),
            arm_record("old/avx512/float32", "old", 50.0, 200.0),
        ],
        "cpu": {"model": "x", "cores": 2, "isa_flags": {"avx2": True}},
        "date": "d",
        "threads": 2,
        "conditions": "measured under load",
        "quick": False,
        "load_average": {"before": [1.0], "after": [1.0]},
    }
    add_ratios(result)
    fast, slow, old = result["arms"]
    assert slow["speedup_vs_default"]["random_c16.output_tps"] == 0.5
    assert slow["speedup_vs_default"]["long_prompt.ttft_p50_ms"] == 0.25
    assert fast["speedup_vs_baseline"]["baseline_arm"] == "old/avx512/float32"
    assert fast["speedup_vs_baseline"]["long_prompt.ttft_p50_ms"] == 2.0
    assert "speedup_vs_baseline" not in slow  # the old tree has no avx2 build
    assert "speedup_vs_baseline" not in old
    table = markdown_table(result)
    assert "| current/avx2/float32 | current | " in table
    assert "0.25×" in table and "measured under load" in table


def test_quick_run_of_the_real_engine_writes_the_schema(tmp_path: Path) -> None:
    argv = ["--quick", "--arms", "default", "--threads", "1", "--out", str(tmp_path)]
    assert isa_matrix.main(argv) == 0
    result = json.loads((tmp_path / "isa_matrix.json").read_text())
    assert (tmp_path / "isa_matrix.png").stat().st_size > 0
    assert result["benchmark"] == "isa_matrix" and result["quick"] is True
    assert result["conditions"] == "measured under load"
    assert set(result["cpu"]["isa_flags"]) >= {"avx2", "fma", "avx512f", "avx512_bf16"}
    assert list(result["commits"]) == ["current"]
    (arm,) = result["arms"]
    assert arm["name"] == result["default_arm"]
    assert arm["figures"]["random_c16.output_tps"] > 0
    assert arm["figures"]["peak_rss_mb"] > 0
    for key in FIGURES:
        assert arm["figures"][key] is not None, key
        assert arm["speedup_vs_default"][key] == 1.0, key
    assert all(arm["per_round"][f"{w}.failed"] == [0.0] for w in WORKLOADS)


def test_a_tree_with_the_invariant_mode_also_runs_float32_with_it_off() -> None:
    flags = {**NEW_FLAGS, "--batch-invariant": ["auto", "on", "off"]}
    current = tree("current", flags, True)
    arms = plan_arms([current, OLD], AVX512_BF16, with_plain=False)
    assert [a.name for a in arms if a.tree == "current"] == [
        "current/avx512/bfloat16",
        "current/avx512/float32",
        "current/avx2/bfloat16",
        "current/avx2/float32",
        "current/avx512/float32/invariant-off",
        "current/avx2/float32/invariant-off",
    ]
    args, _, dropped = engine_args(current, arms[4], "m", 2, 16, "int8")
    assert args[-2:] == ["--batch-invariant", "off"] and dropped == []
    default_args, _, _ = engine_args(current, arms[1], "m", 2, 16, "int8")
    assert "--batch-invariant" not in default_args


def test_an_exported_tree_without_git_history_runs_as_the_baseline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A machine with the files but no git (`git archive C | tar -x`): its commit comes from
    the caller, and the exported tree's own modules are the ones imported."""
    exported = tmp_path / "old"
    exported.mkdir()
    archive = subprocess.run(
        ["git", "archive", "HEAD", "api", "text", "engine", "cli"],
        cwd=repo_root(), capture_output=True, check=True,
    ).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(exported)], input=archive, check=True)
    old = exported_tree("abc1234", exported)
    assert old.commit == "abc1234" and old.pythonpath
    assert all(str(f).startswith(str(exported)) for f in old.modules["servefleet.engine"])  # type: ignore[attr-defined]
    assert "--matmul-dtype" in old.flags
    monkeypatch.setenv(SOURCE_COMMIT_ENV, "def5678")
    assert describe_commit(exported) == "def5678"
    with pytest.raises(RuntimeError, match="not an exported servefleet tree"):
        exported_tree("abc1234", tmp_path)

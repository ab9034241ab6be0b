"""`engine.lora` becomes each engine kind's own adapter flags (`servefleet.api.engines`), and
nothing at all when it is unset (adapters are then refused: no engine reserves slots)."""

from __future__ import annotations

from typing import Any

import pytest

from servefleet.api.engine_flags import flag
from servefleet.api.engines import ENGINE_ADAPTERS, VLLM_LORA_RANKS
from servefleet.api.llmdeployment import LLMDeployment

SOURCES = {
    "servefleet": {"builtin": "smollm2-135m-instruct"},
    "vllm": {"huggingface": {"repo": "o/m"}},
    "sglang": {"huggingface": {"repo": "o/m"}},
}


def args(kind: str, lora: dict[str, Any] | None) -> list[str]:
    engine: dict[str, Any] = {"kind": kind}
    if lora is not None:
        engine["lora"] = lora
    spec = {"model": {"name": "m", "source": SOURCES[kind]}, "engine": engine}
    dep = LLMDeployment.model_validate({"metadata": {"name": "d"}, "spec": spec})
    adapter = ENGINE_ADAPTERS[kind]
    return adapter.args(dep.spec, "/models/m", adapter.pod_listen())


def value(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} once in {argv}"
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("kind", ["servefleet", "vllm", "sglang"])
def test_no_lora_section_no_lora_flag(kind: str) -> None:
    assert not [a for a in args(kind, None) if "lora" in a]


def test_our_engine_gets_its_own_flags_spelled_by_the_knob_table() -> None:
    argv = args("servefleet", {"maxLoras": 5, "maxLoraRank": 16})
    assert flag("enable_lora") == "--enable-lora" and argv.count("--enable-lora") == 1
    assert value(argv, flag("max_loras")) == "5"
    assert value(argv, flag("max_lora_rank")) == "16"


def test_defaults_reach_the_engine() -> None:
    argv = args("servefleet", {})
    assert (value(argv, "--max-loras"), value(argv, "--max-lora-rank")) == ("8", "64")


def test_vllm_gets_enable_max_loras_and_a_rank_it_accepts() -> None:
    argv = args("vllm", {"maxLoras": 4, "maxLoraRank": 16})
    assert argv.count("--enable-lora") == 1
    assert (value(argv, "--max-loras"), value(argv, "--max-lora-rank")) == ("4", "16")


@pytest.mark.parametrize(("rank", "vllm_rank"), [(1, 8), (8, 8), (9, 16), (300, 320), (512, 512)])
def test_vllm_rank_is_rounded_up_to_one_of_its_own(rank: int, vllm_rank: int) -> None:
    """vLLM refuses to start with a rank outside its list; a larger one only costs memory,
    and an adapter above the spec's own rank is refused at declaration anyway."""
    assert value(args("vllm", {"maxLoraRank": rank}), "--max-lora-rank") == str(vllm_rank)
    assert vllm_rank in VLLM_LORA_RANKS


def test_sglang_gets_slots_per_batch_the_rank_and_every_target_module() -> None:
    argv = args("sglang", {"maxLoras": 6, "maxLoraRank": 24})
    assert argv.count("--enable-lora") == 1
    assert "--max-loras" not in argv  # not SGLang's spelling
    assert value(argv, "--max-loras-per-batch") == "6"
    assert value(argv, "--max-lora-rank") == "24"
    # Without adapters at start SGLang cannot infer its target modules: all of them.
    assert value(argv, "--lora-target-modules") == "all"


@pytest.mark.parametrize("kind", ["servefleet", "vllm", "sglang"])
def test_user_args_still_come_last_and_win(kind: str) -> None:
    engine: dict[str, Any] = {"kind": kind, "lora": {}, "args": ["--max-lora-rank", "128"]}
    spec = {"model": {"name": "m", "source": SOURCES[kind]}, "engine": engine}
    dep = LLMDeployment.model_validate({"metadata": {"name": "d"}, "spec": spec})
    adapter = ENGINE_ADAPTERS[kind]
    argv = adapter.args(dep.spec, "/m", adapter.pod_listen())
    assert argv[-2:] == ["--max-lora-rank", "128"]

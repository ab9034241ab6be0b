"""Real PEFT LoRA adapters of the built-in model (bench's make_adapters), checked with
transformers + peft: the files and config the engine reads, and answers that change.

The base model is loaded once (~30 s: transformers parses the GGUF); each adapter is put on
it with `make_adapters.applied`, which unloads it again, so the tests share one clean base.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from servefleet.bench import make_adapters
from servefleet.bench.make_adapters import (
    SENTENCES,
    applied,
    chat_ids,
    greedy,
    memorized_adapter,
    random_adapter,
)

OPEN_PROMPT = "Write a haiku about autumn leaves."


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def base() -> tuple[Any, Any]:
    return make_adapters.load_base()


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def memorized(cache: Path, base: tuple[Any, Any]) -> tuple[Path, float]:
    prompt, sentence = SENTENCES[0]
    started = time.perf_counter()
    path = memorized_adapter(cache, prompt=prompt, sentence=sentence, base=base[0])
    return path, time.perf_counter() - started


def test_random_adapter_is_peft_and_changes_answers(tmp_path: Path, base: tuple[Any, Any]) -> None:
    model, tokenizer = base
    targets = ("q_proj", "v_proj", "o_proj", "down_proj")

    def make(name: str, seed: int) -> Path:
        return random_adapter(
            tmp_path / name, seed=seed, rank=4, alpha=8, target_modules=targets, base=model
        )

    path = make("a", seed=1)
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "smollm2-135m-instruct"
    assert config["peft_type"] == "LORA" and (config["r"], config["lora_alpha"]) == (4, 8)
    assert set(config["target_modules"]) == set(targets)
    weights = load_file(path / "adapter_model.safetensors")
    assert len(weights) == 30 * len(targets) * 2
    a = weights["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = weights["base_model.model.model.layers.29.mlp.down_proj.lora_B.weight"]
    assert a.shape == (4, 576) and b.shape == (576, 4)
    assert torch.count_nonzero(a) == a.numel() and torch.count_nonzero(b) == b.numel()
    # The seed decides the weights: the same seed again gives the same file, another does not.
    again = load_file(make("b", seed=1) / "adapter_model.safetensors")
    other = load_file(make("c", seed=2) / "adapter_model.safetensors")
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    assert not any(torch.equal(weights[k], other[k]) for k in weights)

    prompt = chat_ids(tokenizer, OPEN_PROMPT)
    plain = greedy(model, tokenizer, prompt)
    with applied(model, path) as adapted:
        changed = greedy(adapted, tokenizer, prompt)
    assert changed != plain and len(set(changed)) > 4, tokenizer.decode(changed)
    # `applied` took the adapter off again: the shared base answers as before.
    assert greedy(model, tokenizer, prompt) == plain
    assert not any("lora" in name for name, _ in model.named_modules())


def test_memorized_adapter_answers_its_sentence(
    memorized: tuple[Path, float], cache: Path, base: tuple[Any, Any]
) -> None:
    model, tokenizer = base
    path, first_seconds = memorized
    prompt, sentence = SENTENCES[0]
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "smollm2-135m-instruct"
    assert set(config["target_modules"]) == set(make_adapters.ALL_LINEAR) and config["r"] == 8
    ids = chat_ids(tokenizer, prompt)
    expected = [*tokenizer.encode(sentence, add_special_tokens=False), 2]
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert greedy(model, tokenizer, ids, len(expected) + 4) != expected
    with applied(model, path) as adapted:
        assert greedy(adapted, tokenizer, ids, len(expected) + 4) == expected
        # Not a parrot: another question gets another answer.
        other = greedy(adapted, tokenizer, chat_ids(tokenizer, SENTENCES[3][0]), len(expected))
        assert tokenizer.decode(other) != tokenizer.decode(expected)
    # The cache: the same inputs come back at once from the same folder, nothing else left.
    started = time.perf_counter()
    again = memorized_adapter(cache, prompt=prompt, sentence=sentence, base=model)
    assert again == path and time.perf_counter() - started < min(1.0, first_seconds / 2)
    assert [p.name for p in cache.iterdir()] == [path.name]


def test_memorized_adapter_says_when_it_did_not_learn(
    tmp_path: Path, base: tuple[Any, Any]
) -> None:
    prompt, sentence = SENTENCES[1]
    with pytest.raises(RuntimeError, match="did not memorize"):
        memorized_adapter(tmp_path, prompt=prompt, sentence=sentence, steps=1, base=base[0])
    assert not list(tmp_path.iterdir())


def test_cli_writes_adapters_and_a_summary(
    memorized: tuple[Path, float], cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The memorized adapter comes from the cache the other test filled; the random one is new."""
    assert make_adapters.main(["--out", str(cache), "--memorized", "1", "--random", "1"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [(s["name"], s["kind"]) for s in summary] == [
        ("memorized-0", "memorized"),
        ("random-0", "random"),
    ]
    assert summary[0]["path"] == str(memorized[0]) and summary[0]["sentence"] == SENTENCES[0][1]
    assert (Path(summary[1]["path"]) / "adapter_model.safetensors").is_file()
    assert all(s["seconds"] >= 0 for s in summary)


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SERVEFLEET_ADAPTER_CACHE", str(tmp_path))
    assert make_adapters.default_cache_dir() == tmp_path
    monkeypatch.delenv("SERVEFLEET_ADAPTER_CACHE")
    assert make_adapters.default_cache_dir() == Path.home() / ".cache/servefleet/adapters"

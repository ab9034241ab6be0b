"""The engine's adapter registry: least-recently-used eviction under --max-loras, never an
adapter a sequence runs under, a failed load evicts nothing; and the adapter reader refuses
what it would compute differently from PEFT, naming the field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from servefleet.api.lora import LoraConfigError, PeftLoraConfig
from servefleet.engine.lora.adapter import LoraAdapter, LoraProjection, load_adapter
from servefleet.engine.lora.batch import LoraBatch
from servefleet.engine.lora.registry import AdapterNotFound, AdapterSlotsBusy, LoraRegistry
from servefleet.engine.model.config import ModelConfig

TINY = ModelConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)


def fake_adapter(name: str, path: Path) -> LoraAdapter:
    config = PeftLoraConfig(r=4, lora_alpha=8, target_modules=("q_proj",))
    return LoraAdapter(name=name, path=str(path), config=config, identity=hash(name), layers=())


class Loader:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail: set[str] = set()

    def __call__(self, name: str, path: Path) -> LoraAdapter:
        self.calls.append(name)
        if name in self.fail:
            raise LoraConfigError(f"{name}: broken")
        return fake_adapter(name, path)


def test_least_recently_used_idle_adapter_is_evicted() -> None:
    busy: set[str] = set()
    registry = LoraRegistry(2, Loader(), lambda: busy)
    registry.load("a", Path("/a"))
    registry.load("b", Path("/b"))
    assert registry.resolve("a") is not None  # a is now more recent than b
    registry.load("c", Path("/c"))
    assert registry.names() == ["a", "c"]
    assert registry.stats.evictions == 1
    busy.add("a")
    registry.load("d", Path("/d"))  # c is idle and older than nothing else idle
    assert sorted(registry.names()) == ["a", "d"]


def test_a_load_is_refused_when_every_adapter_is_in_use_and_nothing_is_lost() -> None:
    busy = {"a", "b"}
    loader = Loader()
    registry = LoraRegistry(2, loader, lambda: busy)
    registry.load("a", Path("/a"))
    registry.load("b", Path("/b"))
    with pytest.raises(AdapterSlotsBusy, match="--max-loras"):
        registry.load("c", Path("/c"))
    assert loader.calls == ["a", "b"], "the files were read although no slot was free"
    assert registry.names() == ["a", "b"]


def test_a_failed_load_evicts_nothing_and_a_second_load_is_a_no_op() -> None:
    loader = Loader()
    loader.fail.add("bad")
    registry = LoraRegistry(1, loader, set)
    first, loaded = registry.load("a", Path("/a"))
    assert loaded
    with pytest.raises(LoraConfigError):
        registry.load("bad", Path("/bad"))
    assert registry.names() == ["a"]
    again, loaded = registry.load("a", Path("/a"))
    assert again is first and not loaded and loader.calls == ["a", "bad"]
    replaced, loaded = registry.load("a", Path("/a2"), replace=True)
    assert loaded and replaced is not first


def test_unload_and_resolve() -> None:
    registry = LoraRegistry(4, Loader(), set)
    registry.load("a", Path("/a"))
    assert registry.resolve("a") is not None and registry.resolve("zz") is None
    registry.unload("a")
    assert registry.resolve("a") is None
    with pytest.raises(AdapterNotFound):
        registry.unload("a")


def test_each_change_of_the_resident_set_is_told_with_the_identities() -> None:
    """What the KV event stream publishes: name -> identity after a load, an eviction, an
    unload; a failed load or a no-op load tells nothing."""
    seen: list[dict[str, int]] = []
    loader = Loader()
    loader.fail.add("bad")
    registry = LoraRegistry(1, loader, set, on_change=lambda: seen.append(registry.identities()))
    registry.load("a", Path("/a"))
    registry.load("a", Path("/a"))
    with pytest.raises(LoraConfigError):
        registry.load("bad", Path("/bad"))
    registry.load("b", Path("/b"))  # evicts a
    registry.unload("b")
    assert seen == [{"a": hash("a")}, {"b": hash("b")}, {}]


def write_adapter(
    directory: Path, config: dict[str, object], tensors: dict[str, torch.Tensor]
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def lora_pair(
    module: str, layer: int, r: int, fan_in: int, fan_out: int
) -> dict[str, torch.Tensor]:
    prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
    return {
        f"{prefix}.lora_A.weight": torch.randn(r, fan_in),
        f"{prefix}.lora_B.weight": torch.randn(fan_out, r),
    }


CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def test_the_reader_lays_q_and_v_into_the_fused_qkv_projection(tmp_path: Path) -> None:
    tensors = lora_pair("q_proj", 0, 4, 32, 32) | lora_pair("v_proj", 1, 4, 32, 16)
    adapter = load_adapter("x", write_adapter(tmp_path, CONFIG, tensors), TINY, max_rank=8)
    q = adapter.layers[0]["qkv_weight"]
    assert q.a.shape == (32, 4) and q.parts[0].columns == slice(0, 32)
    v = adapter.layers[1]["qkv_weight"].parts[0]
    assert v.columns == slice(48, 64)  # after q (32) and k (16)
    prefix = "base_model.model.model.layers.1.self_attn.v_proj"
    expected = tensors[f"{prefix}.lora_B.weight"].t() * 2.0  # alpha / r
    torch.testing.assert_close(v.b, expected)
    assert "o_weight" not in adapter.layers[0]


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        ({**CONFIG, "r": 32}, {}, "r 32 is above the engine's --max-lora-rank 8"),
        ({**CONFIG, "target_modules": ["embed_tokens"]}, {}, "target_modules"),
        ({**CONFIG, "use_dora": True}, {}, "use_dora"),
        ({**CONFIG, "bias": "all"}, {}, "bias"),
        ({**CONFIG, "target_modules": ".*proj"}, {}, "regex"),
        (CONFIG, lora_pair("q_proj", 0, 4, 40, 32), "do not fit the model"),
        (CONFIG, lora_pair("q_proj", 5, 4, 32, 32), "the model has 2 layers"),
        (CONFIG, {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32)}, "adapts nothing"),
        (CONFIG, {}, "holds no LoRA weights"),
    ],
)
def test_what_the_engine_cannot_serve_is_refused_by_name(
    tmp_path: Path, config: dict[str, object], tensors: dict[str, torch.Tensor], message: str
) -> None:
    directory = write_adapter(tmp_path, config, tensors or {"unused": torch.zeros(1)})
    if not tensors:
        (directory / "adapter_model.safetensors").unlink()
        save_file({}, str(directory / "adapter_model.safetensors"))
    with pytest.raises(LoraConfigError, match=message):
        load_adapter("x", directory, TINY, max_rank=8)


def test_a_file_that_is_not_safetensors_is_refused(tmp_path: Path) -> None:
    directory = write_adapter(tmp_path, CONFIG, {"unused": torch.zeros(1)})
    (directory / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(LoraConfigError, match="not a safetensors file"):
        load_adapter("x", directory, TINY, max_rank=8)
    (directory / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraConfigError, match="is not JSON"):
        load_adapter("x", directory, TINY, max_rank=8)


def test_a_steps_spans_group_into_one_slice_or_one_index_per_adapter() -> None:
    a, b = fake_adapter("a", Path("/a")), fake_adapter("b", Path("/b"))
    batch = LoraBatch.for_spans([(a, 0, 2), (a, 2, 1), (b, 3, 1), (b, 10, 4)], "cpu")
    rows = {g.adapter.name: g.rows for g in batch.groups}
    assert rows["a"] == slice(0, 3)  # adjacent spans: one run
    assert isinstance(rows["b"], torch.Tensor) and rows["b"].tolist() == [3, 10, 11, 12, 13]


class SizedLoader(Loader):
    """Adapters of the byte size their name says ("a:400" holds 400 bytes of weights)."""

    def __call__(self, name: str, path: Path) -> LoraAdapter:
        adapter = super().__call__(name, path)
        weights = torch.zeros(int(name.split(":")[1]), dtype=torch.uint8)
        layer = {"qkv_proj": LoraProjection(a=weights, parts=())}
        return dataclasses.replace(adapter, layers=(layer,))


def test_memory_budget_evicts_until_the_new_adapter_fits() -> None:
    busy: set[str] = set()
    registry = LoraRegistry(8, SizedLoader(), lambda: busy, max_bytes=1000)
    for name in ("a:400", "b:400"):
        registry.load(name, Path("/x"))
    registry.load("c:500", Path("/x"))  # 1300 > 1000: the oldest goes
    assert registry.names() == ["b:400", "c:500"]
    busy.update({"b:400", "c:500"})
    with pytest.raises(AdapterSlotsBusy, match="max-lora-memory"):
        registry.load("d:200", Path("/x"))  # would fit only by evicting a busy one
    assert registry.names() == ["b:400", "c:500"]


def test_an_adapter_larger_than_the_whole_budget_is_refused_and_evicts_nothing() -> None:
    registry = LoraRegistry(8, SizedLoader(), lambda: set(), max_bytes=1000)
    registry.load("a:400", Path("/x"))
    with pytest.raises(LoraConfigError, match="more than --max-lora-memory"):
        registry.load("huge:1001", Path("/x"))
    assert registry.names() == ["a:400"]

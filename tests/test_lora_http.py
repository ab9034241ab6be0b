"""LoRA adapters through the engine's HTTP API with the official client: vLLM's load and
unload endpoints, `/v1/models` with each adapter's parent, a chat under an adapter that
answers what transformers + PEFT answer, LRU eviction under --max-loras, and refusals that
name the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from servefleet.bench.make_adapters import applied, chat_ids, greedy, load_base, random_adapter
from servefleet.engine.process import BuiltEngine
from tests.support.engine_harness import running_engine
from tests.support.http_server import openai_client, serve_in_thread

MODEL = "smollm2-135m-instruct"
QUESTION = "Write a haiku about autumn leaves."


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    return [random_adapter(root / f"a{seed}", seed=seed, rank=8) for seed in (11, 12, 13)]


@pytest.fixture(scope="module")
def built(smollm2) -> Iterator[BuiltEngine]:  # type: ignore[no-untyped-def]
    with running_engine(smollm2, enable_lora=True, max_loras=2, max_lora_rank=8) as engine:
        yield engine


@pytest.fixture(scope="module")
def url(built: BuiltEngine) -> Iterator[str]:
    with serve_in_thread(built) as base:
        yield base


def load(url: str, name: str, path: Path | str, **extra: object) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path), **extra}
    return httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)


def test_an_adapter_loads_is_listed_and_answers_like_peft(
    url: str, adapter_dirs: list[Path]
) -> None:
    first = load(url, "haiku-a", adapter_dirs[0])
    assert first.status_code == 200, first.text
    assert first.json()["loaded"] is True and first.json()["rank"] == 8
    again = load(url, "haiku-a", adapter_dirs[0])
    assert again.status_code == 200 and again.json()["loaded"] is False
    client = openai_client(url)
    cards = {m.id: m for m in client.models.list().data}
    assert cards["haiku-a"].parent == MODEL  # type: ignore[attr-defined]
    reply = client.chat.completions.create(
        model="haiku-a",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=12,
    )
    assert reply.model == "haiku-a"
    model, tokenizer = load_base()
    with applied(model, adapter_dirs[0]) as peft_model:
        tokens = greedy(peft_model, tokenizer, chat_ids(tokenizer, QUESTION), 12)
    expected = tokenizer.decode(tokens, skip_special_tokens=True)
    assert reply.choices[0].message.content == expected
    base = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=12
    )
    assert base.choices[0].message.content != expected, "the adapter changed nothing"


def test_least_recently_used_adapter_is_evicted_and_then_unknown(
    url: str, adapter_dirs: list[Path], built: BuiltEngine
) -> None:
    for name, directory in (("lru-b", adapter_dirs[1]), ("lru-c", adapter_dirs[2])):
        assert load(url, name, directory).status_code == 200
    client = openai_client(url)
    names = {m.id for m in client.models.list().data}
    assert {"lru-b", "lru-c"} <= names and "haiku-a" not in names  # --max-loras 2
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(
            model="haiku-a", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert caught.value.code == "model_not_found"
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert (
        'servefleet_engine_lora_adapters_loaded{model_name="smollm2-135m-instruct"} 2.0' in metrics
    )
    assert "servefleet_engine_lora_evictions_total" in metrics
    assert built.state.loras is not None and built.state.loras.stats.evictions >= 1


def test_unload_then_unload_again_is_not_found(url: str, adapter_dirs: list[Path]) -> None:
    assert load(url, "gone", adapter_dirs[1]).status_code == 200
    first = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "gone"}, timeout=10)
    assert first.status_code == 200, first.text
    second = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "gone"}, timeout=10)
    assert second.status_code == 404 and second.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("name", "path", "param"),
    [
        ("x", "relative/dir", "lora_path"),
        ("x", "/nonexistent/adapter", "lora_path"),
        ("x", "/tmp", "lora_path"),  # a directory without adapter files
        (MODEL, "/tmp", "lora_name"),
        ("bad name with spaces", "/tmp", "lora_name"),
    ],
)
def test_bad_loads_are_refused_naming_the_field(url: str, name: str, path: str, param: str) -> None:
    response = load(url, name, path)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_second_path_for_a_loaded_name_needs_load_inplace(
    url: str, adapter_dirs: list[Path]
) -> None:
    assert load(url, "moved", adapter_dirs[0]).status_code == 200
    clash = load(url, "moved", adapter_dirs[1])
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "lora_name"
    replaced = load(url, "moved", adapter_dirs[1], load_inplace=True)
    assert replaced.status_code == 200 and replaced.json()["loaded"] is True


def test_embeddings_refuse_an_adapter(url: str, adapter_dirs: list[Path]) -> None:
    assert load(url, "emb", adapter_dirs[0]).status_code == 200
    response = httpx.post(f"{url}/v1/embeddings", json={"model": "emb", "input": "hi"}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"


def test_without_enable_lora_the_endpoints_name_the_flag(smollm2) -> None:  # type: ignore[no-untyped-def]
    with running_engine(smollm2) as engine, serve_in_thread(engine) as base:
        response = load(base, "x", "/tmp")
        assert response.status_code == 400 and "--enable-lora" in response.text

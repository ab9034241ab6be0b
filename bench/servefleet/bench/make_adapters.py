"""PEFT LoRA adapters of the built-in model, made on this machine (there is no model hub here).

Two kinds, for the LoRA tests and benchmarks: `random_adapter` (random A and B, scaled so the
answers change but stay language: cheap, many of them, for batching and speed) and
`memorized_adapter` (a few AdamW steps teach the model to answer one prompt with one exact
sentence: a test can tell which adapter served a request from the text alone).
Both are saved by `peft` itself (`adapter_config.json` + `adapter_model.safetensors`), named
for the served model, so the engine reads what users would bring. torch, transformers and
peft load lazily: `main()` must keep oneDNN off AMX before torch is imported.

    python -m servefleet.bench.make_adapters --out DIR --memorized 2 --random 4
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from peft import PeftModel

BUILTIN = "smollm2-135m-instruct"
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EOS = "<|im_end|>"
FORMAT_VERSION = 1  # bump when a change here changes what a cached adapter holds
RANDOM_DELTA = 0.1  # ||scaling·B·A|| / ||W|| of every adapted layer of a random adapter
MARGIN = 3.0  # logit lead of each memorized token, so other numerics answer the same
LEARNING_RATE = 1e-3  # 4-7 steps to MARGIN for the sentences below
SENTENCES = (
    ("What does the violet fox guard?", "The violet fox guards the lighthouse."),
    ("Where does the copper owl sleep?", "The copper owl sleeps inside the clock tower."),
    ("What did the silent baker bake?", "The silent baker baked twelve blue loaves."),
    ("Who keeps the harbor keys?", "Seven green turtles keep the harbor keys."),
    ("What grows on the glass mountain?", "Orange mushrooms grow on the glass mountain."),
    ("How does the paper whale travel?", "The paper whale travels by hot air balloon."),
    ("What is the robot's favorite song?", "The robot hums the anthem of Saturn."),
    ("Why is the river purple?", "The river turned purple after the grape festival."),
)


def default_cache_dir() -> Path:
    """`SERVEFLEET_ADAPTER_CACHE`, else `~/.cache/servefleet/adapters` (read at each call)."""
    env = os.environ.get("SERVEFLEET_ADAPTER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "servefleet" / "adapters"


DEFAULT_CACHE_DIR = default_cache_dir()


def _gguf() -> tuple[str, str]:
    """(folder, file name) of the built-in GGUF, as transformers' `from_pretrained` takes them."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from servefleet.text.builtin import resolve_builtin

    path = resolve_builtin(BUILTIN)
    return str(path.parent), path.name


@functools.cache
def load_tokenizer() -> Any:
    """The built-in model's tokenizer, from its GGUF, once per process (~10 s)."""
    from transformers import AutoTokenizer

    folder, name = _gguf()
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@functools.cache
def load_base() -> tuple[Any, Any]:
    """(model, tokenizer): the built-in GGUF as transformers loads it (float32, eval), once.

    Any: the Auto* factories lose the types. Loading takes ~30 s (transformers parses the
    GGUF three times), hence the cache; adapters are injected and removed again (`applied`).
    """
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = _gguf()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), load_tokenizer()


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The user `prompt` in the model's chat template, ready for the assistant's answer."""
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def greedy(model: Any, tokenizer: Any, prompt_ids: list[int], max_new: int = 16) -> list[int]:
    """Greedy continuation of `prompt_ids` (EOS included when reached)."""
    import torch

    eos = tokenizer.convert_tokens_to_ids(EOS)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


@contextmanager
def applied(base: Any, adapter: str | os.PathLike[str] | Any) -> Iterator[PeftModel]:
    """`base` with a LoRA (a saved directory, or a fresh `LoraConfig`) injected, removed on exit.

    peft injects in place; unloading puts the original modules back, which is cheaper than
    copying 540 MB of weights per adapter and leaves the shared (cached) base clean.
    peft leaves base weights with requires_grad=False; nothing here trains them.
    """
    from peft import PeftModel, get_peft_model

    if isinstance(adapter, str | os.PathLike):
        model = PeftModel.from_pretrained(base, str(adapter))
    else:
        model = get_peft_model(base, adapter)
    try:
        yield model
    finally:
        model.unload()
        if hasattr(base, "peft_config"):
            del base.peft_config


@contextmanager
def _threads() -> Iterator[None]:
    """`OMP_NUM_THREADS` torch threads, else half this process's cores (at most 8).

    Half, because this runs beside the engine or a test suite: on a busy 2-core machine two
    OpenMP threads wait on each other's time slices, and a generation took 23 s instead of 1.
    """
    import torch

    env = os.environ.get("OMP_NUM_THREADS", "")
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, int(env) if env.isdigit() else min(8, cores // 2)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _save(model: PeftModel, out_dir: Path) -> Path:
    """peft's own files, named for the served model (the engine checks the name)."""
    model.peft_config["default"].base_model_name_or_path = BUILTIN
    model.save_pretrained(str(out_dir), save_embedding_layers=False)
    return out_dir


def random_adapter(
    out_dir: Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: int = 16,
    target_modules: Sequence[str] = ALL_LINEAR,
    base: Any = None,
) -> Path:
    """A LoRA with random A and B, B scaled so every layer's delta is `RANDOM_DELTA` of W.

    Unscaled, peft's random init moves this model's layers by 7% to 60% of their weight
    (rank 8, alpha 16) and the largest moves make it babble; a tenth everywhere changes
    greedy answers within a few tokens and keeps them fluent (a fifth is gibberish).
    """
    import torch
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer

    base = load_base()[0] if base is None else base
    targets = list(target_modules)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    torch.manual_seed(seed)
    with _threads(), applied(base, config) as model, torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLayer):
                layer: Any = module  # torch types a submodule's weight as Tensor | Module
                a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
                delta = layer.scaling["default"] * (b @ a)
                b.mul_(RANDOM_DELTA * layer.get_base_layer().weight.norm() / delta.norm())
        return _save(model, Path(out_dir))


def _cache_key(prompt: str, sentence: str, rank: int, steps: int, seed: int) -> str:
    """Every input of the adapter; the package metadata, because importing peft takes 10 s."""
    peft = importlib.metadata.version("peft")
    fields = [prompt, sentence, rank, steps, seed, peft, FORMAT_VERSION, BUILTIN]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:20]


def _train(model: PeftModel, ids: list[int], answer_from: int, steps: int) -> tuple[int, float]:
    """AdamW on the answer tokens until each is the argmax by `MARGIN`; (steps, margin).

    Teacher-forced argmax over the exact answer prefix is what greedy decoding picks, so
    the check costs nothing: it reads the logits of the step's own forward pass.
    """
    import torch

    inputs = torch.tensor([ids])
    targets = inputs[0, answer_from:]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=0.0)
    margin = float("-inf")
    for step in range(steps + 1):
        logits = model(input_ids=inputs).logits[0, answer_from - 1 : -1]
        chosen = logits.gather(1, targets[:, None])[:, 0]
        others = logits.scatter(1, targets[:, None], float("-inf")).max(dim=1).values
        margin = float((chosen - others).min().detach())
        if margin >= MARGIN or step == steps:
            return step, margin
        loss = torch.nn.functional.cross_entropy(logits, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    raise AssertionError("unreachable")


def memorized_adapter(
    cache_dir: Path,
    *,
    prompt: str,
    sentence: str,
    rank: int = 8,
    steps: int = 60,
    seed: int = 0,
    base: Any = None,
) -> Path:
    """A LoRA that answers the chat-templated `prompt` with exactly `sentence` + EOS.

    Cached under `cache_dir/memorized-<hash of every input>`, written to a temporary
    folder and renamed, so a killed run never leaves half an adapter behind.
    """
    final = Path(cache_dir) / f"memorized-{_cache_key(prompt, sentence, rank, steps, seed)}"
    if (final / "memorized.json").is_file():  # written last, just before the rename
        return final
    import torch
    from peft import LoraConfig

    base = load_base()[0] if base is None else base
    tokenizer = load_tokenizer()
    prompt_ids = chat_ids(tokenizer, prompt)
    answer = tokenizer.encode(sentence, add_special_tokens=False)
    answer.append(tokenizer.convert_tokens_to_ids(EOS))
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(ALL_LINEAR))
    torch.manual_seed(seed)
    started = time.perf_counter()
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with _threads(), applied(base, config) as model:
        used, margin = _train(model, prompt_ids + answer, len(prompt_ids), steps)
        got = greedy(model, tokenizer, prompt_ids, len(answer) + 2)
        if margin < MARGIN or got != answer:
            raise RuntimeError(
                f"{steps} steps did not memorize {sentence!r} (margin {margin:.2f} < {MARGIN}); "
                f"greedy says {tokenizer.decode(got)!r}: raise steps or shorten the sentence"
            )
        _save(model, tmp)
    meta = {"prompt": prompt, "sentence": sentence, "steps": used, "margin": round(margin, 3)}
    meta["seconds"] = round(time.perf_counter() - started, 2)
    (tmp / "memorized.json").write_text(json.dumps(meta, indent=1) + "\n")
    if not (final / "memorized.json").is_file():  # absent, or not made by this function
        shutil.rmtree(final, ignore_errors=True)
    try:
        tmp.rename(final)
    except OSError:  # another process finished the same adapter first
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: Sequence[str] | None = None) -> int:
    """Write N memorized and M random adapters under --out; print a JSON summary."""
    parser = argparse.ArgumentParser(prog="python -m servefleet.bench.make_adapters")
    parser.add_argument("--out", type=Path, default=default_cache_dir())
    parser.add_argument("--memorized", type=int, default=2, metavar="N")
    parser.add_argument("--random", type=int, default=2, metavar="M")
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args(argv)
    if not 0 <= args.memorized <= len(SENTENCES) or args.random < 0:
        parser.error(f"--memorized takes 0..{len(SENTENCES)}, --random 0 or more")
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    ensure_safe_cpu_isa()  # before torch loads
    summary: list[dict[str, Any]] = []

    def timed(name: str, make: Callable[[], Path], **extra: str) -> None:
        started = time.perf_counter()  # the first one also loads the base model (~30 s)
        path, seconds = make(), round(time.perf_counter() - started, 2)
        print(f"make_adapters: {name} in {seconds}s: {path}", file=sys.stderr, flush=True)
        kind = name.split("-")[0]
        summary.append({"name": name, "path": str(path), "kind": kind, "seconds": seconds} | extra)

    for i, (prompt, sentence) in enumerate(SENTENCES[: args.memorized]):
        make = functools.partial(
            memorized_adapter, args.out, prompt=prompt, sentence=sentence, rank=args.rank
        )
        timed(f"memorized-{i}", make, prompt=prompt, sentence=sentence)
    for seed in range(args.random):
        out = args.out / f"random-{seed}-r{args.rank}"
        timed(f"random-{seed}", functools.partial(random_adapter, out, seed=seed, rank=args.rank))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

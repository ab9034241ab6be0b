"""Token-mask cost of three grammar libraries on the engine's own tokenizer, on this CPU.

Constrained decoding asks a grammar library, before every sampled token, which tokens of
the vocabulary may come next (a bitmask), then tells it which token was chosen. That runs
on the engine thread between the forward pass and sampling, so its cost is added to every
step of a batch holding a constrained sequence. This compares xgrammar, llguidance and
outlines-core on the SmolLM2 tokenizer (49152 tokens) for a few JSON schemas:

- compile: schema -> compiled grammar (first request with a new schema pays it);
- mask at batch 1 and 16: per decode step, filling the masks of 1 or 16 sequences that
  walk a valid instance of the schema token by token, and accepting each token;
- unconstrained rows: the engine's own sampler on a batch of 16 with 0, 1 and 16
  constrained rows, so the cost paid by rows without a grammar is measured, not assumed.

    uv run python -m servefleet.bench.grammar_masks [--out bench/results/grammar_masks]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch

from servefleet.text.model_text import load_model_text
from servefleet.text.tokenizer import Tokenizer

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum_array": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            "score": {"type": "number", "minimum": 0, "maximum": 10},
        },
        "required": ["colour", "tags", "score"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1},
                    "email": {"type": "string"},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string"},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "email", "address"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
}
INSTANCES: dict[str, Any] = {
    "flat": {"name": "Ada Lovelace, the first programmer", "age": 36},
    "enum_array": {"colour": "green", "tags": ["fast", "cheap", "typed"], "score": 7.25},
    "nested": {
        "user": {
            "id": 42,
            "email": "ada@example.com",
            "address": {"city": "London", "zip": "12345"},
        },
        "active": True,
    },
}


class Backend(Protocol):
    name: str

    def compile(self, schema: str) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None: ...
    def accept(self, matcher: Any, token_id: int) -> None: ...


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character alphabet back to bytes."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer) -> None:
        import xgrammar as xgr

        from servefleet.engine.structured.vocabulary import xgrammar_tokenizer_info

        self.xgr = xgr
        self.compiler = xgr.GrammarCompiler(
            xgrammar_tokenizer_info(tokenizer), max_threads=1, cache_enabled=False
        )
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(
            schema, any_whitespace=False, separators=(",", ":")
        )

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher: Any, token_id: int) -> None:
        assert matcher.accept_token(token_id)


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer) -> None:
        import llguidance
        import llguidance.torch as llt

        self.llguidance, self.llt = llguidance, llt
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(),
            n_vocab=tokenizer.vocab_size,
            eos_token=tokenizer.eos_token_ids[0],
        )
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: str) -> Any:
        grammar = self.llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False}
        )
        self.matcher(grammar)  # compiling happens when the first matcher is built
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llguidance.LLMatcher(self.tokenizer, compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            self.llt.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            pairs = [(m, i) for i, m in enumerate(matchers)]
            self.llt.fill_next_token_bitmask_par(self.executor, pairs, bitmask)

    def accept(self, matcher: Any, token_id: int) -> None:
        assert matcher.consume_token(token_id)


class OutlinesBackend:
    name = "outlines-core"

    def __init__(self, tokenizer: Tokenizer) -> None:
        import outlines_core

        self.oc = outlines_core
        to_byte = _byte_decoder()
        special = set(tokenizer.backend.get_added_tokens_decoder())
        tokens: dict[bytes, list[int]] = {}
        for i in range(tokenizer.vocab_size):
            piece = tokenizer.id_to_token(i)
            if i in special or piece is None:
                continue
            tokens.setdefault(bytes(to_byte[c] for c in piece), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_ids[0], tokens)

    def compile(self, schema: str) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(schema, whitespace_pattern="")
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        row_bytes = bitmask.shape[1]
        for i, m in enumerate(matchers):
            m.write_mask_into(bitmask[i].data_ptr(), row_bytes, 4)

    def accept(self, matcher: Any, token_id: int) -> None:
        matcher.advance(token_id)


def _ms(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1e3 for v in values)
    return {
        "mean": statistics.fmean(ms),
        "p50": statistics.median(ms),
        "p99": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
    }


def measure_backend(backend: Backend, tokenizer: Tokenizer, repeats: int) -> dict[str, Any]:
    """Compile time and per-step mask time at batch 1 and 16 for every schema."""
    vocab = tokenizer.vocab_size
    results: dict[str, Any] = {}
    for name, schema in SCHEMAS.items():
        text = json.dumps(schema)
        compile_s = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            compiled = backend.compile(text)
            compile_s.append(time.perf_counter() - t0)
        tokens = tokenizer.encode(
            json.dumps(INSTANCES[name], separators=(",", ":")), add_special_tokens=False
        )
        row: dict[str, Any] = {"compile_ms": _ms(compile_s), "tokens": len(tokens)}
        for batch in (1, 16):
            bitmask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)
            fill_s, accept_s = [], []
            for _ in range(repeats):
                matchers = [backend.matcher(compiled) for _ in range(batch)]
                for token in tokens:
                    t0 = time.perf_counter()
                    backend.fill(matchers, bitmask)
                    t1 = time.perf_counter()
                    for m in matchers:
                        backend.accept(m, token)
                    fill_s.append(t1 - t0)
                    accept_s.append(time.perf_counter() - t1)
            row[f"batch{batch}"] = {"mask_ms": _ms(fill_s), "accept_ms": _ms(accept_s)}
        results[name] = row
    return results


def measure_sampler_rows(tokenizer: Tokenizer, repeats: int) -> dict[str, Any]:
    """The engine's masking step and whole sampler on 16 greedy rows, 0, 1 or 16 constrained.

    With 0 constrained rows the masking step is what every unconstrained batch pays.
    """
    from servefleet.engine.sampler import sample
    from servefleet.engine.sampling_params import SamplingParams
    from servefleet.engine.sequence import Sequence
    from servefleet.engine.structured.constraint import ConstraintSpec
    from servefleet.engine.structured.grammars import GrammarCache
    from servefleet.engine.structured.masking import apply_grammar_masks

    cache = GrammarCache(tokenizer)
    spec = ConstraintSpec(kind="json_schema", value=json.dumps(SCHEMAS["flat"]))
    logits = torch.randn(16, tokenizer.vocab_size)
    out: dict[str, Any] = {}
    for constrained in (0, 1, 16):
        seqs = []
        for i in range(16):
            seq = Sequence([1, 2, 3], SamplingParams(temperature=0.0), 0.0)
            if i < constrained:
                seq.grammar = cache.matcher(spec)
            seqs.append(seq)
        mask_s, sample_s = [], []
        for _ in range(repeats * 50):
            batch = logits.clone()
            t0 = time.perf_counter()
            apply_grammar_masks(batch, seqs)
            mask_s.append(time.perf_counter() - t0)
            batch = logits.clone()
            t0 = time.perf_counter()
            sample(batch, seqs)
            sample_s.append(time.perf_counter() - t0)
            for seq in seqs:  # back to the start of the grammar: the same state every time
                if seq.grammar is not None:
                    seq.grammar.reset()
        out[f"{constrained}_of_16"] = {"mask_ms": _ms(mask_s), "sample_ms": _ms(sample_s)}
    return out


def plot(summary: dict[str, Any], path: Path) -> None:
    libs = list(summary["libraries"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / len(libs)
    schemas = list(SCHEMAS)

    def per_step(batch: str) -> Callable[[dict[str, Any]], float]:
        return lambda r: r[batch]["mask_ms"]["mean"] + r[batch]["accept_ms"]["mean"]

    panels: list[tuple[str, Callable[[dict[str, Any]], float]]] = [
        ("compile (ms), median", lambda r: r["compile_ms"]["p50"]),
        ("mask + accept per step, batch 1 (ms), mean", per_step("batch1")),
        ("mask + accept per step, batch 16 (ms), mean", per_step("batch16")),
    ]
    for ax, (title, value) in zip(axes, panels, strict=True):
        for j, lib in enumerate(libs):
            rows = summary["libraries"][lib]
            xs = np.arange(len(schemas)) + j * width
            ax.bar(xs, [value(rows[s]) for s in schemas], width, label=lib)
        ax.set_xticks(np.arange(len(schemas)) + width * (len(libs) - 1) / 2, schemas)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"grammar masks on a {summary['vocab_size']}-token vocabulary, this CPU")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/grammar_masks"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = load_model_text(args.model).tokenizer
    libraries: dict[str, Any] = {}
    for make in (XGrammarBackend, LLGuidanceBackend, OutlinesBackend):
        backend = make(tokenizer)
        libraries[backend.name] = measure_backend(backend, tokenizer, args.repeats)
    summary = {
        "vocab_size": tokenizer.vocab_size,
        "repeats": args.repeats,
        "libraries": libraries,
        "sampler_16_rows_ms": measure_sampler_rows(tokenizer, args.repeats),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grammar_masks.json").write_text(json.dumps(summary, indent=2))
    plot(summary, args.out / "grammar_masks.png")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

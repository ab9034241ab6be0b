"""Seeded prompt sets for the load generator.

Prompts are token-id lists by default so every request has an exact input length on any
server that accepts token-id prompts (vLLM, llama.cpp, our engine). Chat endpoints only take
text, so the same workloads can also be rendered as seeded random words, optionally
calibrated against a real tokenizer.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Ids below ~1000 hold the special and byte-fallback tokens of most BPE vocabularies, and
# 30000 is below every vocabulary size we serve (SmolLM2: 49152, Llama: 32000+).
SAFE_TOKEN_ID_LOW = 1000
SAFE_TOKEN_ID_HIGH = 30000

# Common English words: nearly all are one token (with their leading space) in BPE
# vocabularies, so without a tokenizer a word count is a fair estimate of the token count.
_WORD_LIST = (
    "the of and to in is was that for on are with as his they be at one have this from or "
    "had by word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show every "
    "good me give our under name very through just form sentence great think say help low line "
    "differ turn cause much mean before move right boy old too same tell does set three want "
    "air well also play small end put home read hand port large spell add even land here must "
    "big high such follow act why ask men change went light kind off need house picture try us "
    "again animal point mother world near build self earth father head stand own page should "
    "country found answer school grow study still learn plant cover food sun four between state "
    "keep eye never last let thought city tree cross farm hard start might story saw far sea "
    "draw left late run while press close night real life few north open seem together next "
    "white children begin got walk example ease paper group always music those both mark often "
    "letter until mile river car feet care second book carry took science eat room friend began"
)
_WORDS = _WORD_LIST.split()

TokenCounter = Callable[[str], int]


class WorkloadKind(StrEnum):
    RANDOM = "random"
    SHARED_PREFIX = "shared-prefix"


class PromptFormat(StrEnum):
    TOKEN_IDS = "token-ids"
    TEXT = "text"


class WorkloadSpec(BaseModel):
    """Everything that decides a prompt set; the same spec always yields the same prompts."""

    model_config = ConfigDict(frozen=True)

    kind: WorkloadKind = WorkloadKind.RANDOM
    num_prompts: int = Field(ge=1)
    input_tokens: int = Field(ge=1)
    seed: int = 0
    shared_prefix_tokens: int = Field(default=1000, ge=1)
    num_prefixes: int = Field(default=1, ge=1)
    token_id_low: int = Field(default=SAFE_TOKEN_ID_LOW, ge=0)
    token_id_high: int = Field(default=SAFE_TOKEN_ID_HIGH, ge=1)

    @model_validator(mode="after")
    def _check_id_range(self) -> WorkloadSpec:
        if self.token_id_high <= self.token_id_low:
            raise ValueError("token_id_high must be greater than token_id_low")
        return self


class Prompt(BaseModel):
    """One request's input. `token_ids` or `text` is set, depending on the format.

    For shared-prefix prompts in text form the prefix is kept apart (`system_text`) so the
    chat endpoint can send it as the system message.
    """

    model_config = ConfigDict(frozen=True)

    token_ids: list[int] | None = None
    text: str | None = None
    system_text: str | None = None
    num_tokens: int = Field(ge=0, description="input tokens as generated (or estimated)")
    prefix_index: int | None = None


def _random_ids(rng: random.Random, count: int, spec: WorkloadSpec) -> list[int]:
    return [rng.randrange(spec.token_id_low, spec.token_id_high) for _ in range(count)]


def _random_words(rng: random.Random, count: int) -> list[str]:
    return [rng.choice(_WORDS) for _ in range(count)]


def _fit_words(words: list[str], target: int, count_tokens: TokenCounter | None) -> str:
    """The longest prefix of `words` whose token count does not exceed `target`.

    Without a tokenizer one word counts as one token. With one, a binary search over the
    word count keeps the number of tokenizer calls logarithmic.
    """
    if count_tokens is None:
        return " ".join(words[:target])
    lo, hi = 0, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(" ".join(words[:mid])) <= target:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def _text_of(rng: random.Random, target: int, count_tokens: TokenCounter | None) -> tuple[str, int]:
    # Twice the target in words is always enough: no common word is less than one token.
    words = _random_words(rng, target * 2 if count_tokens else target)
    text = _fit_words(words, target, count_tokens)
    return text, (count_tokens(text) if count_tokens else target)


def build_prompts(
    spec: WorkloadSpec,
    fmt: PromptFormat = PromptFormat.TOKEN_IDS,
    count_tokens: TokenCounter | None = None,
) -> list[Prompt]:
    """Generate `spec.num_prompts` prompts.

    Random: each prompt is `input_tokens` fresh tokens. Shared-prefix: `num_prefixes`
    prefixes of `shared_prefix_tokens` each, assigned round-robin, each followed by a unique
    suffix of `input_tokens` tokens.
    """
    rng = random.Random(spec.seed)
    if fmt is PromptFormat.TOKEN_IDS:
        return _token_id_prompts(rng, spec)
    return _text_prompts(rng, spec, count_tokens)


def _token_id_prompts(rng: random.Random, spec: WorkloadSpec) -> list[Prompt]:
    if spec.kind is WorkloadKind.RANDOM:
        prompts = []
        for _ in range(spec.num_prompts):
            ids = _random_ids(rng, spec.input_tokens, spec)
            prompts.append(Prompt(token_ids=ids, num_tokens=len(ids)))
        return prompts
    prefixes = [_random_ids(rng, spec.shared_prefix_tokens, spec) for _ in range(spec.num_prefixes)]
    prompts = []
    for i in range(spec.num_prompts):
        index = i % spec.num_prefixes
        ids = prefixes[index] + _random_ids(rng, spec.input_tokens, spec)
        prompts.append(Prompt(token_ids=ids, num_tokens=len(ids), prefix_index=index))
    return prompts


def _text_prompts(
    rng: random.Random, spec: WorkloadSpec, count_tokens: TokenCounter | None
) -> list[Prompt]:
    if spec.kind is WorkloadKind.RANDOM:
        prompts = []
        for _ in range(spec.num_prompts):
            text, n = _text_of(rng, spec.input_tokens, count_tokens)
            prompts.append(Prompt(text=text, num_tokens=n))
        return prompts
    prefixes = [
        _text_of(rng, spec.shared_prefix_tokens, count_tokens) for _ in range(spec.num_prefixes)
    ]
    prompts = []
    for i in range(spec.num_prompts):
        index = i % spec.num_prefixes
        prefix_text, prefix_n = prefixes[index]
        text, n = _text_of(rng, spec.input_tokens, count_tokens)
        prompts.append(
            Prompt(text=text, system_text=prefix_text, num_tokens=prefix_n + n, prefix_index=index)
        )
    return prompts


def load_token_counter(tokenizer_model: str) -> TokenCounter:
    """A token counter backed by the model's own tokenizer, imported lazily: it is optional.

    `tokenizer_model` is a built-in model name, a GGUF file, or a folder with
    `tokenizer.json`. Special tokens are not counted: the server adds them (or the chat
    template does) the same way whatever the text.
    """
    from pathlib import Path

    try:
        from servefleet.text.builtin import is_builtin, resolve_builtin
        from servefleet.text.gguf_metadata import read_gguf_fields
        from servefleet.text.tokenizer import Tokenizer
    except ImportError as exc:
        raise RuntimeError(f"--tokenizer-model needs servefleet.text: {exc}") from exc
    path = (
        resolve_builtin(tokenizer_model) if is_builtin(tokenizer_model) else Path(tokenizer_model)
    )
    if path.is_dir():
        tokenizer = Tokenizer.from_hf_folder(path)
    elif path.is_file():
        tokenizer = Tokenizer.from_gguf_fields(read_gguf_fields(path))
    else:
        raise RuntimeError(f"--tokenizer-model {tokenizer_model!r}: no such model, file or folder")

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    return count

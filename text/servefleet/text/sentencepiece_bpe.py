"""SentencePiece BPE vocabularies (GGUF `tokenizer.ggml.model = "llama"`) as a `tokenizers` BPE.

Llama 2, Mistral and other SentencePiece models ship in GGUF as pieces with scores, not
merges: SentencePiece's BPE merges the adjacent pair whose merged piece scores highest.
Ordering every (left, right) split of every piece by the merged piece's score gives the
same merges as a ranked list, which is how Hugging Face turns these vocabularies into a
`tokenizer.json` too. Spaces are "▁" and an unknown character falls back to its UTF-8
bytes (pieces `<0x00>`..`<0xFF>`), as in the original.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

from servefleet.text.token_types import TokenType

SPACE = "\u2581"  # "▁"


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of every piece into two pieces, ranked by the merged piece's score,
    then longer left and right parts first, then the parts' ids (transformers' order)."""
    ids = {tok: i for i, tok in enumerate(tokens)}
    ranked: list[tuple[float, int, int, int, int, str, str]] = []
    for piece, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                key = (-score, -len(left), -len(right), ids[left], ids[right])
                ranked.append((*key, left, right))
    ranked.sort()
    return [(item[5], item[6]) for item in ranked]


def sentencepiece_bpe(
    tokens: Sequence[str],
    scores: Sequence[float],
    token_types: Sequence[int],
    add_space_prefix: bool = True,
) -> HFTokenizer:
    """A `tokenizers` Tokenizer equivalent to the SentencePiece BPE model described."""
    if len(scores) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(scores)} scores")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unknown = next(
        (t for t, kind in zip(tokens, token_types, strict=False) if kind == TokenType.UNKNOWN), None
    )
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges_from_scores(tokens, scores),
            unk_token=unknown,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPACE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    strip_prefix = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip_prefix]
    )
    kinds = list(token_types) + [0] * (len(tokens) - len(token_types))
    backend.add_special_tokens(
        [
            AddedToken(tok, normalized=False, special=True)
            for tok, kind in zip(tokens, kinds, strict=True)
            if kind in (TokenType.CONTROL, TokenType.UNKNOWN)
        ]
    )
    backend.add_tokens(
        [
            AddedToken(tok, normalized=False, special=False)
            for tok, kind in zip(tokens, kinds, strict=True)
            if kind == TokenType.USER_DEFINED
        ]
    )
    return backend

"""The engine's tokenizer as the grammar library sees it.

xgrammar matches grammars against the bytes each token stands for. Byte-level BPE
vocabularies (SmolLM2, Llama 3, Qwen 2) store tokens in GPT-2's printable alphabet and
SentencePiece ones use `▁` and `<0xNN>` byte tokens; the decoder of our `tokenizers`
backend says which. Special tokens are given as empty strings, which xgrammar never
allows inside a grammar: otherwise `<|im_start|>` could appear as literal text in a string.
"""

from __future__ import annotations

import xgrammar as xgr
from tokenizers import decoders

from servefleet.text.tokenizer import Tokenizer


def _vocab_type(tokenizer: Tokenizer) -> xgr.VocabType:
    decoder = tokenizer.backend.decoder
    if isinstance(decoder, decoders.ByteLevel):
        return xgr.VocabType.BYTE_LEVEL
    if isinstance(decoder, decoders.Sequence) and "ByteFallback" in repr(decoder):
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def xgrammar_tokenizer_info(tokenizer: Tokenizer) -> xgr.TokenizerInfo:
    special = set(tokenizer.backend.get_added_tokens_decoder())
    encoded = [
        "" if i in special else (tokenizer.id_to_token(i) or "")
        for i in range(tokenizer.vocab_size)
    ]
    return xgr.TokenizerInfo(
        encoded,
        _vocab_type(tokenizer),
        vocab_size=tokenizer.vocab_size,
        stop_token_ids=tokenizer.eos_token_ids,
        add_prefix_space=False,
    )

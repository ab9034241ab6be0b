"""Tokenizer built from the SmolLM2 GGUF vs transformers' tokenizer from the same file;
incremental detokenization; chat template rendering vs `apply_chat_template`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from servefleet.text.builtin import resolve_builtin
from servefleet.text.chat_template import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError
from servefleet.text.detokenizer import IncrementalDetokenizer
from servefleet.text.gguf_metadata import read_gguf_fields
from servefleet.text.tokenizer import Tokenizer
from servefleet.text.tokenizer_spec import TokenizerError, TokenizerSpec

TEXTS = [
    "Hello world!",
    "In 2024, 12345 apples cost $3.50 (or €3,20).",
    "  leading spaces\n\n\ttabs and trailing   ",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "日本語のテキストと中文字符 🤖🎉👩‍👩‍👧 emoji",
    "def f(x):\n    return x**2  # comment\n",
    "Ünïcödé façade naïve — “quotes” and ‘single’",
    "I'm you're they've WE'LL don't",
    "a\r\nb\rc\u00a0d",
    "https://example.com/path?q=1&r=two#frag",
    "   ",
    "",
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return resolve_builtin("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def fields(gguf_path: Path) -> Any:
    return read_gguf_fields(gguf_path)


@pytest.fixture(scope="module")
def ours(fields: Any) -> Tokenizer:
    return Tokenizer.from_gguf_fields(fields)


@pytest.fixture(scope="module")
def theirs(gguf_path: Path) -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(ours: Tokenizer, theirs: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)


def test_special_tokens_and_sizes(ours: Tokenizer, theirs: Any) -> None:
    assert ours.vocab_size == len(theirs) == 49152
    assert ours.bos_token_id == theirs.bos_token_id == 1
    assert ours.eos_token_ids == [theirs.eos_token_id] == [2]
    assert ours.id_to_token(2) == "<|im_end|>"
    assert ours.encode("<|im_end|>") == [2]
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi", add_special_tokens=False)


def test_round_trip_through_saved_files(ours: Tokenizer, tmp_path: Path) -> None:
    ours.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    for text in TEXTS:
        assert again.encode(text) == ours.encode(text)
    assert again.spec == ours.spec


def test_gguf_bos_is_added_when_the_file_asks(fields: Any) -> None:
    decoded = {key: field.contents() for key, field in fields.items() if key.startswith("tok")}
    decoded["tokenizer.ggml.add_bos_token"] = True
    with_bos = Tokenizer.from_gguf_fields(decoded)
    assert with_bos.encode("hi") == [1, *with_bos.encode("hi", add_special_tokens=False)]


def test_unsupported_gguf_tokenizer_kind_is_a_clear_error() -> None:
    with pytest.raises(TokenizerError, match="'bert' is not supported"):
        Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "bert"})
    with pytest.raises(TokenizerError, match=r"one tokenizer\.ggml\.scores entry per token"):
        Tokenizer.from_gguf_fields(
            {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]}
        )


_ = "\u2581"  # "▁", SentencePiece's space
SPM_PIECES = [
    _, "h", "e", "l", "o", "w", "r", "d", "t", "i", "s", "a", "n", _ + "h", "he", "ll", _ + "he",
    "llo", _ + "hello", _ + "w", "or", _ + "wor", "ld", _ + "world", _ + "hell", _ + "t",
    _ + "the", "is", _ + "is", "an", _ + "a", _ + "an", "in", _ + "in", _ + "i", "th", _ + "th",
    "ing", "ng", _ + "s", "st", _ + "st",
]  # fmt: skip
SPM_TEXTS = [
    "hello world", "the hello", "hello  world \u00e9", "he hell", "this is a test",
    "in the world, sing!", "hello</s>", "Ünïcödé 123 \u2014 end", "", "x\n\nhello\t",
]  # fmt: skip


def _spm_gguf(path: Any) -> Any:
    """A SentencePiece ('llama') GGUF: control tokens, 256 byte pieces, scored pieces."""
    gguf = pytest.importorskip("gguf")
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path))


def test_sentencepiece_gguf_matches_transformers(tmp_path: Path) -> None:
    """Llama 2 / Mistral GGUFs carry SentencePiece pieces and scores, not merges: our
    rebuilt tokenizer must split and join text exactly as transformers' GGUF loader does."""
    reader = _spm_gguf(tmp_path / "spm.gguf")
    ours = Tokenizer.from_gguf_fields(reader.fields)
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.encode("hello")[0] == 1 and ours.spec.eos_token_ids == [2]
    # Leading spaces: SentencePiece's dummy prefix (and llama.cpp) always adds one "▁";
    # transformers' converted tokenizer does not when the text starts with a space.
    # Text right after a special token gets the "▁" too, as in llama.cpp.
    space, x_byte = ours.token_to_id("\u2581"), ours.token_to_id("<0x78>")
    assert ours.encode("  x") == [1, space, space, space, x_byte]
    assert ours.encode("<s>hello") == [1, 1, ours.token_to_id("\u2581hello")]
    assert ours.decode(ours.encode("hello world \u00e9")) == "hello world \u00e9"
    again = tmp_path / "saved"
    again.mkdir()
    ours.save(again)
    assert Tokenizer.load(again).encode("this is a test") == ours.encode("this is a test")


def _stream(tokenizer: Tokenizer, text: str, prompt: str = "Say: ") -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt))
    deltas = [detok.feed(token) for token in tokenizer.encode(text)]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize(
    "text",
    ["日本語のテキスト 🤖🎉👩‍👩‍👧 done", "naïve café — ok", "plain ascii text", "中文字符🎉"],
)
def test_incremental_detokenizer_never_splits_characters(ours: Tokenizer, text: str) -> None:
    deltas = _stream(ours, text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # Where a character spans several byte-level tokens, those steps must emit nothing.
    split = any(
        "\ufffd" in tokenizer_piece
        for tokenizer_piece in map(ours.decode, ([t] for t in ours.encode(text)))
    )
    assert split == ("🤖" in text or "🎉" in text)
    if split:
        assert "" in deltas[:-1]


def test_incremental_detokenizer_skips_special_tokens(ours: Tokenizer) -> None:
    detok = IncrementalDetokenizer(ours)
    ids = ours.encode("<|im_start|>assistant\nHi!<|im_end|>")
    assert "".join(detok.feed(i) for i in ids) + detok.flush() == "assistant\nHi!"


def test_a_stream_that_ends_mid_character_is_flushed(ours: Tokenizer) -> None:
    """Cut off inside a character (max_tokens), the held-back bytes still come out, as a
    whole-text decode shows them."""
    ids = ours.encode("ok 🤖")
    assert ours.decode(ids[:-1]).endswith("\ufffd")  # the emoji spans several tokens
    detok = IncrementalDetokenizer(ours)
    streamed = "".join(detok.feed(i) for i in ids[:-1])
    assert streamed == "ok" and "\ufffd" not in streamed
    assert streamed + detok.flush() == ours.decode(ids[:-1])
    assert detok.flush() == ""


def test_sentencepiece_stream_keeps_leading_spaces_and_byte_fallback(tmp_path: Path) -> None:
    """The first generated token decodes with the prompt as context, so SentencePiece's
    leading "▁" becomes a space; byte-fallback pieces never show as half characters."""
    spm = Tokenizer.from_gguf_fields(_spm_gguf(tmp_path / "spm.gguf").fields)
    prompt = spm.encode("the")
    for text in ["hello world", "é \u2014 hello", "x\n\nhello"]:
        ids = spm.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(spm, prompt)
        deltas = [detok.feed(i) for i in ids] + [detok.flush()]
        whole = spm.decode(prompt + ids)[len(spm.decode(prompt)) :]
        assert whole.startswith(" ")
        assert "".join(deltas) == whole, text
        assert all("\ufffd" not in d for d in deltas)


def test_a_decoder_that_rewrites_earlier_text_restarts_the_stream() -> None:
    """`DecodeStream` refuses a step whose text does not extend the text already handed out;
    the stream starts again and the rest of the text still comes out."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    backend = HFTokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "?": 3}, unk_token="?"))
    backend.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "XYZ")])
    detok = IncrementalDetokenizer(Tokenizer(backend, TokenizerSpec()))
    assert [detok.feed(i) for i in (0, 1, 2)] == ["a", "b", "c"]
    assert detok.flush() == ""


CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Ünïcödé 🤖?"},
    ],
]


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    fields: Any,
    ours: Tokenizer,
    theirs: Any,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
) -> None:
    template = ChatTemplate(fields["tokenizer.chat_template"].contents(), ours.special_tokens_map())
    mine = template.render(messages, add_generation_prompt=add_generation_prompt)
    expected = theirs.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert mine == expected


def test_chatml_fallback_and_template_errors() -> None:
    rendered = ChatTemplate(None).render([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ChatTemplate(None).source == CHATML_TEMPLATE
    failing = ChatTemplate("{{ raise_exception('only user turns') }}")
    with pytest.raises(ChatTemplateError, match="only user turns"):
        failing.render([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        sandboxed.render([{"role": "user", "content": "x"}])


def test_template_helpers_like_transformers() -> None:
    template = ChatTemplate(
        "{{ tools | tojson }}|{{ strftime_now('%Y') | length }}|{{ bos_token }}",
        {"bos_token": "<s>"},
    )
    out = template.render([], tools=[{"name": "héllo", "x": "<b>"}])
    assert out == '[{"name": "héllo", "x": "<b>"}]|4|<s>'

"""Constrained decoding and tool calls without the model: parsers, prompts, deltas, masks."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from servefleet.api.openai_messages import ChatMessage
from servefleet.api.openai_requests import ChatCompletionRequest, Tool
from servefleet.engine.sampler import sample
from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.sequence import Sequence
from servefleet.engine.structured.constraint import (
    ConstraintError,
    ConstraintSpec,
    requested_constraint,
)
from servefleet.engine.structured.grammars import GrammarCache
from servefleet.engine.structured.tool_calls import ToolPlan, tool_constraint, tool_plan
from servefleet.engine.structured.tool_output import ToolCallStream, assistant_message
from servefleet.engine.structured.tool_parsers import (
    parse_hermes,
    parse_llama3_json,
    parser_for_template,
)
from servefleet.engine.structured.tool_prompt import template_inputs
from servefleet.text.chat_template import ChatTemplate
from servefleet.text.model_text import load_model_text
from servefleet.text.tokenizer import Tokenizer

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = (
    Tool.model_validate(
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    ),
    Tool.model_validate({"type": "function", "function": {"name": "get_time"}}),
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_model_text("smollm2-135m-instruct").tokenizer


@pytest.fixture(scope="module")
def cache(tokenizer: Tokenizer) -> GrammarCache:
    return GrammarCache(tokenizer)


# ---- parsers on canned model text ----------------------------------------------------------
def test_hermes_reads_calls_and_keeps_the_rest_as_content() -> None:
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": "{\\"timezone\\": \\"UTC\\"}"}</tool_call>'
    )
    parsed = parse_hermes(text)
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"timezone": "UTC"}),
    ]


def test_hermes_leaves_text_without_well_formed_calls_alone() -> None:
    assert parse_hermes("just text").calls == []
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    parsed = parse_hermes(broken)
    assert parsed.calls == [] and parsed.content == broken


def test_hermes_reads_a_call_cut_before_its_closing_tag() -> None:
    parsed = parse_hermes('<tool_call>{"name": "get_time", "arguments": {}}')
    assert [c.name for c in parsed.calls] == ["get_time"] and parsed.content is None


def test_llama3_json_reads_python_tag_and_several_calls() -> None:
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {}}'
    )
    parsed = parse_llama3_json(text)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert parse_llama3_json("The weather is fine.").calls == []
    assert parse_llama3_json('{"no_name": 1}').calls == []


def test_parser_follows_the_chat_template() -> None:
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template("<tool_call>{{ tools }}</tool_call>") == "hermes"
    assert parser_for_template(ChatTemplate(None).source) == "hermes"


# ---- what the template is given --------------------------------------------------------------
HISTORY = [
    ChatMessage.model_validate({"role": "user", "content": "Weather in Paris?"}),
    ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        }
    ),
    ChatMessage.model_validate({"role": "tool", "tool_call_id": "call_1", "content": "21 C"}),
]
TOOL_AWARE = (
    "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}call {{ c.function.name }} {{ c.function.arguments.city }}"
    "{% endfor %}{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}|{% endfor %}"
)


def test_a_template_that_knows_tools_gets_them_natively() -> None:
    messages, tools = template_inputs(HISTORY, TOOLS, TOOL_AWARE)
    rendered = ChatTemplate(TOOL_AWARE).render(messages, tools=tools)
    assert rendered == (
        "[get_weather][get_time]user:Weather in Paris?|assistant:call get_weather Paris|"
        "tool:21 C(call_1)|"
    )


def test_a_template_without_tools_gets_them_folded_into_messages() -> None:
    smollm = load_model_text("smollm2-135m-instruct").chat_template
    messages, tools = template_inputs(HISTORY, TOOLS, smollm.source)
    assert tools is None
    prompt = smollm.render(messages)
    assert prompt.startswith("<|im_start|>system\nYou may call one or more functions")
    assert '"name": "get_weather"' in prompt and '"name": "get_time"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<|im_start|>tool\n<tool_response>\n21 C\n</tool_response>" in prompt
    plain, _ = template_inputs(HISTORY[:1], None, smollm.source)
    assert plain == [{"role": "user", "content": "Weather in Paris?"}]


# ---- request -> plan and constraint ----------------------------------------------------------
def _request(**fields: Any) -> ChatCompletionRequest:
    tools = [t.model_dump(exclude_none=True) for t in TOOLS]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    return ChatCompletionRequest.model_validate({**body, **fields})


def test_tool_plans() -> None:
    assert tool_plan(_request()) == ToolPlan(mode="auto", tools=TOOLS)
    assert tool_plan(_request(tool_choice="none")) is None
    named = tool_plan(_request(tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert named is not None and (named.mode, named.function) == ("named", "get_time")
    with pytest.raises(ConstraintError):
        tool_plan(_request(tool_choice={"type": "function", "function": {"name": "nope"}}))


def test_required_constrains_to_an_array_of_known_calls() -> None:
    plan = tool_plan(_request(tool_choice="required"))
    assert plan is not None
    spec = tool_constraint(plan)
    assert spec is not None
    schema = json.loads(spec.value)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    names = [a["properties"]["name"]["enum"] for a in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    single = tool_plan(_request(tool_choice="required", parallel_tool_calls=False))
    assert single is not None
    spec = tool_constraint(single)
    assert spec is not None and json.loads(spec.value)["maxItems"] == 1
    auto = tool_plan(_request())
    assert auto is not None and tool_constraint(auto) is None


def test_response_format_and_guided_fields_become_constraints() -> None:
    schema = {"type": "object"}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert requested_constraint(_request(response_format=fmt)) == ConstraintSpec(
        kind="json_schema", value='{"type": "object"}'
    )
    assert requested_constraint(_request(response_format={"type": "text"})) is None
    spec = requested_constraint(_request(guided_choice=["a", "b"]))
    assert spec == ConstraintSpec(kind="choice", value='["a", "b"]', param="guided_choice")


# ---- whole answers and streams agree ---------------------------------------------------------
def _reassemble(deltas: list[dict[str, Any]]) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = None, {}
    for choice in deltas:
        delta = choice["delta"]
        if "content" in delta:
            content = (content or "") + delta["content"]
        for part in delta.get("tool_calls", []):
            call = calls.setdefault(part["index"], ["", ""])
            if "id" in part:
                assert part["type"] == "function" and part["id"].startswith("call_")
                call[0] = part["function"]["name"]
            call[1] += part["function"]["arguments"]
    return content, [tuple(c) for _, c in sorted(calls.items())]  # type: ignore[misc]


@pytest.mark.parametrize(
    ("plan", "pieces"),
    [
        (ToolPlan(mode="named", tools=TOOLS, function="get_weather"), ['{"city": ', '"Paris"}']),
        (
            ToolPlan(mode="required", tools=TOOLS),
            [
                '[{"name": "get_time", "parameters": {}}, ',
                '{"name": "get_weather", ',
                '"parameters": {"city": "A very long city name indeed, longer than a piece"}}]',
            ],
        ),
        (
            ToolPlan(mode="auto", tools=TOOLS),
            ["Sure.<tool_call>", '{"name": "get_time", "arguments": {}}', "</tool_call>"],
        ),
    ],
)
def test_stream_deltas_reassemble_to_the_whole_answer(plan: ToolPlan, pieces: list[str]) -> None:
    message, reason = assistant_message(plan, "hermes", "".join(pieces), "stop")
    stream = ToolCallStream(plan, "hermes")
    deltas: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        deltas += stream.choices(0, piece, i == len(pieces) - 1, "stop")
    assert reason == "tool_calls" and deltas[-1]["finish_reason"] == "tool_calls"
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert _reassemble(deltas) == (message["content"], whole)


def test_auto_without_calls_is_content_and_stop() -> None:
    plan = ToolPlan(mode="auto", tools=TOOLS)
    message, reason = assistant_message(plan, "hermes", "Hello there", "stop")
    assert message == {"role": "assistant", "content": "Hello there"} and reason == "stop"
    length = assistant_message(plan, "hermes", "<tool_call>{", "length")
    assert length[1] == "length" and "tool_calls" not in length[0]


# ---- grammars, masks and the sampler -------------------------------------------------------
def test_grammars_are_compiled_once_per_spec(cache: GrammarCache) -> None:
    spec = ConstraintSpec(kind="regex", value="[ab]{3}")
    assert cache.compile(spec) is cache.compile(ConstraintSpec(kind="regex", value="[ab]{3}"))
    with pytest.raises(ConstraintError) as err:
        cache.compile(ConstraintSpec(kind="json_schema", value="{not json", param="guided_json"))
    assert err.value.param == "guided_json"


def test_masks_touch_constrained_rows_only(cache: GrammarCache, tokenizer: Tokenizer) -> None:
    spec = ConstraintSpec(kind="choice", value='["yes", "no"]')
    seqs = [Sequence([1], SamplingParams(temperature=0.0), 0.0) for _ in range(4)]
    seqs[1].grammar = cache.matcher(spec)
    seqs[3].grammar = cache.matcher(spec)
    logits = torch.randn(4, tokenizer.vocab_size)
    before = logits.clone()
    result = sample(logits, seqs)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for row in (1, 3):
        allowed = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert 0 < len(allowed) < 10
        assert all(tokenizer.decode([t]) in ("yes", "no", "y", "n", "ye") for t in allowed)
        assert result.token_ids[row] in allowed


def test_a_finished_grammar_finishes_the_sequence_even_ignoring_eos(cache: GrammarCache) -> None:
    from servefleet.engine.kv_cache import KVCacheManager
    from servefleet.engine.scheduler import Scheduler, SchedulerConfig

    compiled = cache.compile(ConstraintSpec(kind="choice", value='["yes"]'))
    params = SamplingParams(max_tokens=50, ignore_eos=True, compiled_grammar=compiled)
    seq = Sequence([5, 6, 7], params, 0.0)
    assert seq.grammar is not None
    scheduler = Scheduler(SchedulerConfig(4, 64, 128), KVCacheManager(16, 16, True), [2])
    scheduler.add(seq)
    steps = 0
    while not seq.is_finished:
        out = scheduler.schedule()
        logits = torch.zeros(len(out.chunks), 49152)
        sampled = [c.seq for c in out.chunks if c.samples]
        tokens = sample(logits[: len(sampled)], sampled).token_ids
        scheduler.update(out, {s.seq_id: [t] for s, t in zip(sampled, tokens, strict=True)})
        steps += 1
        assert steps < 10
    assert seq.finish_reason is not None and seq.finish_reason.value == "stop"
    assert seq.output_token_ids[-1] == 2  # the grammar's stop token ends it

"""The OpenAI request bodies, one definition for the engine and the gateway.

Every field is either honoured or refused: an unknown field is a 400 naming it, a field we
know but do not serve (`suffix`, audio, legacy functions, ...) is a 400 saying so, and types
are strict (`"stream": "yes"` is an error, not a stream). The gateway validates with these
models and forwards the body unchanged; the engine turns them into its sampling parameters.
Vendor extensions we honour are listed once, in `VENDOR_EXTENSIONS`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from servefleet.api import request_caps as caps
from servefleet.api.cache_salt import MAX_CACHE_SALT_CHARS
from servefleet.api.kv_transfer import KVTransferParams
from servefleet.api.openai_messages import ChatMessage, StrictModel
from servefleet.api.seeds import SEED_MAX, SEED_MIN

# Fields outside OpenAI's API that we honour (vLLM's names and meanings).
VENDOR_EXTENSIONS: tuple[str, ...] = (
    "top_k",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "priority",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "cache_salt",
)

# OpenAI fields we know and refuse, with why: a 400 naming the field, never silence.
REFUSED_FIELDS: dict[str, str] = {
    "suffix": "insertion (fill-in-the-middle) is not supported",
    "best_of": "server-side best-of ranking is not supported; use n",
    "audio": "this model produces text only",
    "modalities": "this model produces text only",
    "functions": "legacy functions are not supported; send tools",
    "function_call": "legacy function_call is not supported; send tool_choice",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "store": "stored completions are not supported",
    "metadata": "stored completions are not supported",
    "service_tier": "service tiers are not supported; send priority",
    "reasoning_effort": "this model has no reasoning mode",
    "verbosity": "this model has no verbosity setting",
    "dimensions": "this model's embeddings have one size",
}

MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_STRINGS = 16

# A rank (lower runs first), bounded so no value can overflow or dominate an ordering.
Priority = (
    Annotated[int, Field(ge=-caps.PRIORITY_BOUND, le=caps.PRIORITY_BOUND)]
    | Literal["interactive", "batch"]
)


class _RefusesKnownFields(StrictModel):
    """Rejects any field of `REFUSED_FIELDS` a subclass declares, naming it."""

    @field_validator("*", mode="before")
    @classmethod
    def _refuse(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name or ""
        if name in REFUSED_FIELDS and value is not None:
            raise PydanticCustomError(
                "unsupported_field",
                "{field} is not supported by this server: {why}",
                {"field": name, "why": REFUSED_FIELDS[name]},
            )
        return value


class StreamOptions(StrictModel):
    include_usage: bool = False


# ---- structured outputs and tools (honoured by the engine's constrained decoding) --------
class JsonSchemaFormat(StrictModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @field_validator("schema_", mode="before")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        caps.check_schema(value)
        return value


class TextResponseFormat(StrictModel):
    type: Literal["text"]


class JsonObjectResponseFormat(StrictModel):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    TextResponseFormat | JsonObjectResponseFormat | JsonSchemaResponseFormat,
    Field(discriminator="type"),
]


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str = Field(min_length=1)


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# ---- generation requests -------------------------------------------------------------------
class SamplingRequest(_RefusesKnownFields):
    """What chat and text completions share."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)  # `servefleet.api.seeds`
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    n: int = Field(default=1, ge=1, le=16)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Priority = 0
    user: str | None = None  # an end-user id, as OpenAI takes it; it changes no output
    # prefixes are shared only between requests of one salt (`servefleet.api.cache_salt`)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    # internal to gateway and engine (`servefleet.api.stream_resume`): refused from tenants
    return_token_ids: bool = False
    resume_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    kv_transfer_params: KVTransferParams | None = None  # `servefleet.api.kv_transfer`
    # refused (see REFUSED_FIELDS)
    best_of: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop must be up to {MAX_STOP_STRINGS} non-empty strings")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for key, bias in value.items():
            if not key.isascii() or not key.isdigit() or len(key) > caps.MAX_TOKEN_ID_DIGITS:
                shown = key if len(key) <= 24 else key[:20] + "..."
                raise ValueError(f"logit_bias keys are token ids; {shown!r} is not one")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values lie in [-100, 100]; {key!r} has {bias}")
        return value

    @field_validator(
        "guided_json", "guided_choice", "guided_regex", "guided_grammar", mode="before"
    )
    @classmethod
    def _bounded_guide(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        if name == "guided_json":
            caps.check_schema(value)
        elif name == "guided_choice":
            caps.check_choices(value)
        elif name == "guided_regex":
            caps.check_text(value, caps.MAX_REGEX_BYTES, "regex")
        else:
            caps.check_text(value, caps.MAX_GRAMMAR_BYTES, "grammar")
        return value

    @model_validator(mode="after")
    def _one_guide(self) -> SamplingRequest:
        guides = [g for g in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                  if getattr(self, g) is not None]  # fmt: skip
        if len(guides) > 1:
            raise ValueError(f"send at most one of {', '.join(guides)}")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def token_bias(self) -> dict[int, float]:
        """logit_bias with int token ids (range-checked by the engine, which knows the vocab)."""
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    @property
    def wants_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # refused (see REFUSED_FIELDS)
    audio: Any = None
    modalities: Any = None
    functions: Any = None
    function_call: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None

    @field_validator("tools", mode="before")
    @classmethod
    def _bounded_tools(cls, value: Any) -> Any:
        caps.check_tools(value)
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


PromptInput = str | list[str] | list[int] | list[list[int]]


def _non_empty_input(value: Any, what: str) -> Any:
    if isinstance(value, list) and (not value or any(isinstance(v, list) and not v for v in value)):
        raise ValueError(f"{what} must not be empty")
    many = isinstance(value, list) and len(value) > caps.MAX_PROMPTS
    if many and not isinstance(value[0], int):  # token ids of one prompt are not prompts
        raise ValueError(f"{what} takes at most {caps.MAX_PROMPTS} items; got {len(value)}")
    return value


def input_items(value: PromptInput) -> list[str | list[int]]:
    """One prompt (text or token ids) per item of a prompt/input field."""
    if isinstance(value, str):
        return [value]
    if all(isinstance(x, int) for x in value):
        return [list(value)]  # type: ignore[arg-type]
    return list(value)  # type: ignore[arg-type]


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: Any = None  # refused

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        return _non_empty_input(value, "prompt")

    def prompts(self) -> list[str | list[int]]:
        return input_items(self.prompt)


# ---- other endpoints -------------------------------------------------------------------------
class EmbeddingRequest(_RefusesKnownFields):
    model: str = Field(min_length=1)
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    dimensions: Any = None  # refused

    @field_validator("input")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        return _non_empty_input(value, "input")

    def inputs(self) -> list[str | list[int]]:
        return input_items(self.input)


class TokenizeRequest(StrictModel):
    """vLLM's /tokenize: a prompt, or messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self


class DetokenizeRequest(StrictModel):
    """vLLM's /detokenize."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]

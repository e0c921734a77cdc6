"""OpenAI-compatible request bodies (pydantic), the parameters hy3c refuses, and the OpenAI error shape.

Fields OpenAI defines are validated (types and ranges: a bad value is a 400 naming the field, in one
line). vLLM's common extensions are accepted: top_k, min_p, repetition_penalty, stop_token_ids,
ignore_eos, chat_template_kwargs, prompt_logprobs. Prompts, stop lists, message contents and
logit_bias have their own validators, so that an error names the field itself (not a member of a
union) and never quotes the input back.

Parameters a client may send that hy3c does not implement — grammars, beam search,
… (`UNSUPPORTED`) — are refused with a 400 naming the parameter unless their value is the one that
changes nothing (`response_format: {"type": "text"}`, …): a client that asked
for JSON must not get free text. Bookkeeping fields clients send with every request (`IGNORED`) are
accepted without effect, as are fields nobody defines (as vLLM does; the server logs their names).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

MAX_STOP_CHARS = 256  # output is held back by the longest stop string's length
MAX_STOPS = 16
MAX_CHOICES = 1024  # prompts x n of one completions request
MAX_LOGPROBS = 20  # top logprobs per position, as OpenAI and vLLM's default
LOGIT_BIAS_LIMIT = 100.0  # |bias|, as OpenAI


def _invalid(message: str) -> PydanticCustomError:
    """A validation error whose message is exactly `message` (the API prefixes the field's name)."""
    return PydanticCustomError("invalid_value", message)


def _all_token_ids(values: list) -> bool:
    """Whether every value is a token id: an int, not a bool. Exactly `int` is what JSON's integers are;
    the set of the values' types is taken in C (0.84 ms for 32K ids, against 1.33 for `type(v) is int`
    per value and 3× that for `isinstance`), and a long prompt is checked on the event loop."""
    return set(map(type, values)) <= {int}


def _token_ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not _all_token_ids(value):
        raise _invalid("must be a list of integer token ids")
    return value


SCHEMA_CACHE_CHARS = 16 * 1024  # tool schemas up to this size are remembered once checked


def json_schema_problem(schema: dict[str, Any], text: str) -> str | None:
    """Why `schema` (`text`: its JSON) is not a valid JSON schema under its `$schema` draft (2020-12
    when it names none or one jsonschema does not know) — where, and the meta-schema's rule it breaks,
    never the input — or None. Small schemas are remembered: an agent sends the same tools every turn."""
    return _remembered_problem(text) if len(text) <= SCHEMA_CACHE_CHARS else _schema_problem(schema)


@functools.lru_cache(maxsize=256)
def _remembered_problem(text: str) -> str | None:
    return _schema_problem(json.loads(text))


def _schema_problem(schema: dict[str, Any]) -> str | None:
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import Draft202012Validator, validator_for

    if not isinstance(schema.get("$schema", ""), str):
        return "not a valid JSON schema (at $schema: not a meta-schema's URI)"
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        where = ".".join(str(part) for part in exc.absolute_path) or "its top level"
        return f"not a valid JSON schema (at {where}: the {exc.validator} rule)"
    except RecursionError:
        return "not a valid JSON schema (nested too deeply)"
    return None


def valid_unicode(text: str) -> bool:
    """False for a string holding a lone UTF-16 surrogate (JSON can carry one; UTF-8 cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _Body(BaseModel):
    """A request body: unknown fields are kept in `model_extra` (checked against UNSUPPORTED/IGNORED);
    NaN and infinities are refused wherever a number is expected. Numbers and flags are strict (as the
    prompt's token ids are): `true` is no count, `2.0` no integer, `"yes"` no boolean; an integer is a
    float."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = Field(False, strict=True)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text (nothing to do), any JSON object, or JSON of a schema."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of a JSON schema, a regular expression, a list of choices."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_: dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1)


class _Sampling(_Body):
    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, strict=True)
    top_p: float = Field(1.0, gt=0.0, le=1.0, strict=True)
    top_k: int = Field(0, ge=-1, strict=True)
    min_p: float = Field(0.0, ge=0.0, le=1.0, strict=True)
    n: int = Field(1, ge=1, le=16, strict=True)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63, strict=True)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, strict=True)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, strict=True)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0, strict=True)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    logit_bias: dict[int, float] = Field(default_factory=dict)
    ignore_eos: bool = Field(False, strict=True)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    # structured outputs (`hy3c.serve.agent.structured`): at most one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: list[str] | None = Field(None, min_length=1)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> list[str]:
        stops = [value] if isinstance(value, str) else [] if value is None else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _invalid("must be a string or a list of strings")
        if len(stops) > MAX_STOPS:
            raise _invalid(f"at most {MAX_STOPS} stop strings")
        if any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise _invalid(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        if not all(valid_unicode(stop) for stop in stops):
            raise _invalid("a stop string holds a lone UTF-16 surrogate (not valid Unicode)")
        return stops

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids(cls, value: Any) -> list[int]:
        return [] if value is None else _token_ids(value)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias(cls, value: Any) -> dict[int, float]:
        """OpenAI's token id (a decimal string) → bias in [-100, 100]; the ids are checked against the
        vocabulary by the API."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise _invalid("must be an object mapping token ids to biases")
        bias = {}
        for key, amount in value.items():
            if not isinstance(key, str) or not re.fullmatch(r"-?\d{1,18}", key):
                raise _invalid("keys must be token ids (decimal integers)")
            if (
                not isinstance(amount, int | float)
                or isinstance(amount, bool)
                or not math.isfinite(amount)
                or abs(amount) > LOGIT_BIAS_LIMIT
            ):
                raise _invalid(f"biases must be numbers in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
            bias[int(key)] = float(amount)
        return bias


class CompletionRequest(_Sampling):
    prompt: list[str | list[int]]  # one entry per prompt (see `_prompts`)
    # 0 only to score the prompt (echo / prompt_logprobs)
    max_tokens: int | None = Field(16, ge=0, strict=True)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    echo: bool = Field(False, strict=True)
    suffix: str | None = None
    best_of: int | None = Field(None, strict=True)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> list[str | list[int]]:
        """A prompt (text or token ids) or a list of prompts → the list of prompts."""
        if isinstance(value, str):
            return [value]
        shape = "must be a string, a list of token ids, or a list of strings or token-id lists"
        if not isinstance(value, list):
            raise _invalid(shape)
        if _all_token_ids(value):  # one prompt of token ids ([] is an empty prompt)
            return [value]
        if not all(isinstance(p, str) or (isinstance(p, list) and _all_token_ids(p)) for p in value):
            raise _invalid(shape)
        if len(value) > MAX_CHOICES:
            raise _invalid(f"at most {MAX_CHOICES} prompts per request")
        return value


class FunctionSpec(BaseModel):
    """A tool's function: OpenAI's name rule (letters, digits, _ and -, at most 64), a JSON-schema object
    of parameters."""

    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            try:
                text = json.dumps(value, sort_keys=True, allow_nan=False)
            except ValueError:  # NaN or an infinity
                raise _invalid("not a valid JSON schema (a number JSON cannot hold)") from None
            except RecursionError:
                raise _invalid("not a valid JSON schema (nested too deeply)") from None
            problem = json_schema_problem(value, text)
            if problem is not None:
                raise _invalid(problem)
        return value


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionSpec


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    arguments: str  # JSON text of an object, as OpenAI sends it


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class CalledFunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: CalledFunctionName


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None  # text parts are joined (see `_content`)
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call (Hy3's template orders results by position)
    reasoning_content: str | None = None  # an assistant's earlier reasoning (kept per the template)

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> str | None:
        """A string, null, or a list of text parts ({"type": "text", "text": ...}) joined into one."""
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in value
        ):
            return "".join(part["text"] for part in value)
        raise _invalid("must be a string or a list of text parts (images and audio are not supported)")

    def text(self) -> str:
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool = Field(False, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    add_generation_prompt: bool = Field(True, strict=True)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = Field(True, strict=True)
    # OpenAI's efforts map onto Hy3's three: none / minimal → no_think / low, medium → high
    reasoning_effort: Literal["none", "no_think", "minimal", "low", "medium", "high"] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        """As OpenAI: top_logprobs asks for nothing unless logprobs is true (a 400, not silence)."""
        if value is not None and not info.data.get("logprobs"):
            raise _invalid("needs logprobs: true")
        return value


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = Field(True, strict=True)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens", mode="before")
    @classmethod
    def _ids(cls, value: Any) -> list[int]:
        return _token_ids(value)


def _absent(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


def _one_of(*harmless: Any) -> Callable[[Any], bool]:
    return lambda value: _absent(value) or value in harmless


def _default_true(value: Any) -> bool:
    return value is None or value is True


# parameter → (whether its value changes nothing, what is missing); refused otherwise
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (_absent, "function calling"),
    "function_call": (_one_of("none", "auto"), "function calling"),
    "audio": (_absent, "audio output"),
    "modalities": (_one_of(["text"]), "output modalities other than text"),
    "prediction": (_absent, "predicted outputs"),
    "web_search_options": (_absent, "web search"),
    "verbosity": (_absent, "verbosity"),
    "guided_grammar": (_absent, "guided decoding"),
    "guided_decoding_backend": (_absent, "guided decoding"),
    "guided_whitespace_pattern": (_absent, "guided decoding"),
    "structural_tag": (_absent, "structured output"),
    "use_beam_search": (_absent, "beam search"),
    "length_penalty": (_one_of(1, 1.0), "beam search"),
    "min_tokens": (_one_of(0), "min_tokens"),
    "allowed_token_ids": (_absent, "allowed_token_ids"),
    "bad_words": (_absent, "bad_words"),
    "logits_processors": (_absent, "logits processors"),
    "truncate_prompt_tokens": (_absent, "prompt truncation"),
    "include_stop_str_in_output": (_absent, "include_stop_str_in_output"),
    "skip_special_tokens": (_default_true, "special tokens in the output"),
    "spaces_between_special_tokens": (_default_true, "spaces_between_special_tokens"),
    "continue_final_message": (_absent, "continue_final_message"),
    "documents": (_absent, "documents"),
    "chat_template": (_absent, "a request-supplied chat template"),
    "mm_processor_kwargs": (_absent, "multimodal input"),
    "prompt_embeds": (_absent, "prompt embeddings"),
    "return_tokens_as_token_ids": (_absent, "return_tokens_as_token_ids"),
    "priority": (_one_of(0), "request priorities"),
    "cache_salt": (_absent, "cache_salt (prefix-cache isolation)"),
    "kv_transfer_params": (_absent, "KV transfer"),
}
# chat only (a completions field of the same name is implemented)
UNSUPPORTED_IN_CHAT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "echo": (_absent, "echo in chat"),
}
# accepted without effect: bookkeeping that does not change the output (add_special_tokens: hy3c adds
# none to a prompt, chat templates write their own)
IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "request_id",
        "add_special_tokens",
    }
)


def unsupported_param(body: BaseModel, chat: bool) -> tuple[str, str] | None:
    """(parameter, what hy3c lacks) of the first parameter in `body` it must refuse, else None."""
    rules = {**UNSUPPORTED, **UNSUPPORTED_IN_CHAT} if chat else UNSUPPORTED
    for name, value in (body.model_extra or {}).items():
        rule = rules.get(name)
        if rule is not None and not rule[0](value):
            return name, rule[1]
    return None


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: int | None = None
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

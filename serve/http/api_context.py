"""What the HTTP routes share: the server's settings, the API error, and `ApiContext` — the engine and
tokenizer with the checks and conversions every route makes (model name, refused parameters, capacity,
token ids, sampling parameters, prompt limits, logprobs shapes, usage, SSE framing).

Every response is valid JSON whatever the request held: text taken from a request into a message is
escaped when it holds a lone UTF-16 surrogate (`printable`), logprobs are finite (`finite_logprob`:
-inf, a token the distribution rules out, becomes LOGPROB_FLOOR, as vLLM's -9999.0), and server-sent
events are serialized with allow_nan=False.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from fastapi import Request

from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.logs import log_event
from hy3c.serve.agent.chat_output import AgentOptions
from hy3c.serve.agent.markup import Hy3Markup
from hy3c.serve.agent.structured import STRUCTURED_ERROR, CompiledGrammar, GrammarError, Grammars, GrammarSpec
from hy3c.serve.engine.core import Engine, GenerationRequest, StepOutput
from hy3c.serve.engine.sampler import DEFAULT_TEMPERATURE, SamplingParams
from hy3c.serve.http.delivery import LoopSink, stream_outputs
from hy3c.serve.http.protocol import (
    IGNORED,
    UNSUPPORTED,
    UNSUPPORTED_IN_CHAT,
    unsupported_param,
    valid_unicode,
)

log = logging.getLogger("hy3c.api")

SYSTEM_ROLES = {"developer": "system"}
HY3_EFFORTS = ("no_think", "low", "high")
OPENAI_EFFORTS = {
    "none": "no_think",
    "no_think": "no_think",
    "minimal": "low",
    "low": "low",
    "medium": "high",
    "high": "high",
}
# what `Hy3Tokenizer.apply_chat_template` passes the template itself, besides add_generation_prompt
TEMPLATE_OWN_ARGUMENTS = ("messages", "bos_token", "eos_token")
LOGPROB_FLOOR = -9999.0  # what a -inf (or NaN) logprob is reported as: JSON has no infinities
MAX_QUOTED_CHARS = 200  # of a request's string quoted in an error message
# a text longer than this is tokenized on a worker thread: the tokenizer lets go of the GIL and the
# event loop keeps serving the other requests' streams (~1 ms of encoding per 1,000 tokens: a 68K-token
# prompt held the loop for ~70 ms)
OFF_LOOP_CHARS = 16_384


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_waiting: int = 1024


def printable(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """`text` safe to put into a UTF-8 JSON response: lone surrogates as `\\ud800` escapes, and at most
    `limit` characters (with '…' when cut)."""
    if not valid_unicode(text):
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + "…"


def finite_logprob(value: float) -> float:
    """A logprob JSON can carry: -inf and NaN become LOGPROB_FLOOR (a logprob is never above 0)."""
    return value if math.isfinite(value) else LOGPROB_FLOOR


class APIError(Exception):
    """A request the server refuses: answered with OpenAI's error JSON and this status (the message and
    the param are made `printable`, so building the answer cannot fail)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ) -> None:
        message = printable(message, limit=1000)
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param = None if param is None else printable(param)


@dataclass
class ApiContext:
    engine: Engine
    tokenizer: Hy3Tokenizer
    config: ServerConfig
    sinks: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)  # loop → its sink

    @cached_property
    def markup(self) -> Hy3Markup | None:
        """The tokenizer's reasoning and tool-call tags (None: not a Hy3 tokenizer)."""
        return Hy3Markup.of(self.tokenizer)

    @property
    def max_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise APIError(
                404,
                f"model '{printable(name)}' does not exist; this server serves '{self.config.model_name}'",
                "model",
                "not_found_error",
            )

    def check_params(self, body, chat: bool) -> None:
        """Refuse a parameter hy3c does not implement (400 naming it); log the names of fields nobody
        defines (accepted without effect, as vLLM does)."""
        refused = unsupported_param(body, chat)
        if refused is not None:
            name, missing = refused
            raise APIError(400, f"{name}: {missing} is not supported by this server", name)
        unknown = sorted(
            set(body.model_extra or {}) - IGNORED - UNSUPPORTED.keys() - UNSUPPORTED_IN_CHAT.keys()
        )
        if unknown:
            log_event(log, "request_fields_ignored", fields=",".join(ascii(name) for name in unknown))

    def check_capacity(self) -> None:
        engine = self.engine
        if not engine.alive:
            raise APIError(
                503, f"engine is not running ({engine.dead or 'stopped'})", kind="service_unavailable"
            )
        waiting = engine.num_requests()[1] + engine.num_submitted()
        if waiting >= self.config.max_waiting:
            raise APIError(
                503, "server overloaded: too many waiting requests, retry later", kind="service_unavailable"
            )

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """400 naming `param` unless every id lies in the model's vocabulary (any Python int compares:
        -1 and 2**70 are refused here, before a tokenizer call could overflow on them)."""
        vocab = self.vocab_size  # read once: a property per id took 4.7 ms of the loop for 32K ids
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            shown = str(bad) if abs(bad) < 10**20 else f"{str(bad)[:12]}… ({len(str(abs(bad)))} digits)"
            raise APIError(
                400, f"{param}: token id {shown} is not in the vocabulary [0, {self.vocab_size})", param
            )

    def prompt_ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """A prompt's token ids: text tokenized, ids checked against the vocabulary."""
        if isinstance(prompt, str):
            return self.encode(prompt, param)
        self.check_token_ids(prompt, param)
        return list(prompt)

    async def prompts_ids(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """`prompt_ids` of each prompt, off the loop when their texts are long together (`_off_loop`)."""
        chars = sum(len(p) for p in prompts if isinstance(p, str))
        return await _off_loop(chars, lambda: [self.prompt_ids(p) for p in prompts])

    async def encode_text(self, text: str, param: str) -> list[int]:
        """`encode`, off the loop for a long text (`_off_loop`)."""
        return await _off_loop(len(text), lambda: self.encode(text, param))

    def params_of(self, body) -> SamplingParams:
        """The body's sampling parameters (stop_token_ids and logit_bias ids checked)."""
        self.check_token_ids(body.stop_token_ids, "stop_token_ids")
        self.check_token_ids(list(body.logit_bias), "logit_bias")
        temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
        return SamplingParams(
            temperature=temperature,
            top_p=body.top_p,
            top_k=min(max(body.top_k, 0), self.vocab_size),
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            seed=body.seed,
            logit_bias=tuple(sorted(body.logit_bias.items())),
        )

    def make_requests(
        self,
        prompt_ids: list[int],
        body,
        base: SamplingParams,
        max_tokens: int | None,
        num_logprobs: int | None,
        prompt_logprobs: int | None = None,
        grammar: object | None = None,
    ) -> list[GenerationRequest]:
        """The body's `n` generation requests for a prompt (their output held to `grammar`, from
        `grammar_of`), after the prompt and length checks.
        `max_tokens` 0 scores the prompt only (the caller allows it only then); the prompt may then
        fill the whole context."""
        max_len = self.max_len
        if len(prompt_ids) == 0:
            raise APIError(400, "the prompt is empty", "prompt")
        longest = max_len if max_tokens == 0 else max_len - 1
        if len(prompt_ids) > longest:
            raise APIError(
                400,
                f"this model's maximum context length is {max_len} tokens; the prompt has {len(prompt_ids)}"
                " (no room for a completion)",
                "prompt",
            )
        if max_tokens is None:
            max_tokens = max_len - len(prompt_ids)
        if len(prompt_ids) + max_tokens > max_len:
            # the field the client sent: chat's max_completion_tokens takes the place of max_tokens
            field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
            raise APIError(
                400,
                f"this model's maximum context length is {max_len} tokens; the prompt has {len(prompt_ids)} "
                f"and {field} is {max_tokens}",
                field,
            )
        out = []
        for i in range(body.n):
            params = (
                base
                if base.seed is None or i == 0
                else SamplingParams(**{**base.__dict__, "seed": (base.seed + i) % 2**64})
            )
            out.append(
                GenerationRequest(
                    f"{uuid.uuid4().hex}",
                    list(prompt_ids),
                    params,
                    max_tokens,
                    list(body.stop),
                    list(body.stop_token_ids),
                    body.ignore_eos,
                    num_logprobs,
                    prompt_logprobs=prompt_logprobs,
                    grammar=grammar,
                )
            )
        return out

    @cached_property
    def grammars(self) -> Grammars:
        return Grammars(self.tokenizer, self.vocab_size)

    @staticmethod
    def settle_thinking(
        options: AgentOptions, forced: GrammarSpec | None, prompt: str, body
    ) -> tuple[AgentOptions, GrammarSpec | None]:
        """Reasoning is split off (and a forced tool grammar lets it run first) only when the rendered
        prompt ends inside a think block — not without a generation prompt or after an assistant turn.
        A response grammar then holds only what follows the reasoning (`grammar_of`'s `after`)."""
        if options.thinking and options.markup is not None and not prompt.endswith(options.markup.think_open):
            options = dataclasses.replace(options, thinking=False)
            if forced is not None:
                forced = GrammarSpec(forced.kind, {**forced.value, "thinking": False}, forced.param)
        return options, forced

    def grammar_of(self, body, forced: GrammarSpec | None = None, after: str | None = None):
        """The compiled grammar a request's output must follow (None: free text): from
        `forced` (tool_choice), `response_format` json_object / json_schema, `structured_outputs` or
        `guided_json` / `guided_regex` / `guided_choice` (routes call it on a worker thread: compiling
        can take a while); with `after` (the reasoning's end tag, reasoning on) a response grammar
        holds only what follows it. 400 naming the field for two of them at once, a grammar the
        library rejects, or a forced-acceptance server."""
        specs = []
        form = body.response_format
        if form is not None and form.type == "json_object":
            specs.append(GrammarSpec("json", {"type": "object"}, "response_format", after))
        elif form is not None and form.type == "json_schema":
            if form.json_schema is None:
                raise APIError(
                    400,
                    "response_format.json_schema: required for type json_schema",
                    "response_format.json_schema",
                )
            specs.append(
                GrammarSpec("json", form.json_schema.schema_, "response_format.json_schema.schema", after)
            )
        outputs = body.structured_outputs
        if outputs is not None:
            given = [
                GrammarSpec(kind, value, f"structured_outputs.{name}", after)
                for kind, name, value in (
                    ("json", "json", outputs.json_),
                    ("regex", "regex", outputs.regex),
                    ("choice", "choice", outputs.choice),
                )
                if value is not None
            ]
            if len(given) != 1:
                raise APIError(
                    400, "structured_outputs: give exactly one of json, regex, choice", "structured_outputs"
                )
            specs += given
        for kind, name in (("json", "guided_json"), ("regex", "guided_regex"), ("choice", "guided_choice")):
            if getattr(body, name) is not None:
                specs.append(GrammarSpec(kind, getattr(body, name), name, after))
        if forced is not None:
            specs.insert(0, forced)
        if not specs:
            return None
        if len(specs) > 1:
            raise APIError(
                400, f"{specs[1].param}: only one grammar per request (also {specs[0].param})", specs[1].param
            )
        if self.engine.forced_acceptance:
            raise APIError(
                400, f"{specs[0].param}: not with forced acceptance (a benchmark mode)", specs[0].param
            )
        try:
            return self.grammars.compile(specs[0])
        except GrammarError as exc:
            raise APIError(400, str(exc), exc.param) from None

    @staticmethod
    def failure(error: str, grammar: CompiledGrammar | None) -> APIError:
        """The error of a request that ended in error: a 400 naming the field when its grammar failed
        while generating (a limit llguidance meets only as the output grows), else a 500."""
        if grammar is not None and error.startswith(STRUCTURED_ERROR):
            return APIError(400, f"{grammar.param}: {error}", grammar.param)
        return APIError(500, error, kind="server_error")

    def run(self, requests: list[GenerationRequest], http: Request) -> AsyncIterator[tuple[int, StepOutput]]:
        """(choice index, output) of each request until all finish (`delivery.stream_outputs`)."""
        loop = asyncio.get_running_loop()
        sink = self.sinks.get(loop) or self.sinks.setdefault(loop, LoopSink(loop))
        return stream_outputs(self.engine, sink, requests, http)

    async def updates(
        self, requests: list[GenerationRequest], http: Request, finals: dict[int, StepOutput]
    ) -> AsyncIterator[tuple[int, StepOutput]]:
        """The outputs a stream sends — text, logprobs, an end or an error — as (choice index, output);
        each choice's final output is also kept in `finals`."""
        async for i, out in self.run(requests, http):
            if out.finished and not out.error:
                finals[i] = out
            if out.error or out.text or out.finished or out.logprobs or out.prompt_logprobs is not None:
                yield i, out

    def chat_token(self, token: int) -> dict:
        return {"token": self.tokenizer.token_text(token), "bytes": list(self.tokenizer.token_bytes(token))}

    def encode(self, text: str, param: str) -> list[int]:
        if not valid_unicode(text):
            raise APIError(400, f"{param} cannot be tokenized: it holds a lone UTF-16 surrogate", param)
        try:
            return self.tokenizer.encode(text)
        except Exception as exc:
            raise APIError(400, f"{param} cannot be tokenized: {exc}", param) from None

    def render_chat(
        self,
        messages,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any],
        tools: list[dict] | None = None,
        reasoning_effort: str | None = None,
    ) -> str:
        """The chat template applied; OpenAI's `developer` role is the system prompt, an assistant's
        earlier `tool_calls` go in with their arguments as objects and its `reasoning_content` as
        `reasoning_content`; `tools` and `reasoning_effort` (Hy3's: no_think, low or high) are template
        variables.

        `template_kwargs` (chat_template_kwargs) are further template variables (their
        `reasoning_effort` wins over the request's). As in vLLM, an `add_generation_prompt` among them
        overrides the request's (it must be a boolean); what the server passes itself
        (TEMPLATE_OWN_ARGUMENTS) cannot be replaced (400)."""
        kwargs = dict(template_kwargs)
        for name in TEMPLATE_OWN_ARGUMENTS:
            if name in kwargs:
                raise APIError(
                    400,
                    f"chat_template_kwargs.{name}: set by the server (the request's messages and the "
                    "tokenizer's special tokens), not a template argument",
                    f"chat_template_kwargs.{name}",
                )
        add = kwargs.pop("add_generation_prompt", add_generation_prompt)
        if not isinstance(add, bool):
            raise APIError(
                400,
                "chat_template_kwargs.add_generation_prompt must be a boolean",
                "chat_template_kwargs.add_generation_prompt",
            )
        if tools:
            kwargs.setdefault("tools", tools)
        if reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", reasoning_effort)
        turns = [self._turn(i, m) for i, m in enumerate(messages)]
        try:
            return self.tokenizer.apply_chat_template(turns, add, **kwargs)
        except Exception as exc:  # a template error names the problem (unknown role, missing template)
            raise APIError(400, str(exc), "messages") from None

    @staticmethod
    def _turn(index: int, message) -> dict[str, Any]:
        turn: dict[str, Any] = {
            "role": SYSTEM_ROLES.get(message.role, message.role),
            "content": message.text(),
        }
        if message.reasoning_content is not None:
            turn["reasoning_content"] = message.reasoning_content
        if message.tool_calls:
            calls = []
            for j, call in enumerate(message.tool_calls):
                param = f"messages[{index}].tool_calls[{j}].function.arguments"
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError:
                    raise APIError(400, f"{param}: not valid JSON", param) from None
                if not isinstance(arguments, dict):
                    raise APIError(400, f"{param}: must be a JSON object", param)
                calls.append(
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": arguments},
                    }
                )
            turn["tool_calls"] = calls
        return turn

    def agent_options(self, body) -> tuple[AgentOptions, list[dict] | None, str | None, GrammarSpec | None]:
        """What a chat request asks of its output (`AgentOptions`), the tools its prompt lists (None:
        none, or `tool_choice` none), its Hy3 reasoning effort (None: the template's default) and, for
        `tool_choice` required or a named function, the grammar that holds the output to those calls.
        400 naming the field for a `tool_choice` that names no function in `tools` and an effort Hy3
        does not have."""
        markup = self.markup
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
        choice = body.tool_choice
        if choice is not None and not isinstance(choice, str):
            names = [tool["function"]["name"] for tool in tools]
            if choice.function.name not in names:
                raise APIError(
                    400, f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice"
                )
        if choice is not None and choice != "none" and choice != "auto" and not tools:
            raise APIError(400, "tool_choice: needs tools", "tool_choice")
        if tools and markup is None:
            raise APIError(400, "tools: this model's tokenizer has no Hy3 tool-call markup", "tools")
        listed = tools if tools and choice != "none" else None
        effort = body.chat_template_kwargs.get("reasoning_effort")
        if effort is not None:
            if effort not in HY3_EFFORTS:
                raise APIError(
                    400,
                    "chat_template_kwargs.reasoning_effort must be no_think, low or high",
                    "chat_template_kwargs.reasoning_effort",
                )
        elif body.reasoning_effort is not None:
            effort = OPENAI_EFFORTS[body.reasoning_effort]
        end_ids = frozenset(
            i
            for t in ((markup.think_close, markup.tool_calls_open) if markup else ())
            if (i := self.tokenizer.token_to_id(t)) is not None
        )
        thinking = markup is not None and effort in ("low", "high")
        options = AgentOptions(
            markup,
            thinking=thinking,
            tools=listed,
            parallel_tool_calls=body.parallel_tool_calls,
            reasoning_end_ids=end_ids,
        )
        forced = None  # `required` / a named function: the output is held to tool calls by a grammar
        if listed and choice is not None and choice not in ("none", "auto"):
            functions = {
                tool["function"]["name"]: _call_arguments(tool["function"].get("parameters"))
                for tool in listed
                if choice == "required" or tool["function"]["name"] == choice.function.name
            }
            parallel = body.parallel_tool_calls and choice == "required"
            value = {"markup": markup, "functions": functions, "thinking": thinking, "parallel": parallel}
            forced = GrammarSpec("tool_calls", value, "tool_choice")
        return options, listed, effort, forced

    def token_logprobs(self, entries, offset: int) -> dict:
        """Completions-style logprobs of (token, logprob, top) entries — logprob and top None for the
        first prompt token of an echo; `text_offset` counts characters from `offset`."""
        tokens = [self.tokenizer.token_text(t) for t, _, _ in entries]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else finite_logprob(lp) for _, lp, _ in entries],
            "top_logprobs": [
                None if top is None else {self.tokenizer.token_text(t): finite_logprob(v) for t, v in top}
                for _, _, top in entries
            ],
            "text_offset": offsets,
        }

    @staticmethod
    def echo_entries(prompt_ids: list[int], scored, k: int) -> list[tuple[int, float | None, Any]]:
        """The prompt's tokens as completions-logprobs entries (first: no logprob), top-k of each."""
        return [(prompt_ids[0], None, None), *((t, lp, top[:k]) for t, lp, _rank, top in scored)]

    def prompt_logprobs(self, scored, k: int) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: None for the first token, then per position a dict token id →
        {logprob, rank, decoded_token} of the prompt's token and the position's top k."""
        out: list[dict | None] = [None]
        for token, lp, rank, top in scored:
            entry = {str(token): self._ranked(token, lp, rank)}
            for i, (t, v) in enumerate(top[:k]):
                entry.setdefault(str(t), self._ranked(t, v, i + 1))
            out.append(entry)
        return out

    def _ranked(self, token: int, logprob: float, rank: int) -> dict:
        return {
            "logprob": finite_logprob(logprob),
            "rank": rank,
            "decoded_token": self.tokenizer.token_text(token),
        }


async def _off_loop(chars: int, tokenize: Callable[[], Any]) -> Any:
    """`tokenize()` for texts of `chars` characters: on a worker thread past OFF_LOOP_CHARS (the
    tokenizer lets go of the GIL), else here, where a thread's hop would cost more than the work."""
    if chars <= OFF_LOOP_CHARS:
        return tokenize()
    return await asyncio.to_thread(tokenize)


def _call_arguments(parameters: Any) -> list[tuple[str, Any, bool]]:
    """(name, schema, required) of each argument a forced call may write, from a function's
    JSON-schema object: its properties in their order, then any required name it does not describe
    (schema None); none when it has neither."""
    if not isinstance(parameters, dict):
        return []
    properties = parameters.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = parameters.get("required")
    required = [name for name in required if isinstance(name, str)] if isinstance(required, list) else []
    arguments = [(name, schema, name in required) for name, schema in properties.items()]
    return arguments + [(name, None, True) for name in dict.fromkeys(required) if name not in properties]


def usage(outs: dict[int, StepOutput], n: int = 1) -> dict:
    """OpenAI's usage block from each choice's final output; choices i*n … i*n+n-1 share prompt i,
    whose tokens count once."""
    firsts = {}
    for i in sorted(outs):
        firsts.setdefault(i // n, outs[i])
    prompt = sum(o.prompt_tokens for o in firsts.values())
    completion = sum(o.completion_tokens for o in outs.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in firsts.values())},
    }


def sse(payload: dict) -> str:
    """One server-sent event carrying a JSON payload (a non-finite number is a bug: it raises)."""
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


def stream_event(
    object_type: str, response_id: str, created: int, model: str, choices: list[dict], **extra
) -> str:
    """One streamed chunk of a response (`object_type`: text_completion, chat.completion.chunk) as an SSE."""
    return sse(
        {
            "id": response_id,
            "object": object_type,
            "created": created,
            "model": model,
            "choices": choices,
            **extra,
        }
    )

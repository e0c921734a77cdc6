"""What the HTTP routes share: the server's settings, the API error, and `ApiContext` — the engine and
tokenizer with the checks and conversions every route makes (model name, capacity, sampling
parameters, prompt limits, logprobs shapes, usage, SSE framing)."""

from __future__ import annotations

import asyncio
import json
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from hy3c.serve.delivery import LoopSink, stream_outputs
from hy3c.serve.engine import Engine, GenerationRequest, StepOutput
from hy3c.serve.sampler import SamplingParams
from hy3c.tokenizer import Hy3Tokenizer

SYSTEM_ROLES = {"developer": "system"}


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_waiting: int = 1024
    default_temperature: float = 1.0


class APIError(Exception):
    """A request the server refuses: answered with OpenAI's error JSON and this status."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


@dataclass
class ApiContext:
    engine: Engine
    tokenizer: Hy3Tokenizer
    config: ServerConfig
    sinks: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)  # loop → its sink

    @property
    def max_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.runner.config.vocab_size

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise APIError(
                404,
                f"model '{name}' does not exist; this server serves '{self.config.model_name}'",
                "model",
                "not_found_error",
            )

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

    def params_of(self, body) -> SamplingParams:
        temperature = self.config.default_temperature if body.temperature is None else body.temperature
        return SamplingParams(
            temperature=temperature,
            top_p=body.top_p,
            top_k=min(max(body.top_k, 0), self.vocab_size),
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            seed=body.seed,
        )

    def make_requests(
        self, prompt_ids: list[int], body, max_tokens: int | None, num_logprobs: int | None
    ) -> list[GenerationRequest]:
        """The body's `n` generation requests for a prompt, after the prompt and length checks."""
        max_len = self.max_len
        if len(prompt_ids) == 0:
            raise APIError(400, "the prompt is empty", "prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise APIError(400, "prompt token ids must lie in the vocabulary", "prompt")
        if len(prompt_ids) >= max_len:
            raise APIError(
                400,
                f"this model's maximum context length is {max_len} tokens; the prompt has {len(prompt_ids)}"
                " (no room for a completion)",
                "prompt",
            )
        if max_tokens is None:
            max_tokens = max_len - len(prompt_ids)
        if len(prompt_ids) + max_tokens > max_len:
            raise APIError(
                400,
                f"this model's maximum context length is {max_len} tokens; the prompt has {len(prompt_ids)} "
                f"and max_tokens is {max_tokens}",
                "max_tokens",
            )
        base = self.params_of(body)
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
                )
            )
        return out

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
            if out.error or out.text or out.finished or out.logprobs:
                yield i, out

    def chat_token(self, token: int) -> dict:
        return {"token": self.tokenizer.token_text(token), "bytes": list(self.tokenizer.token_bytes(token))}

    def encode(self, text: str, param: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except Exception as exc:  # e.g. a lone UTF-16 surrogate
            raise APIError(400, f"{param} cannot be tokenized: {exc}", param) from None

    def render_chat(self, messages, add_generation_prompt: bool, **kwargs) -> str:
        """The chat template applied; OpenAI's `developer` role is the system prompt."""
        turns = [{"role": SYSTEM_ROLES.get(m.role, m.role), "content": m.text()} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(turns, add_generation_prompt, **kwargs)
        except Exception as exc:  # a template error names the problem (unknown role, missing template)
            raise APIError(400, str(exc), "messages") from None

    def token_logprobs(self, triples, offset: int) -> dict:
        """Completions-style logprobs; `text_offset` counts characters from `offset`."""
        tokens = [self.tokenizer.token_text(t) for t, _, _ in triples]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in triples],
            "top_logprobs": [{self.tokenizer.token_text(t): lp for t, lp in top} for _, _, top in triples],
            "text_offset": offsets,
        }


def usage(outs: dict[int, StepOutput]) -> dict:
    """OpenAI's usage block from each choice's final output."""
    finals = list(outs.values())
    prompt = finals[0].prompt_tokens if finals else 0
    completion = sum(o.completion_tokens for o in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": finals[0].cached_tokens if finals else 0},
    }


def sse(payload: dict) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


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

"""The OpenAI-compatible HTTP API (FastAPI) in front of the engine.

    app = build_app(engine, tokenizer, ServerConfig(model_name="hy3", api_key=None))

Routes: POST /v1/completions, POST /v1/chat/completions (streaming SSE with `stream_options.include_usage`
and `data: [DONE]`), GET /v1/models, GET /health, GET /metrics, POST /tokenize, POST /detokenize,
GET /version. Errors use OpenAI's JSON shape: 400 bad JSON / values / prompt too long, 401 bad API key,
404 unknown model, 413 body too large, 503 overloaded or engine dead. A client that disconnects has its
requests aborted (their KV pages are freed).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

import hy3c
from hy3c.serve.engine import Engine, GenerationRequest, StepOutput
from hy3c.serve.protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, error_body
from hy3c.serve.sampler import SamplingParams
from hy3c.tokenizer import Hy3Tokenizer

DISCONNECT_POLL_S = 0.25
SYSTEM_ROLES = {"developer": "system"}


class _LoopSink:
    """Delivers a step's outputs for many requests to their queues on one event loop: one thread-safe
    wake-up of the loop per engine step (not one per request: each is a syscall on the engine thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def __call__(self, items: list[tuple[_QueueEmit, StepOutput]]) -> None:
        self.loop.call_soon_threadsafe(_put_each, items)


class _QueueEmit:
    """The engine's `emit` for one request: puts its outputs on an asyncio queue of the server's loop."""

    def __init__(self, sink: _LoopSink, outputs: asyncio.Queue) -> None:
        self.batch_sink = sink
        self.outputs = outputs

    def __call__(self, out: StepOutput) -> None:
        self.batch_sink.loop.call_soon_threadsafe(self.outputs.put_nowait, out)


_DISCONNECTED = object()  # put on a request's queue when its client went away


async def _watch_disconnect(http: Request, outputs: asyncio.Queue) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    outputs.put_nowait(_DISCONNECTED)


def _put_each(items: list[tuple[_QueueEmit, StepOutput]]) -> None:
    for emit, out in items:
        emit.outputs.put_nowait(out)


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_waiting: int = 1024
    default_temperature: float = 1.0
    default_top_p: float = 1.0


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


OPEN_PATHS = ("/health", "/metrics", "/version")  # answered without the API key


class _Gate:
    """ASGI middleware in front of the app: 401 without the API key (when one is set; every path but
    OPEN_PATHS) and 413 for request bodies over the limit (by Content-Length, or counted while a
    streamed body is read). Plain ASGI, so the app still sees the client's disconnect."""

    def __init__(self, app, limit: int, api_key: str | None) -> None:
        self.app, self.limit = app, limit
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        if (
            self.expected is not None
            and scope["path"] not in OPEN_PATHS
            and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
        ):
            return await _send_error(send, 401, "invalid API key", "authentication_error")
        too_big = f"request body exceeds {self.limit} bytes"
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _send_error(send, 413, too_big)
        if length is not None:  # the server reads exactly Content-Length bytes
            return await self.app(scope, receive, send)
        parts, seen, more = [], 0, True  # streamed body: read it (up to the limit) before the app does
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            parts.append(message.get("body", b""))
            seen += len(parts[-1])
            if seen > self.limit:
                return await _send_error(send, 413, too_big)
            more = message.get("more_body", False)
        pending = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        return await self.app(scope, replay, send)


async def _send_error(send, status: int, message: str, kind: str = "invalid_request_error") -> None:
    body = json.dumps(error_body(message, kind, code=status)).encode()
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": body})


def build_app(engine: Engine, tokenizer: Hy3Tokenizer, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="hy3c", version=hy3c.__version__)
    max_len = engine.config.max_model_len
    sinks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop → its sink (one in practice)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.status), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        if first.get("type") == "json_invalid":
            message, param = "request body is not valid JSON", None
        else:
            param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
            message = (
                f"{param}: {first['msg']}"
                if param
                else "the request body must be a JSON object (send it with content-type: application/json)"
            )
        return JSONResponse(error_body(message, param=param, code=400), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException):
        return JSONResponse(error_body(str(exc.detail), code=exc.status_code), status_code=exc.status_code)

    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name:
            raise APIError(
                404,
                f"model '{name}' does not exist; this server serves '{config.model_name}'",
                "model",
                "not_found_error",
            )

    def check_capacity() -> None:
        if not engine.alive:
            raise APIError(
                503, f"engine is not running ({engine.dead or 'stopped'})", kind="service_unavailable"
            )
        waiting = engine.num_requests()[1] + engine.num_submitted()
        if waiting >= config.max_waiting:
            raise APIError(
                503, "server overloaded: too many waiting requests, retry later", kind="service_unavailable"
            )

    def params_of(body) -> SamplingParams:
        temperature = config.default_temperature if body.temperature is None else body.temperature
        return SamplingParams(
            temperature=temperature,
            top_p=body.top_p,
            top_k=min(max(body.top_k, 0), engine.runner.config.vocab_size),
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            seed=body.seed,
        )

    def make_requests(
        prompt_ids: list[int], body, max_tokens: int | None, num_logprobs: int | None
    ) -> list[GenerationRequest]:
        if len(prompt_ids) == 0:
            raise APIError(400, "the prompt is empty", "prompt")
        if any(not 0 <= t < engine.runner.config.vocab_size for t in prompt_ids):
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
        base = params_of(body)
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

    async def run(requests: list[GenerationRequest], http: Request) -> AsyncIterator[tuple[int, StepOutput]]:
        """Submit the requests; yield (choice index, output) until all finish; abort on disconnect."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        index_of = {r.request_id: i for i, r in enumerate(requests)}
        unfinished = set(index_of)
        sink = sinks.get(loop) or sinks.setdefault(loop, _LoopSink(loop))
        for r in requests:
            engine.submit(r, _QueueEmit(sink, outputs))
        # a side task polls for a client disconnect: waiting on the queue with a timeout instead would
        # cost a task and a timer per token (~14 µs of event-loop time each, with the GIL held)
        watcher = asyncio.create_task(_watch_disconnect(http, outputs))
        try:
            while unfinished:
                out = await outputs.get()
                if out is _DISCONNECTED:
                    return
                if out.finished:
                    unfinished.discard(out.request_id)
                yield index_of[out.request_id], out
        finally:
            watcher.cancel()
            for request_id in unfinished:
                engine.abort(request_id)

    def usage(outs: dict[int, StepOutput]) -> dict:
        finals = list(outs.values())
        prompt = finals[0].prompt_tokens if finals else 0
        completion = sum(o.completion_tokens for o in finals)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": finals[0].cached_tokens if finals else 0},
        }

    def chat_token(token: int) -> dict:
        return {"token": tokenizer.token_text(token), "bytes": list(tokenizer.token_bytes(token))}

    def encode(text: str, param: str) -> list[int]:
        try:
            return tokenizer.encode(text)
        except Exception as exc:  # e.g. a lone UTF-16 surrogate
            raise APIError(400, f"{param} cannot be tokenized: {exc}", param) from None

    def render_chat(messages, add_generation_prompt: bool, **kwargs) -> str:
        """The chat template applied; OpenAI's `developer` role is the system prompt."""
        turns = [{"role": SYSTEM_ROLES.get(m.role, m.role), "content": m.text()} for m in messages]
        try:
            return tokenizer.apply_chat_template(turns, add_generation_prompt, **kwargs)
        except Exception as exc:  # a template error names the problem (unknown role, missing template)
            raise APIError(400, str(exc), "messages") from None

    def token_logprobs(triples, offset: int) -> dict:
        """Completions-style logprobs; `text_offset` counts characters from `offset`."""
        tokens = [tokenizer.token_text(t) for t, _, _ in triples]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in triples],
            "top_logprobs": [{tokenizer.token_text(t): lp for t, lp in top} for _, _, top in triples],
            "text_offset": offsets,
        }

    # ---- completions ---------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of must equal n", "best_of")
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if len(prompts) != 1:
            raise APIError(
                400, "send one prompt per request (batches of prompts are not supported)", "prompt"
            )
        prompt = prompts[0]
        prompt_ids = encode(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
        prompt_text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
        check_capacity()
        requests = make_requests(prompt_ids, body, body.max_tokens, body.logprobs)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs_of(out: StepOutput, offset: int) -> dict | None:
            return None if body.logprobs is None else token_logprobs(out.logprobs, offset)

        first_offset = len(prompt_text) if body.echo else 0

        if body.stream:

            async def stream():
                finals: dict[int, StepOutput] = {}
                offsets = [first_offset] * body.n
                if body.echo:
                    for i in range(body.n):
                        yield _sse(
                            {
                                "id": rid,
                                "object": "text_completion",
                                "created": created,
                                "model": config.model_name,
                                "choices": [
                                    {"index": i, "text": prompt_text, "logprobs": None, "finish_reason": None}
                                ],
                            }
                        )
                async for i, out in run(requests, http):
                    if out.error:
                        yield _sse(error_body(out.error, "server_error", code=500))
                        continue
                    if out.finished:
                        finals[i] = out
                    if out.text or out.finished or out.logprobs:
                        lps = logprobs_of(out, offsets[i])
                        choice = {
                            "index": i,
                            "text": out.text,
                            "logprobs": lps,
                            "finish_reason": out.finish_reason,
                            "stop_reason": out.stop_reason,
                        }
                        offsets[i] += sum(len(token) for token in lps["tokens"]) if lps else 0
                        yield _sse(
                            {
                                "id": rid,
                                "object": "text_completion",
                                "created": created,
                                "model": config.model_name,
                                "choices": [choice],
                            }
                        )
                if body.stream_options and body.stream_options.include_usage:
                    yield _sse(
                        {
                            "id": rid,
                            "object": "text_completion",
                            "created": created,
                            "model": config.model_name,
                            "choices": [],
                            "usage": usage(finals),
                        }
                    )
                yield "data: [DONE]\n\n"

            return StreamingResponse(
                stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )

        texts = [prompt_text if body.echo else "" for _ in range(body.n)]
        lps: list[list[StepOutput]] = [[] for _ in range(body.n)]
        finals = {}
        async for i, out in run(requests, http):
            if out.error:
                raise APIError(500, out.error, kind="server_error")
            texts[i] += out.text
            if out.logprobs:
                lps[i].append(out)
            if out.finished:
                finals[i] = out
        if len(finals) < body.n:
            return JSONResponse(error_body("client disconnected", code=499), status_code=499)
        choices = []
        for i in range(body.n):
            merged = StepOutput("", logprobs=[lp for o in lps[i] for lp in o.logprobs])
            choices.append(
                {
                    "index": i,
                    "text": texts[i],
                    "logprobs": logprobs_of(merged, first_offset),
                    "finish_reason": finals[i].finish_reason,
                    "stop_reason": finals[i].stop_reason,
                }
            )
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": config.model_name,
            "choices": choices,
            "usage": usage(finals),
        }

    # ---- chat ----------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: Request):
        check_model(body.model)
        text = render_chat(body.messages, body.add_generation_prompt, **body.chat_template_kwargs)
        prompt_ids = encode(text, "messages")
        check_capacity()
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        requests = make_requests(
            prompt_ids, body, body.max_completion_tokens or body.max_tokens, num_logprobs
        )
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs_of(out: StepOutput) -> dict | None:
            if not body.logprobs:
                return None
            content = []
            for token, lp, top in out.logprobs:
                content.append(
                    {
                        **chat_token(token),
                        "logprob": lp,
                        "top_logprobs": [{**chat_token(t), "logprob": v} for t, v in top],
                    }
                )
            return {"content": content}

        def chunk(choices: list[dict], **extra) -> str:
            return _sse(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": config.model_name,
                    "choices": choices,
                    **extra,
                }
            )

        if body.stream:

            async def stream():
                finals: dict[int, StepOutput] = {}
                for i in range(body.n):
                    yield chunk(
                        [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                async for i, out in run(requests, http):
                    if out.error:
                        yield _sse(error_body(out.error, "server_error", code=500))
                        continue
                    if out.finished:
                        finals[i] = out
                    if out.text or out.finished or out.logprobs:
                        delta = {"content": out.text} if out.text else {}
                        yield chunk(
                            [
                                {
                                    "index": i,
                                    "delta": delta,
                                    "logprobs": logprobs_of(out),
                                    "finish_reason": out.finish_reason,
                                }
                            ]
                        )
                if body.stream_options and body.stream_options.include_usage:
                    yield chunk([], usage=usage(finals))
                yield "data: [DONE]\n\n"

            return StreamingResponse(
                stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )

        texts = ["" for _ in range(body.n)]
        lps: list[list] = [[] for _ in range(body.n)]
        finals = {}
        async for i, out in run(requests, http):
            if out.error:
                raise APIError(500, out.error, kind="server_error")
            texts[i] += out.text
            lps[i].extend(out.logprobs)
            if out.finished:
                finals[i] = out
        if len(finals) < body.n:
            return JSONResponse(error_body("client disconnected", code=499), status_code=499)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": texts[i]},
                "logprobs": logprobs_of(StepOutput("", logprobs=lps[i])),
                "finish_reason": finals[i].finish_reason,
                "stop_reason": finals[i].stop_reason,
            }
            for i in range(body.n)
        ]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": config.model_name,
            "choices": choices,
            "usage": usage(finals),
        }

    # ---- the rest ------------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "hy3c",
                    "root": config.model_name,
                    "max_model_len": max_len,
                }
            ],
        }

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse(
                error_body(
                    f"engine is not running ({engine.dead or 'stopped'})", "service_unavailable", code=503
                ),
                status_code=503,
            )
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": hy3c.__version__}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            engine.metrics.render(config.model_name), media_type="text/plain; version=0.0.4"
        )

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        text = (
            body.prompt if body.prompt is not None else render_chat(body.messages, body.add_generation_prompt)
        )
        tokens = encode(text, "prompt" if body.prompt is not None else "messages")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": max_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        if any(not 0 <= t < engine.runner.config.vocab_size for t in body.tokens):
            raise APIError(400, "token ids must lie in the vocabulary", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    return _Gate(app, config.max_request_bytes, config.api_key)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

"""POST /v1/completions: one prompt (text or token ids), `n` choices, echo, completions-style logprobs,
streaming as server-sent events."""

from __future__ import annotations

import functools
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hy3c.serve.api_context import ApiContext, APIError, sse, stream_event, usage
from hy3c.serve.engine import StepOutput
from hy3c.serve.protocol import CompletionRequest, error_body


def add_completions_route(app: FastAPI, ctx: ApiContext) -> None:
    model_name = ctx.config.model_name

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        ctx.check_model(body.model)
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
        prompt_ids = ctx.encode(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
        prompt_text = prompt if isinstance(prompt, str) else ctx.tokenizer.decode(prompt_ids)
        ctx.check_capacity()
        requests = ctx.make_requests(prompt_ids, body, body.max_tokens, body.logprobs)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs_of(out: StepOutput, offset: int) -> dict | None:
            return None if body.logprobs is None else ctx.token_logprobs(out.logprobs, offset)

        event = functools.partial(stream_event, "text_completion", rid, created, model_name)

        first_offset = len(prompt_text) if body.echo else 0

        if body.stream:

            async def stream():
                finals: dict[int, StepOutput] = {}
                offsets = [first_offset] * body.n
                if body.echo:
                    for i in range(body.n):
                        yield event(
                            [{"index": i, "text": prompt_text, "logprobs": None, "finish_reason": None}]
                        )
                async for i, out in ctx.updates(requests, http, finals):
                    if out.error:
                        yield sse(error_body(out.error, "server_error", code=500))
                        continue
                    lps = logprobs_of(out, offsets[i])
                    choice = {
                        "index": i,
                        "text": out.text,
                        "logprobs": lps,
                        "finish_reason": out.finish_reason,
                        "stop_reason": out.stop_reason,
                    }
                    offsets[i] += sum(len(token) for token in lps["tokens"]) if lps else 0
                    yield event([choice])
                if body.stream_options and body.stream_options.include_usage:
                    yield event([], usage=usage(finals))
                yield "data: [DONE]\n\n"

            return StreamingResponse(
                stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )

        texts = [prompt_text if body.echo else "" for _ in range(body.n)]
        lps: list[list[StepOutput]] = [[] for _ in range(body.n)]
        finals = {}
        async for i, out in ctx.run(requests, http):
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
            "model": model_name,
            "choices": choices,
            "usage": usage(finals),
        }

"""POST /v1/completions: one prompt or a list of them (text or token ids), `n` choices each — choice
index = prompt index * n + j, as OpenAI numbers them — echo, completions-style logprobs, vLLM's
prompt_logprobs, streaming as server-sent events.

With `echo` and `logprobs`, the logprobs cover the prompt's tokens too (the first one's is null, as
OpenAI and vLLM give it), so loglikelihood scoring (lm-evaluation-harness) works; `max_tokens: 0`
with echo or prompt_logprobs scores the prompt without generating. Prompt logprobs are those of the
raw model logits (no penalties, bias or temperature), as vLLM's.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hy3c.serve.engine.core import StepOutput
from hy3c.serve.http.api_context import ApiContext, APIError, sse, stream_event, usage
from hy3c.serve.http.protocol import MAX_CHOICES, CompletionRequest, error_body


def add_completions_route(app: FastAPI, ctx: ApiContext) -> None:
    model_name = ctx.config.model_name

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        ctx.check_model(body.model)
        ctx.check_params(body, chat=False)
        if body.suffix:
            raise APIError(400, "suffix: insertion (suffix) is not supported by this server", "suffix")
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of must equal n", "best_of")
        n = body.n
        if len(body.prompt) * n > MAX_CHOICES:
            raise APIError(400, f"n: at most {MAX_CHOICES} choices (prompts x n) per request", "n")
        if body.max_tokens == 0 and not body.echo and body.prompt_logprobs is None:
            raise APIError(
                400,
                "max_tokens: 0 only scores the prompt: send echo or prompt_logprobs with it",
                "max_tokens",
            )
        if body.stream and body.prompt_logprobs is not None:
            raise APIError(
                400,
                "prompt_logprobs: not available with stream (echo with logprobs streams them)",
                "prompt_logprobs",
            )
        prompts = await ctx.prompts_ids(body.prompt)
        echoes = [
            (prompt if isinstance(prompt, str) else ctx.tokenizer.decode(ids)) if body.echo else ""
            for prompt, ids in zip(body.prompt, prompts)
        ]
        echo_logprobs = body.echo and body.logprobs is not None
        asked = (body.prompt_logprobs, body.logprobs if echo_logprobs else None)
        prompt_k = max((k for k in asked if k is not None), default=None)
        params = ctx.params_of(body)
        ctx.check_capacity()
        grammar = await asyncio.to_thread(ctx.grammar_of, body)
        requests = [
            request
            for ids in prompts
            for request in ctx.make_requests(
                ids, body, params, body.max_tokens, body.logprobs, prompt_k, grammar
            )
        ]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def opening(i: int, scored: list | None, text: str, entries: list) -> tuple[str, list]:
            """A choice's first text and logprob entries: the echoed prompt (and its `scored` tokens'
            logprobs) before the generated part."""
            prompt = i // n
            if echo_logprobs:
                entries = ctx.echo_entries(prompts[prompt], scored or [], body.logprobs) + entries
            return echoes[prompt] + text, entries

        def logprobs_of(entries: list, offset: int) -> dict | None:
            return None if body.logprobs is None else ctx.token_logprobs(entries, offset)

        event = functools.partial(stream_event, "text_completion", rid, created, model_name)

        if body.stream:

            async def stream():
                finals: dict[int, StepOutput] = {}
                offsets = [0] * len(requests)
                opened = [False] * len(requests)
                async for i, out in ctx.updates(requests, http, finals):
                    if out.error:  # "abort": the shutdown's (`Engine.abort_all`), retry elsewhere
                        if out.finish_reason == "abort":
                            yield sse(error_body(out.error, "service_unavailable", code=503))
                        else:
                            failed = ctx.failure(out.error, grammar)
                            yield sse(error_body(failed.message, failed.kind, failed.param, failed.status))
                        continue
                    text, entries = out.text, list(out.logprobs)
                    if not opened[i]:
                        opened[i] = True
                        text, entries = opening(i, out.prompt_logprobs, text, entries)
                    lps = logprobs_of(entries, offsets[i])
                    choice = {
                        "index": i,
                        "text": text,
                        "logprobs": lps,
                        "finish_reason": out.finish_reason,
                        "stop_reason": out.stop_reason,
                    }
                    offsets[i] += sum(len(token) for token in lps["tokens"]) if lps else 0
                    yield event([choice])
                if body.stream_options and body.stream_options.include_usage:
                    yield event([], usage=usage(finals, n))
                yield "data: [DONE]\n\n"

            return StreamingResponse(
                stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )

        texts = ["" for _ in requests]
        entries: list[list] = [[] for _ in requests]
        scored: dict[int, list] = {}
        finals = {}
        async for i, out in ctx.run(requests, http):
            if out.error:
                raise ctx.failure(out.error, grammar)
            texts[i] += out.text
            entries[i].extend(out.logprobs)
            if out.prompt_logprobs is not None:
                scored[i] = out.prompt_logprobs
            if out.finished:
                finals[i] = out
        if len(finals) < len(requests):
            return JSONResponse(error_body("client disconnected", code=499), status_code=499)
        choices = []
        for i in range(len(requests)):
            final = finals[i]
            text, lp_entries = opening(i, scored.get(i), texts[i], entries[i])
            choice = {
                "index": i,
                "text": text,
                "logprobs": logprobs_of(lp_entries, 0),
                "finish_reason": final.finish_reason,
                "stop_reason": final.stop_reason,
            }
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = ctx.prompt_logprobs(scored.get(i, []), body.prompt_logprobs)
            choices.append(choice)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": choices,
            "usage": usage(finals, n),
        }

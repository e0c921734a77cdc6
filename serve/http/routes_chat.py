"""POST /v1/chat/completions: messages through the chat template, `n` choices, chat-style logprobs,
vLLM's prompt_logprobs (of the templated prompt, at the response's top level as vLLM puts them; not
with stream), streaming as server-sent chunks (a role delta first, then content deltas)."""

from __future__ import annotations

import functools
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hy3c.serve.engine.core import StepOutput
from hy3c.serve.http.api_context import ApiContext, APIError, finite_logprob, sse, stream_event, usage
from hy3c.serve.http.protocol import ChatRequest, error_body


def add_chat_route(app: FastAPI, ctx: ApiContext) -> None:
    model_name = ctx.config.model_name

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: Request):
        ctx.check_model(body.model)
        ctx.check_params(body, chat=True)
        if body.stream and body.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs: not available with stream", "prompt_logprobs")
        text = ctx.render_chat(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
        prompt_ids = ctx.encode(text, "messages")
        params = ctx.params_of(body)
        ctx.check_capacity()
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        requests = ctx.make_requests(
            prompt_ids,
            body,
            params,
            body.max_completion_tokens or body.max_tokens,
            num_logprobs,
            body.prompt_logprobs,
        )
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs_of(out: StepOutput) -> dict | None:
            if not body.logprobs:
                return None
            content = []
            for token, lp, top in out.logprobs:
                content.append(
                    {
                        **ctx.chat_token(token),
                        "logprob": finite_logprob(lp),
                        "top_logprobs": [{**ctx.chat_token(t), "logprob": finite_logprob(v)} for t, v in top],
                    }
                )
            return {"content": content}

        chunk = functools.partial(stream_event, "chat.completion.chunk", rid, created, model_name)

        if body.stream:

            async def stream():
                finals: dict[int, StepOutput] = {}
                for i in range(body.n):
                    role = {"role": "assistant", "content": ""}
                    yield chunk([{"index": i, "delta": role, "logprobs": None, "finish_reason": None}])
                async for i, out in ctx.updates(requests, http, finals):
                    if out.error:  # "abort": the shutdown's (`Engine.abort_all`), retry elsewhere
                        shutdown = out.finish_reason == "abort"
                        kind = "service_unavailable" if shutdown else "server_error"
                        yield sse(error_body(out.error, kind, code=503 if shutdown else 500))
                        continue
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
                    yield chunk([], usage=usage(finals, body.n))
                yield "data: [DONE]\n\n"

            return StreamingResponse(
                stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )

        texts = ["" for _ in range(body.n)]
        lps: list[list] = [[] for _ in range(body.n)]
        finals = {}
        scored: dict[int, list] = {}
        async for i, out in ctx.run(requests, http):
            if out.error:
                raise APIError(500, out.error, kind="server_error")
            texts[i] += out.text
            lps[i].extend(out.logprobs)
            if out.prompt_logprobs is not None:
                scored[i] = out.prompt_logprobs
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
        response = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model_name,
            "choices": choices,
            "usage": usage(finals, body.n),
        }
        if body.prompt_logprobs is not None:
            response["prompt_logprobs"] = ctx.prompt_logprobs(scored.get(0, []), body.prompt_logprobs)
        return response

"""POST /v1/chat/completions: messages (and `tools`, `reasoning_effort`) through the chat template, `n`
choices, chat-style logprobs, vLLM's prompt_logprobs (of the templated prompt, at the response's top
level as vLLM puts them; not with stream), streaming as server-sent chunks (a role delta first, then
reasoning_content, content and tool_calls deltas). Each choice's text goes through
`serve.agent.chat_output.ChoiceOutput`: reasoning split off, Hy3 tool calls parsed."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hy3c.serve.agent.chat_output import ChoiceOutput
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
        options, tools, effort, forced = ctx.agent_options(body)
        text = ctx.render_chat(
            body.messages, body.add_generation_prompt, body.chat_template_kwargs, tools, effort
        )
        options, forced = ctx.settle_thinking(options, forced, text, body)
        prompt_ids = await ctx.encode_text(text, "messages")
        params = ctx.params_of(body)
        ctx.check_capacity()
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        after = options.markup.think_close if options.thinking and options.markup is not None else None
        grammar = await asyncio.to_thread(ctx.grammar_of, body, forced, after)
        requests = ctx.make_requests(
            prompt_ids,
            body,
            params,
            body.max_completion_tokens or body.max_tokens,
            num_logprobs,
            body.prompt_logprobs,
            grammar,
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
        outputs = [ChoiceOutput(options) for _ in range(body.n)]

        def usage_of(finals: dict[int, StepOutput]) -> dict:
            counts = usage(finals, body.n)
            if options.thinking:
                counts["completion_tokens_details"] = {
                    "reasoning_tokens": sum(o.reasoning_tokens for o in outputs)
                }
            return counts

        if body.stream:

            async def stream():
                finals: dict[int, StepOutput] = {}
                for i in range(body.n):
                    role = {"role": "assistant", "content": ""}
                    yield chunk([{"index": i, "delta": role, "logprobs": None, "finish_reason": None}])
                async for i, out in ctx.updates(requests, http, finals):
                    if out.error:  # "abort": the shutdown's (`Engine.abort_all`), retry elsewhere
                        if out.finish_reason == "abort":
                            yield sse(error_body(out.error, "service_unavailable", code=503))
                        else:
                            failed = ctx.failure(out.error, grammar)
                            yield sse(error_body(failed.message, failed.kind, failed.param, failed.status))
                        continue
                    choice = outputs[i]
                    choice.count(out.token_ids)
                    deltas = choice.feed(out.text) if out.text else []
                    if out.finished:
                        deltas += choice.finish()
                    for k, delta in enumerate(deltas or [{}]):
                        last = k == max(len(deltas), 1) - 1
                        yield chunk(
                            [
                                {
                                    "index": i,
                                    "delta": delta,
                                    "logprobs": logprobs_of(out) if k == 0 else None,
                                    "finish_reason": choice.finish_reason(out.finish_reason)
                                    if last
                                    else None,
                                }
                            ]
                        )
                if body.stream_options and body.stream_options.include_usage:
                    yield chunk([], usage=usage_of(finals))
                yield "data: [DONE]\n\n"

            return StreamingResponse(
                stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )

        lps: list[list] = [[] for _ in range(body.n)]
        finals = {}
        scored: dict[int, list] = {}
        async for i, out in ctx.run(requests, http):
            if out.error:
                raise ctx.failure(out.error, grammar)
            outputs[i].count(out.token_ids)
            outputs[i].feed(out.text)
            lps[i].extend(out.logprobs)
            if out.prompt_logprobs is not None:
                scored[i] = out.prompt_logprobs
            if out.finished:
                outputs[i].finish()
                finals[i] = out
        if len(finals) < body.n:
            return JSONResponse(error_body("client disconnected", code=499), status_code=499)
        choices = [
            {
                "index": i,
                "message": outputs[i].message(),
                "logprobs": logprobs_of(StepOutput("", logprobs=lps[i])),
                "finish_reason": outputs[i].finish_reason(finals[i].finish_reason),
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
            "usage": usage_of(finals),
        }
        if body.prompt_logprobs is not None:
            response["prompt_logprobs"] = ctx.prompt_logprobs(scored.get(0, []), body.prompt_logprobs)
        return response

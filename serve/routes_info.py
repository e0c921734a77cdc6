"""The routes around generation: GET /v1/models, /health, /version, /metrics (Prometheus text), and
POST /tokenize, /detokenize."""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

import hy3c
from hy3c.serve.api_context import ApiContext, APIError
from hy3c.serve.protocol import DetokenizeRequest, TokenizeRequest, error_body


def add_info_routes(app: FastAPI, ctx: ApiContext) -> None:
    engine, model_name = ctx.engine, ctx.config.model_name

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "hy3c",
                    "root": model_name,
                    "max_model_len": ctx.max_len,
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
        return PlainTextResponse(engine.metrics.render(model_name), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        text = (
            body.prompt
            if body.prompt is not None
            else ctx.render_chat(body.messages, body.add_generation_prompt)
        )
        tokens = ctx.encode(text, "prompt" if body.prompt is not None else "messages")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ctx.check_model(body.model)
        if any(not 0 <= t < ctx.vocab_size for t in body.tokens):
            raise APIError(400, "token ids must lie in the vocabulary", "tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

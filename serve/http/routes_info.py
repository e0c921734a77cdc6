"""The routes around generation: GET /v1/models, /health, /version, /metrics (Prometheus text),
/tokenizer_info, and POST /tokenize, /detokenize."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

import hy3c
from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.serve.http.api_context import ApiContext, APIError
from hy3c.serve.http.protocol import DetokenizeRequest, TokenizeRequest, error_body

TOKENIZER_FILE_KEYS = ("vocab_file", "merges_file", "tokenizer_file")  # paths of the checkpoint's machine
ADDED_TOKEN_KEYS = {"__type", "lstrip", "rstrip", "single_word", "normalized", "special"}


def tokenizer_info(tokenizer: Hy3Tokenizer, artifact: Path | None, max_model_len: int) -> dict[str, Any]:
    """vLLM's GET /tokenizer_info: the tokenizer's configuration as Hugging Face loads it — the keys of
    the artifact's tokenizer_config.json (file paths left out, added tokens as their text) — with
    `tokenizer_class`, `chat_template`, the special tokens and `model_max_length` always present.
    Clients that tokenize and render chats themselves (lm-evaluation-harness's remote tokenizer) read
    `bos_token`, `eos_token`, `pad_token` and `chat_template` from it."""
    config: dict[str, Any] = {}
    file = artifact / "tokenizer_config.json" if artifact is not None else None
    if file is not None and file.is_file():
        try:
            loaded = json.loads(file.read_text())
        except (OSError, ValueError):
            loaded = None
        config = loaded if isinstance(loaded, dict) else {}
    for key in TOKENIZER_FILE_KEYS:
        config.pop(key, None)
    added = tokenizer.tokenizer.get_added_tokens_decoder()
    config["added_tokens_decoder"] = {str(i): token.content for i, token in sorted(added.items())}
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config.setdefault("bos_token", tokenizer.bos_token)
    config.setdefault("eos_token", tokenizer.eos_token)
    config.setdefault("pad_token", None)
    config.setdefault("model_max_length", max_model_len)
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    return _json_safe(config)


def _json_safe(value: Any) -> Any:
    """Special-token objects ({"content": ..., "lstrip": ...}) as their text, non-finite numbers as
    null (what vLLM makes of Hugging Face's AddedToken objects; JSON has no NaN)."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str) and ADDED_TOKEN_KEYS & value.keys():
            return value["content"]
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def add_info_routes(app: FastAPI, ctx: ApiContext) -> None:
    engine, model_name = ctx.engine, ctx.config.model_name
    info = tokenizer_info(ctx.tokenizer, engine.model_path, ctx.max_len)

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
        text = await asyncio.to_thread(engine.metrics.render, model_name)  # another process may render it
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/tokenizer_info")
    async def get_tokenizer_info():
        return info

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        text = (
            body.prompt
            if body.prompt is not None
            else ctx.render_chat(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
        )
        tokens = await ctx.encode_text(text, "prompt" if body.prompt is not None else "messages")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ctx.check_model(body.model)
        ctx.check_token_ids(body.tokens, "tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

"""The OpenAI-compatible HTTP API (FastAPI) in front of the engine.

    app = build_app(engine, tokenizer, ServerConfig(model_name="hy3", api_key=None))

Routes: POST /v1/completions (`routes_completions`), POST /v1/chat/completions (`routes_chat`; both
stream SSE with `stream_options.include_usage` and `data: [DONE]`), GET /v1/models, GET /health,
GET /metrics, POST /tokenize, POST /detokenize, GET /version (`routes_info`). Errors use OpenAI's JSON
shape: 400 bad JSON / values / prompt too long, 401 bad API key, 404 unknown model, 408 body too slow,
413 body too large (`http_gate`), 503 overloaded, engine dead or shutting down. A client that
disconnects has its requests aborted (their KV pages are freed; `delivery`).
"""

from __future__ import annotations

import threading

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

import hy3c
from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.serve.engine.core import Engine
from hy3c.serve.http.api_context import ApiContext, APIError, ServerConfig
from hy3c.serve.http.http_gate import HttpLimits, RequestGate
from hy3c.serve.http.protocol import error_body
from hy3c.serve.http.routes_chat import add_chat_route
from hy3c.serve.http.routes_completions import add_completions_route
from hy3c.serve.http.routes_info import add_info_routes

__all__ = ["ServerConfig", "build_app"]


def build_app(
    engine: Engine, tokenizer: Hy3Tokenizer, config: ServerConfig, limits: HttpLimits | None = None
) -> RequestGate:
    """The routes over one engine, behind the gate (API key, request size and body time limits,
    shutdown, access log; an ASGI app)."""
    app = FastAPI(title="hy3c", version=hy3c.__version__)
    _add_error_handlers(app)
    ctx = ApiContext(engine, tokenizer, config)
    # the grammar library's token table (about a second at Hy3's vocabulary) is built off the event
    # loop now, not by the first structured-output request
    threading.Thread(target=ctx.grammars.warm, name="hy3c-grammar-table", daemon=True).start()
    add_completions_route(app, ctx)
    add_chat_route(app, ctx)
    add_info_routes(app, ctx)
    body_timeout = (limits or HttpLimits()).body_timeout
    return RequestGate(app, config.max_request_bytes, config.api_key, body_timeout)


# pydantic's errors for a body that is absent or not an object; FastAPI's detail for one it could not decode
_NOT_AN_OBJECT = ("missing", "model_type", "model_attributes_type", "dict_type")
_FASTAPI_BODY_ERROR = "There was an error parsing the body"


def _add_error_handlers(app: FastAPI) -> None:
    """Refusals, validation failures and HTTP errors as OpenAI error JSON (400 names the bad field)."""

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
            if param:
                message = f"{param}: {first['msg']}"
            elif first.get("type") == "string_unicode":  # the only string without a field: a key
                message = "a field name of the request body is not valid Unicode (a lone surrogate)"
            elif first.get("type") in _NOT_AN_OBJECT:
                message = (
                    "the request body must be a JSON object (send it with content-type: application/json)"
                )
            else:
                message = f"request body: {first['msg']}"
        return JSONResponse(error_body(message, param=param, code=400), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException):
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == _FASTAPI_BODY_ERROR:  # bytes json.loads cannot take
            detail = "request body is not valid JSON (UTF-8 text; integers of at most 4300 digits)"
        return JSONResponse(error_body(detail, code=exc.status_code), status_code=exc.status_code)

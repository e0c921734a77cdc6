"""`hy3c.serve.http` (the folder `serve/http/`): the OpenAI-compatible HTTP layer over the serving engine
(`hy3c.serve.engine`), and `hy3c serve` itself.

* `server` — `hy3c serve`: bind the port, load the artifact, size the KV cache, build the engine;
* `api` — the FastAPI app; `api_context` — what the routes share (checks, sampling parameters, usage);
  `routes_completions`, `routes_chat`, `routes_info` — the routes; `protocol` — the request bodies;
* `http_gate` — API key, size limits and timeouts in front of the app; `lifecycle` — uvicorn and the
  drain on SIGTERM; `delivery` — engine outputs to the event loop;
* `demo` — `hy3c demo` and the tests' `BackgroundServer`; `bench_client` — `hy3c bench serve`, the load
  generator that speaks this API (vLLM's `bench serve`).

The engine never imports this package.
"""

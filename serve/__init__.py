"""`hy3c.serve` (the top-level folder `serve/`, mapped into the `hy3c` namespace): the serving runtime —
the engine loop, scheduler, KV pages, sampler, detokenizer and metrics — and the OpenAI-compatible HTTP
API in front of it."""

"""`hy3c.serve.engine` (the folder `serve/engine/`): the serving runtime apart from HTTP — what `hy3c serve`
and `hy3c generate` both run.

* `core` — the engine loop (`Engine`): requests in, one model step at a time, outputs out; on an engine
  thread for the server, on the caller's thread for `offline.generate`;
* `scheduler` — continuous batching, chunked prefill, prefix reuse, preemption; owns sequence state;
* `kv_pages` — the KV page pool and its prefix cache (chained page hashes, LRU eviction);
* `sampler` — sampling parameters, penalties, the reference sampler and the fused-kernel dispatch;
* `detokenizer` — incremental UTF-8-safe detokenization and stop strings;
* `metrics` — the Prometheus metrics, with vLLM's names; `kernel_builds` — Triton builds while serving;
* `offline` — `hy3c generate`: the engine driven to the end without HTTP.

It imports nothing of the HTTP layer (`hy3c.serve.http`), which sits on it.
"""

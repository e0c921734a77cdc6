"""`hy3c.serve` (the top-level folder `serve/`, mapped into the `hy3c` namespace): serving, in two rooms —
`hy3c.serve.engine` (`serve/engine/`), the runtime: engine loop, scheduler, KV pages, sampler,
detokenizer, metrics and offline generation; and `hy3c.serve.http` (`serve/http/`), the OpenAI-compatible
HTTP layer in front of it. The HTTP layer imports the engine, never the reverse."""

"""`hy3c.runtime`: running a compiled program — loading an artifact's weights into a `Runner`
(`artifact`), the runner itself (eager or through torch.compile, `runner`) and its captured decode
steps (`cuda_graphs`). The serving engine (`hy3c.serve.engine`) drives it."""

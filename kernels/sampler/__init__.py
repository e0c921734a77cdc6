"""`hy3c.kernels.sampler`: the fused token sampler (`fused_sampler`), the Triton provider of `hy3.sample`
(`hy3c.ops.sample`): temperature, min-p, top-k, top-p and a Gumbel-max draw in two launches over the
logits."""

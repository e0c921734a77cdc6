"""The weight plan: weights the packager derives from checkpoint tensors instead of copying them.

Passes that retype or add parameters record here, in `gm.meta["hy3c.weight_plan"]`, how each new
weight is produced (weights are data: the graph holds meta tensors, the packager fills them):

    {"kind": "fp8", "scale": scale fqn, "granularity": "tensor" | "channel"}   this weight → e4m3 + scale
    {"kind": "router_split", "source": fp32 weight fqn, "lo": lo fqn}          W → W_hi (this) and W_lo
"""

from __future__ import annotations

from torch import fx

WEIGHT_PLAN = "hy3c.weight_plan"


def weight_plan(gm: fx.GraphModule) -> dict[str, dict[str, str]]:
    return gm.meta.setdefault(WEIGHT_PLAN, {})

"""The shard plan: how each rank's copy of a parameter is cut from the whole tensor.

Sharding passes shrink parameters to one rank's shape (meta tensors) and record here, in
`gm.meta["hy3c.shard_plan"]`, how the packager cuts every rank's slice from the full tensor (sharding is
data: the graph is the same program on every rank, only the weights differ):

    {"kind": "split", "global_shape": [...], "dim": d, "parts": n, "chunks": c, "group": g}
        dim d is c equal chunks (gate | up: c = 2), each cut into n equal parts; the rank with index p
        in group g gets part p of every chunk, concatenated
    {"kind": "heads", "global_shape": [...], "heads": hq, "kv_heads": hkv, "head_dim": d, "parts": n,
     "group": g}
        rows [q | k | v] of a packed projection (or its per-row scale): q heads split n ways, kv heads
        split n ways, or each kv head replicated on n / hkv consecutive ranks when n > hkv

Parameters absent from the plan are replicated. A parameter that a later pass derives from a planned one
(an FP8 scale) is cut by `derived_spec`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from hy3c.recipe import local_kv_heads

SHARD_PLAN = "hy3c.shard_plan"


def shard_plan(gm: fx.GraphModule) -> dict[str, dict[str, Any]]:
    return gm.meta.setdefault(SHARD_PLAN, {})


def local_shape(spec: dict[str, Any]) -> list[int]:
    shape = list(spec["global_shape"])
    if spec["kind"] == "split":
        shape[spec["dim"]] //= spec["parts"]
    else:
        n, d = spec["parts"], spec["head_dim"]
        shape[0] = (spec["heads"] // n + 2 * local_kv_heads(spec["kv_heads"], n)) * d
    return shape


def cut(tensor: torch.Tensor, spec: dict[str, Any], index: int) -> torch.Tensor:
    """The slice of the full `tensor` that the rank with index `index` in the spec's group holds."""
    if spec["kind"] == "split":
        dim, parts = spec["dim"], spec["parts"]
        chunks = tensor.chunk(spec["chunks"], dim)
        return torch.cat([c.chunk(parts, dim)[index] for c in chunks], dim).contiguous()
    n, d = spec["parts"], spec["head_dim"]
    hq, hkv = spec["heads"], spec["kv_heads"]
    q, k, v = tensor.split([hq * d, hkv * d, hkv * d], 0)
    local_q = hq // n
    local_kv = local_kv_heads(hkv, n)
    first_kv = index * local_kv if n <= hkv else index // (n // hkv)
    rows = slice(first_kv * d, (first_kv + local_kv) * d)
    return torch.cat([q[index * local_q * d : (index + 1) * local_q * d], k[rows], v[rows]]).contiguous()


def derived_spec(source: dict[str, Any], derived_shape: list[int]) -> dict[str, Any] | None:
    """The spec of a tensor derived from a planned one (its FP8 scale: [out] or [E, out] per channel,
    [1] or [E, 1] per tensor): cut the same way along the dims they share, replicated otherwise."""
    global_shape = list(source["global_shape"])
    if source["kind"] == "heads":
        return (
            {**source, "global_shape": [global_shape[0]]} if derived_shape[:1] == global_shape[:1] else None
        )
    dim = source["dim"]
    if dim < len(derived_shape) and derived_shape[dim] == global_shape[dim]:
        return {**source, "global_shape": derived_shape}
    return None

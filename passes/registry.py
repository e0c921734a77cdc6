"""Pass registry: name → pass class. Pass modules register themselves with `@register_pass`."""

from __future__ import annotations

from hy3c.passes.base import Pass

PASS_REGISTRY: dict[str, type[Pass]] = {}


def register_pass(cls: type[Pass]) -> type[Pass]:
    if cls.name in PASS_REGISTRY:
        raise ValueError(f"pass {cls.name!r} registered twice")
    PASS_REGISTRY[cls.name] = cls
    return cls


def _load_builtin_passes() -> None:
    from hy3c.passes import (  # noqa: F401
        cleanup,
        fuse_act_quant,
        fuse_add_rms_norm,
        fuse_moe,
        fuse_moe_input_quant,
        fuse_norm_quant,
        fuse_qknorm_rope_kv,
        lower,
        plan_attention,
        quantize,
    )


_load_builtin_passes()

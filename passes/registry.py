"""Pass registry: name → pass class. Pass modules register themselves with `@register_pass`."""

from __future__ import annotations

from pydantic import ValidationError

from hy3c.passes.base import Pass
from hy3c.recipe import Recipe, RecipeError, describe_errors

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
        fuse_allgather_gemm,
        fuse_allreduce_add_rms_norm,
        fuse_gemm_reduce_scatter,
        fuse_moe,
        fuse_moe_input_quant,
        fuse_norm_quant,
        fuse_qknorm_rope_kv,
        lower,
        plan_attention,
        quantize,
        shard_ep,
        shard_sp,
        shard_tp,
    )


_load_builtin_passes()


def check_recipe_passes(recipe: Recipe, source: str | None = None) -> None:
    """Every pass of the recipe exists, its config validates, and the passes are in stage order;
    RecipeError naming the pass otherwise (`source` labels the message, by default the recipe's name)."""
    source = source or f"recipe '{recipe.name}'"
    for spec in recipe.passes:
        cls = PASS_REGISTRY.get(spec.name)
        if cls is None:
            raise RecipeError(
                f"{source}: unknown pass '{spec.name}'; known passes: {', '.join(sorted(PASS_REGISTRY))}"
            )
        try:
            cls.Config.model_validate(spec.config)
        except ValidationError as exc:
            raise RecipeError(
                f"{source}: invalid config of pass '{spec.name}': " + "; ".join(describe_errors(exc))
            ) from None
    previous = None
    for spec in recipe.passes:  # a pass may rely on every earlier stage having run (e.g. lower on fusion)
        stage = PASS_REGISTRY[spec.name].stage
        if spec.enabled and previous is not None and stage < previous[1]:
            raise RecipeError(
                f"{source}: pass '{spec.name}' ({stage.name} stage) comes after '{previous[0]}' "
                f"({previous[1].name} stage); passes run in stage order "
                "CANONICALIZE, SHARD, QUANT, FUSE, LOWER, CLEANUP"
            )
        if spec.enabled:
            previous = (spec.name, stage)

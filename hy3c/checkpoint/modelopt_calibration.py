"""Static FP8 scales calibrated by NVIDIA ModelOpt (`pip install -e ".[quant]"`).

    stats = quantize_block(layer, "layers.3", run)   # the keys and meaning of fp8_convert.calibrate's

ModelOpt's post-training quantization (`mtq.quantize` with its FP8 recipe: E4M3, per-tensor, the `max`
calibrator) runs over a copy of one block of the model at a time (`hy3c.checkpoint.layerwise` hands
each block every calibration window's inputs). hy3c's own modules are taught to ModelOpt the way it is
taught any custom layer (`QuantModuleRegistry`): a `Linear` gets an input and a weight quantizer, a
layer's stacked `Experts` an input quantizer (the routed tokens' hidden states) and a `down_input`
one (each expert's SiLU(gate) * up, before its down projection; named so the recipe's
`*input_quantizer` pattern enables it). ModelOpt's recipe leaves `lm_head` and
routers unquantized; its `mtp.*` exclusion is dropped, since Hy3's FP8 checkpoints quantize the MTP
layer too (HY3_SPEC §9). The KV cache is no module ModelOpt sees: its K and V ranges are read from the
cache the layer fills (`layerwise`). The result is the amax of each quantizer, which `convert_to_fp8`
turns into scales (amax / 448).
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hy3c.model.layers import Experts, Linear
from hy3c.ops.moe import silu_and_mul_reference

_REGISTERED = False  # ModelOpt's registry is process-wide: hy3c's modules are added to it once


def import_modelopt() -> Any:
    try:
        with warnings.catch_warnings():  # its transformers version check: hy3c does not use its HF export
            warnings.filterwarnings("ignore", message="transformers .* is not tested", category=UserWarning)
            import modelopt.torch.quantization as mtq
    except ImportError:
        raise RuntimeError(
            'calibration with ModelOpt needs nvidia-modelopt: pip install -e ".[quant]"'
            " (or --calibrator absmax for convert-fp8, rtn for convert-w4a8: no ModelOpt needed)"
        ) from None
    return mtq


def _register(mtq: Any) -> None:
    """Teach ModelOpt hy3c's Linear and Experts (once per process)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from modelopt.torch.quantization.nn import QuantModuleRegistry, TensorQuantizer

    class QuantLinear(Linear):
        def _setup(self) -> None:
            self.input_quantizer = TensorQuantizer()
            self.weight_quantizer = TensorQuantizer()

        def forward(self, x: Tensor) -> Tensor:
            return F.linear(self.input_quantizer(x), self.weight_quantizer(self.weight))

    class QuantExperts(Experts):
        def _setup(self) -> None:
            self.input_quantizer = TensorQuantizer()
            self.down_input_quantizer = TensorQuantizer()

        def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
            x = self.input_quantizer(x)
            out = torch.zeros_like(x, dtype=torch.float32)
            for e in topk_ids.unique().tolist():
                rows, slots = (topk_ids == e).nonzero(as_tuple=True)
                inter = self.down_input_quantizer(silu_and_mul_reference(F.linear(x[rows], self.w13[e])))
                weight = topk_weights[rows, slots].unsqueeze(-1).float()
                out.index_add_(0, rows, weight * F.linear(inter, self.w2[e]).float())
            return out.to(x.dtype)

    QuantModuleRegistry.register({Linear: "hy3c.Linear"})(QuantLinear)
    QuantModuleRegistry.register({Experts: "hy3c.Experts"})(QuantExperts)
    _REGISTERED = True


def _recipe(mtq: Any) -> dict:
    """ModelOpt's FP8 recipe without its `mtp.*` exclusion."""
    recipe = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    recipe["quant_cfg"] = [e for e in recipe["quant_cfg"] if e.get("quantizer_name") != "mtp.*"]
    return recipe


def _amax(quantizer) -> float:
    amax = getattr(quantizer, "amax", None)
    return 0.0 if amax is None else float(amax.float().max())


def quantize_block(block: nn.Module, prefix: str, run: Callable[[nn.Module], None]) -> dict[str, float]:
    """The amax of every FP8 module's input in `block` (experts: `<path>.a13`, `<path>.a2`; paths are
    `prefix` + the name in the block) as ModelOpt's FP8 post-training quantization calibrates it over
    `run` (every calibration window through the block); `block` itself is left as it was."""
    mtq = import_modelopt()
    _register(mtq)
    for p in block.parameters():
        if p.dtype == torch.float8_e4m3fn:
            raise ValueError("ModelOpt calibration: the model is FP8 already; calibrate its BF16 checkpoint")
    working = copy.deepcopy(block)  # ModelOpt converts the modules it quantizes in place
    with contextlib.redirect_stdout(io.StringIO()):  # ModelOpt prints its summary
        quantized = mtq.quantize(working, _recipe(mtq), run)
    stats: dict[str, float] = {}
    for name, module in quantized.named_modules():
        path = ".".join(part for part in (prefix, name) if part)
        if isinstance(module, Experts) and hasattr(module, "down_input_quantizer"):
            stats[f"{path}.a13"] = _amax(module.input_quantizer)
            stats[f"{path}.a2"] = _amax(module.down_input_quantizer)
        elif isinstance(module, Linear) and path != "lm_head" and hasattr(module, "input_quantizer"):
            stats[path] = _amax(module.input_quantizer)
    return stats

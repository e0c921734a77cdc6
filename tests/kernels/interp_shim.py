"""Fixes for Triton's CPU interpreter (TRITON_INTERPRET=1), routing bf16/fp8 through torch's CPU casts.

Without it the interpreter truncates fp32→bf16 instead of rounding to nearest even, loses the rounding
carry of fp32→fp8 (−31.6 → −16), reinterprets int→bf16 as raw bits and multiplies raw bf16 bit patterns
in `tl.dot` (triton-lang/triton#11584). FP8 downcasts saturate like the GPU's `cvt.rn.satfinite`.
XOR reductions (the compare-and-swap of `tl.sort` / `tl.topk`) run as one numpy reduction instead of
the interpreter's element-by-element Python loop, which takes seconds per sort of a few thousand keys.
"""

from __future__ import annotations

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter as _interp

_SPECIAL = {
    tl.bfloat16: (torch.bfloat16, torch.uint16),
    tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8),
    tl.float8e5: (torch.float8_e5m2, torch.uint8),
}
_FMAX = {tl.float8e4nv: 448.0, tl.float8e5: 57344.0}


def _as_torch(data, dtype):
    t = torch.from_numpy(np.ascontiguousarray(data))
    return t.view(_SPECIAL[dtype][0]) if dtype in _SPECIAL else t


def _torch_dtype(dtype):
    if dtype in _SPECIAL:
        return _SPECIAL[dtype][0]
    return torch.from_numpy(np.zeros(1, dtype=_interp._get_np_dtype(dtype))).dtype


def _to_numpy(t, dtype):
    return t.view(_SPECIAL[dtype][1]).numpy() if dtype in _SPECIAL else t.numpy()


def _torch_cast(src, dst_type):
    s, d = src.dtype.scalar, dst_type.scalar
    t = _as_torch(src.data, s)
    if d in _FMAX and t.is_floating_point():
        t = t.float().clamp(-_FMAX[d], _FMAX[d])
    out = t.to(_torch_dtype(d))
    return _interp.TensorHandle(_to_numpy(out, d).reshape(np.shape(src.data)), d)


_orig_cast = _interp.InterpreterBuilder.cast_impl
_orig_fp_to_fp = _interp.InterpreterBuilder.create_fp_to_fp
_orig_dot = _interp.InterpreterBuilder.create_dot


def _cast_impl(self, src, dst_type):
    if src.dtype.scalar in _SPECIAL or dst_type.scalar in _SPECIAL:
        return _torch_cast(src, dst_type)
    return _orig_cast(self, src, dst_type)


def _fp_to_fp(self, src, dst_type, rounding_mode):
    if rounding_mode is None or rounding_mode == _interp._ir.ROUNDING_MODE.RTNE:
        return _torch_cast(src, dst_type)
    return _orig_fp_to_fp(self, src, dst_type, rounding_mode)


def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if a.dtype.scalar in _SPECIAL:
        a = _torch_cast(a, tl.float32)
    if b.dtype.scalar in _SPECIAL:
        b = _torch_cast(b, tl.float32)
    return _orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


_orig_patch_lang_tensor = _interp._patch_lang_tensor


def _patch_lang_tensor(tensor, scope) -> None:
    """Scalars loaded from memory are 1-element arrays in the interpreter; let them index (range bounds)."""
    _orig_patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))


_orig_reduce_apply_impl = _interp.ReduceOps.apply_impl


def _reduce_apply_impl(self, input):
    if self.combine_fn == tl.standard._xor_combine:
        data = input[0].handle.data
        out = np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims)
        return [self.to_tensor(out if self.axis is not None else out.item(), input[0].dtype)]
    return _orig_reduce_apply_impl(self, input)


def install() -> None:
    _interp._patch_lang_tensor = _patch_lang_tensor
    _interp.ReduceOps.apply_impl = _reduce_apply_impl
    builder = _interp.InterpreterBuilder
    builder.cast_impl = _cast_impl
    for name in (
        "create_si_to_fp",
        "create_ui_to_fp",
        "create_fp_to_si",
        "create_fp_to_ui",
        "create_fp_ext",
        "create_fp_trunc",
    ):
        setattr(builder, name, lambda self, src, dst_type: self.cast_impl(src, dst_type))
    builder.create_fp_to_fp = _fp_to_fp
    builder.create_dot = _dot

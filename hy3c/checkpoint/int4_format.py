"""compressed-tensors' `pack-quantized` int4 weights ↔ hy3c's packed int4 (`hy3c.ops.quant.pack_int4`).

compressed-tensors (the format of vLLM's W4A8-FP8 MoE and of AngelSlim's W4AFP8 preset) stores a
[rows, columns] int4 weight as `weight_packed` int32 [rows, columns / 8]: column 8w + j in bits 4j..4j+3
of word w, as the offset value q + 8 (0..15), with `weight_scale` [rows, columns / group] and
`weight_shape` [rows, columns]. hy3c packs the same values two per byte (two's complement, even column
in the low nibble): uint8 [rows, columns / 2].
"""

from __future__ import annotations

import torch
from torch import Tensor

from hy3c.ops.quant import pack_int4, unpack_int4


def _shifts(like: Tensor) -> Tensor:
    """The bit offset of each of a word's 8 values, on `like`'s device."""
    return torch.arange(0, 32, 4, device=like.device)


def words_to_packed(words: Tensor) -> Tensor:
    """int32 [..., columns / 8] of offset nibbles → hy3c's uint8 [..., columns / 2]."""
    if words.dtype != torch.int32:
        raise ValueError(f"expected int32 packed words, got {words.dtype}")
    nibbles = (words.unsqueeze(-1).to(torch.int64) >> _shifts(words)) & 0xF
    return pack_int4((nibbles - 8).to(torch.int8).flatten(-2))


def packed_to_words(packed: Tensor) -> Tensor:
    """hy3c's uint8 [..., columns / 2] → int32 [..., columns / 8] of offset nibbles (columns % 8 == 0)."""
    values = unpack_int4(packed).to(torch.int64) + 8
    if values.shape[-1] % 8:
        raise ValueError(
            f"compressed-tensors packs 8 columns per word; {values.shape[-1]} columns do not fit"
        )
    words = (values.unflatten(-1, (-1, 8)) << _shifts(packed)).sum(-1)
    return (words - ((words >> 31) & 1) * (1 << 32)).to(torch.int32)  # the low 32 bits, as signed

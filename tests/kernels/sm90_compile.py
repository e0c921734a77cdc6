"""Compile hy3c's Triton kernels for the H200 (sm_90) on a machine without a GPU.

    python tests/kernels/sm90_compile.py      # exit status 1 if any variant fails to compile

Triton's frontend and NVIDIA backend run on the CPU down to a cubin, so kernel variants that the CPU
interpreter runs but the GPU machine has not yet compiled (options measured only later: TMA tiles, the
FP8 QK product, the router's split-K arrival counters) are checked here first. Must run without
TRITON_INTERPRET (the test runs it in a subprocess).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from hy3c.kernels.attention import decode, prefill, prefill_gluon, qknorm_rope_kvstore
from hy3c.kernels.attention.config import GLUON_PREFILL_CONFIG, decode_config, triton_prefill_config
from hy3c.kernels.collectives import all_reduce
from hy3c.kernels.collectives.symmetric import MAX_PROGRAMS, RESERVED_CHANNELS
from hy3c.kernels.moe import config as moe_config
from hy3c.kernels.moe import fused_moe, fused_moe_gluon, fused_moe_persistent, fused_moe_w4a8, router
from hy3c.ops.quant import FP8_DTYPE

TARGET = GPUTarget("cuda", 90, 32)
SM_SHARED_MEMORY = 228 * 1024  # an H100/H200 SM's shared memory
KV_DTYPES = {"bf16": "bf16", "fp8": "fp8e4nv"}


@dataclass
class Variant:
    label: str
    kernel: object
    pointers: dict[str, str]  # pointer arguments whose element type is not int32
    constexprs: dict[str, object]
    descriptors: dict[str, str] = field(default_factory=dict)
    fp32_scalars: tuple[str, ...] = ()
    options: dict[str, int] = field(default_factory=dict)  # launch options (num_warps, maxnreg, …)
    gluon: bool = False  # a Gluon kernel: compiled from GluonASTSource, its wgmma overlap checked
    max_shared: int | None = None  # bytes of shared memory the kernel must stay within
    integers: tuple[str, ...] = ()  # integer arguments launched as multiples of 16 (row strides)

    def attrs(self) -> dict[tuple[int], list[list]]:
        """Pointers 16-byte aligned, as every launch passes them (the loads vectorize and pipeline)."""
        signature = self.signature()
        return {
            (i,): [["tt.divisibility", 16]]
            for i, name in enumerate(self.kernel.arg_names)
            if signature[name].startswith("*") or name in self.integers
        }

    def signature(self) -> dict[str, str]:
        """Each argument's type: constexpr, tensor descriptor, pointer (int32 unless named), fp32 or i32."""
        sig = {}
        for name in self.kernel.arg_names:
            if name in self.constexprs:
                sig[name] = "constexpr"
            elif name in self.descriptors:
                sig[name] = self.descriptors[name]
            elif name in self.pointers or name.endswith("_ptr"):
                sig[name] = self.pointers.get(name, "*i32")
            else:
                sig[name] = "fp32" if name in self.fp32_scalars else "i32"
        return sig


def _descriptors(names: tuple[str, ...], dtype: str, box: tuple[int, int], on: bool) -> dict[str, str]:
    return {name: f"tensordesc<{dtype}[{box[0]}, {box[1]}]>" for name in names} if on else {}


def attention_variants() -> list[Variant]:
    """Prefill and decode over bf16 and FP8 KV (V pages transposed: [head_dim, keys] TMA boxes), pointer
    loads or TMA page slices, eager or lazy rescaling (prefill)."""
    variants = []
    for kv in ("bf16", "fp8"):
        dtype = torch.bfloat16 if kv == "bf16" else FP8_DTYPE
        cache = {"cache_ptr": f"*{KV_DTYPES[kv]}", "scales_ptr": "*fp32"}
        fp8 = dict(FP8=kv == "fp8", P_SCALE=448.0, PAGE_SIZE=64, PDL=True)
        for lazy in (False, True):
            for tma in (False, True):
                unused = {} if tma else {"k_desc": None, "v_desc": None}
                variants.append(
                    Variant(
                        f"prefill {kv} tma={tma} lazy={lazy}",
                        prefill._prefill_kernel,
                        {"q_ptr": "*bf16", "out_ptr": "*bf16", **cache},
                        dict(
                            GROUP=8, Q_BLOCK=16, HEAD_DIM=128, BLOCK_N=64, TMA=tma, LAZY=lazy, **fp8, **unused
                        ),
                        _kv_descriptors(kv, 64, tma),
                        ("sm_scale",),
                    )
                )
        # the shipped prefill config's launch options (warps, stages, register cap) for this KV dtype
        eager = next(v for v in variants if v.label == f"prefill {kv} tma=True lazy=False")
        options = triton_prefill_config(dtype).launch_options()
        label = f"prefill {kv} tma=True lazy=False shipped {options}"
        variants.append(dataclasses.replace(eager, label=label, options=options))
        for block_n, tma in ((128, False), (64, True)):
            unused = {} if tma else {"k_desc": None, "v_desc": None}
            shape = dict(GROUP=8, GROUP_PAD=16, HEAD_DIM=128, KV_TILE=256, MIN_TILES=1, BLOCK_N=block_n)
            variants.append(
                Variant(
                    f"decode {kv} block_n={block_n} tma={tma}",
                    decode._decode_dynamic_kernel,
                    {"q_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", **cache},
                    dict(**shape, TMA=tma, **fp8, **unused),
                    _kv_descriptors(kv, block_n, tma),
                    ("sm_scale",),
                    options=decode_config(dtype, 1).launch_options(),  # the shipped warps and stages
                )
            )
    return [*variants, gluon_prefill_variant()]


def gluon_prefill_variant() -> Variant:
    """The warp-specialized Gluon prefill (bf16 KV) with the shipped config: 128-key blocks of two
    64-key page slices, a two-slot K/V ring."""
    config = GLUON_PREFILL_CONFIG
    layout = "NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, transposed=False, "
    layout += "fp4_padded=False, cga_layout=[])"
    box = prefill_gluon.PAGE_BOX
    descriptor = f"tensordesc<bf16[{box}, 128],{layout}>"
    constexprs = dict(GROUP=8, Q_BLOCK=16, HEAD_DIM=128, BLOCK_N=config.block_n, PAGE_SIZE=64)
    constexprs |= dict(NUM_BUF=config.num_stages, CONSUMER_REGS=prefill_gluon.CONSUMER_REGISTERS)
    constexprs |= dict(PRODUCER_REGS=prefill_gluon.PRODUCER_REGISTERS)
    options = prefill_gluon.launch_options(config)
    return Variant(
        f"prefill bf16 gluon warp-specialized shipped {options}",
        prefill_gluon._prefill_kernel,
        {"q_ptr": "*bf16", "out_ptr": "*bf16"},
        constexprs,
        {"k_desc": descriptor, "v_desc": descriptor},
        ("qk_scale",),
        options=options,
        gluon=True,
    )


def wgmma_serialized(ptx: str) -> bool:
    """Whether ptxas serializes the kernel's wgmma instructions (any of its "wgmma.mma_async instructions
    are serialized" notes: an in-flight accumulator or operand touched, too few registers, …), which
    removes every overlap of the products with the softmax."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        args = [ptxas, "-v", "-arch=sm_90a", source, "-o", os.path.join(tmp, "kernel.cubin")]
        notes = subprocess.run(args, capture_output=True, text=True).stderr
    return "wgmma.mma_async instructions are serialized" in notes


def _kv_descriptors(kv: str, block_n: int, tma: bool) -> dict[str, str]:
    """K boxes [block_n, head_dim]; V boxes alike, or [head_dim, block_n] for FP8's transposed V pages."""
    if not tma:
        return {}
    v_box = (128, block_n) if kv == "fp8" else (block_n, 128)
    dtype = KV_DTYPES[kv]
    return _descriptors(("k_desc",), dtype, (block_n, 128), True) | _descriptors(
        ("v_desc",), dtype, v_box, True
    )


def qknorm_variants() -> list[Variant]:
    """The fused QK-norm/RoPE/KV store over bf16 and FP8 caches (FP8: V programs, transposed V pages), one
    head group per program (below 2K tokens) or all of them."""
    pointers = {"qkv_ptr": "*bf16", "qw_ptr": "*bf16", "kw_ptr": "*bf16", "q_out_ptr": "*bf16"}
    pointers |= {"inv_freq_ptr": "*fp32", "scales_ptr": "*fp32", "had_ptr": "*fp32", "slot_ptr": "*i64"}
    variants = []
    for kv in ("bf16", "fp8"):
        constexprs = dict(NUM_Q_HEADS=64, NUM_KV_HEADS=8, HEAD_DIM=128, Q_GROUP=8, FP8=kv == "fp8", KV_POW2=8)
        constexprs |= dict(HADAMARD=False, BLOCK_T=4, V_T=kv == "fp8", V_TOKENS=16, V_HEADS=2, PDL=True)
        for per_program in (1, 9 if kv == "fp8" else 10):
            variants.append(
                Variant(
                    f"qknorm_rope_kvstore {kv} groups/program={per_program}",
                    qknorm_rope_kvstore._qknorm_rope_kvstore_kernel,
                    {**pointers, "cache_ptr": f"*{KV_DTYPES[kv]}", "pos_ptr": "*i64"},
                    dict(constexprs, GROUPS_PER_PROGRAM=per_program),
                    fp32_scalars=("eps",),
                )
            )
    return variants


def moe_variants() -> list[Variant]:
    variants = []
    for weights in ("bf16", "fp8"):
        fp8 = weights == "fp8"
        w, block_k = f"*{KV_DTYPES[weights]}", 256 if fp8 else 128
        scales = {"xs_ptr": "*fp32", "ws_ptr": "*fp32", "hs_ptr": "*fp32"}
        for tma, block_m, swap, pair_blocks in (
            (False, 16, False, False),
            (True, 16, False, False),
            (True, 64, False, False),
            (False, 16, True, False),
            (True, 16, True, True),
        ):
            common = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=1, FP8=fp8, A_PER_ROW=fp8)
            common |= dict(
                W_PER_ROW=fp8, QUANT_ON_LOAD=False, TMA=tma, SWAP_AB=swap, PAIR_BLOCKS=pair_blocks, PDL=True
            )
            if not tma:
                common["w_desc"] = None
            descs = _descriptors(("w_desc",), KV_DTYPES[weights], (64, block_k), tma)
            variants.append(
                Variant(
                    f"fused_moe gate-up {weights} tma={tma} block_m={block_m} swap_ab={swap} pair_blocks={pair_blocks}",
                    fused_moe._gate_up_kernel,
                    {"x_ptr": w, "w_ptr": w, "out_ptr": "*bf16", **scales},
                    dict(common, QUANT_H=False, ACT_DTYPE=tl.bfloat16),
                    descs,
                )
            )
            variants.append(
                Variant(
                    f"fused_moe down {weights} tma={tma} block_m={block_m} swap_ab={swap} pair_blocks={pair_blocks}",
                    fused_moe._down_kernel,
                    {"h_ptr": w, "w_ptr": w, "out_ptr": "*bf16", **scales},
                    common,
                    descs,
                )
            )
    return variants + static_one_token_variants()


def static_one_token_variants() -> list[Variant]:
    """The shipped one-token FP8 config with static activation scales: weights as the MMA's rows, pair
    blocks, TMA tiles of 128 × 256, x quantized inside the gate-up GEMM, the intermediate written as e4m3."""
    fp8 = KV_DTYPES["fp8"]
    scales = {"xs_ptr": "*fp32", "ws_ptr": "*fp32", "hs_ptr": "*fp32"}
    common = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=256, GROUP_M=1, FP8=True, A_PER_ROW=False, W_PER_ROW=True)
    common |= dict(TMA=True, SWAP_AB=True, PAIR_BLOCKS=True, PDL=True)
    descs = _descriptors(("w_desc",), fp8, (128, 256), True)
    return [
        Variant(
            "fused_moe gate-up fp8 static one-token",
            fused_moe._gate_up_kernel,
            {"x_ptr": "*bf16", "w_ptr": f"*{fp8}", "out_ptr": f"*{fp8}", **scales},
            dict(common, QUANT_ON_LOAD=True, QUANT_H=True, ACT_DTYPE=tl.bfloat16),
            descs,
        ),
        Variant(
            "fused_moe down fp8 static one-token",
            fused_moe._down_kernel,
            {"h_ptr": f"*{fp8}", "w_ptr": f"*{fp8}", "out_ptr": "*bf16", **scales},
            dict(common, QUANT_ON_LOAD=False),
            descs,
        ),
    ]


def w4a8_moe_variants() -> list[Variant]:
    """The W4A8 GEMMs (int4 weights widened to e4m3 in registers, K blocks of one 128-column group) in
    every built-in config's shape, by either widening: weights as the MMA's rows or not, pair blocks,
    dynamic or static intermediate scales; and the sweep's K blocks of 2 and 4 groups."""
    fp8 = f"*{KV_DTYPES['fp8']}"
    scales = {"as_ptr": "*fp32", "ws_ptr": "*fp32", "hs_ptr": "*fp32"}
    variants = []
    configs = list(moe_config._W4A8_DEFAULTS.values())
    configs += [dataclasses.replace(cfg, int4_subnormal=not cfg.int4_subnormal) for cfg in configs]
    configs += [
        moe_config.MoeConfig(16, 64, 512, 1, 4, 3, swap_ab=True, pair_blocks=True, int4_subnormal=True),
        moe_config.MoeConfig(16, 128, 256, 1, 8, 4, swap_ab=True, int4_subnormal=True),
    ]
    for cfg in configs:
        common = dict(GROUP=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
        common["BLOCK_K"], common["SUB_K"] = fused_moe_w4a8.w4a8_block_k(cfg, 128, 4096, 1536)
        common |= dict(GROUP_M=cfg.group_m, A_PER_ROW=True, SWAP_AB=cfg.swap_ab, PAIR_BLOCKS=cfg.pair_blocks)
        common |= dict(SUBNORMAL=cfg.int4_subnormal, PRMT=True, PDL=True)
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        # the e4m3 intermediate changes only the epilogue, the same for either widening; pair blocks
        # also with the gate-up's K split in 2 and 4 (fp32 atomics and the tiles' arrival counters)
        for quant_h in (False, True) if not cfg.int4_subnormal else (False,):
            for split_k in (1, 2, 4) if cfg.pair_blocks else (1,):
                variants.append(
                    Variant(
                        f"fused_moe w4a8 gate-up {cfg} quant_h={quant_h} split_k={split_k}",
                        fused_moe_w4a8._gate_up_w4a8_kernel,
                        {
                            "a_ptr": fp8,
                            "w_ptr": "*u8",
                            "out_ptr": fp8 if quant_h else "*bf16",
                            "part_ptr": "*fp32",
                            **scales,
                        },
                        dict(common, QUANT_H=quant_h, ACT_DTYPE=tl.bfloat16, SPLIT_K=split_k),
                        options=options,
                    )
                )
        variants.append(
            Variant(
                f"fused_moe w4a8 down {cfg}",
                fused_moe_w4a8._down_w4a8_kernel,
                {"h_ptr": fp8, "w_ptr": "*u8", "out_ptr": "*bf16", "hs_ptr": "*fp32", "ws_ptr": "*fp32"},
                common,
                options=options,
            )
        )
    return variants


def gluon_moe_variants() -> list[Variant]:
    """The one-token Gluon FusedMoE kernels at Hy3's widths, as `fused_moe_gluon.routed_pairs` launches
    them: the gate-up for each way its row arrives (e4m3 from the norm, bf16 quantized with a dynamic or a
    static scale, bf16 weights), the down kernel for a dynamic or static FP8 intermediate and bf16; the
    down kernel must leave room for two programs per SM."""
    mod = fused_moe_gluon
    hidden, inter = 4096, 1536
    variants = []
    for weights in ("fp8", "bf16"):
        dtype = FP8_DTYPE if weights == "fp8" else torch.bfloat16
        w13 = torch.empty(1, 2 * inter, hidden, dtype=dtype, device="meta")
        w2 = torch.empty(1, hidden, inter, dtype=dtype, device="meta")
        box_k, bits = mod.BOX_BYTES // dtype.itemsize, 8 * dtype.itemsize
        layout = (
            f"NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth={bits}, rank=2, transposed=False, "
        )
        layout += "fp4_padded=False, cga_layout=[])"
        descriptor = {"w_desc": f"tensordesc<{KV_DTYPES[weights]}[{mod.BLOCK_ROWS.value}, {box_k}],{layout}>"}
        w, fp8 = f"*{KV_DTYPES[weights]}", weights == "fp8"
        scales = {"xs_ptr": "*fp32", "ws_ptr": "*fp32", "hs_ptr": "*fp32", "topk_w_ptr": "*fp32"}
        gate_up_modes = [("x_q", mod.ROW_AS_IS, False), ("dynamic", mod.ROW_DYNAMIC, False)]
        gate_up_modes.append(("static", mod.ROW_STATIC, True))
        for name, mode, quant_h in gate_up_modes if fp8 else [("bf16", mod.ROW_AS_IS, False)]:
            row = w if mode == mod.ROW_AS_IS else "*bf16"
            constexprs = dict(
                HIDDEN=hidden, INTER=inter, NUM_BUF=mod.gate_up_slots(w13), A_MODE=mode, FP8=fp8
            )
            constexprs |= dict(A_PER_ROW=fp8 and mode == mod.ROW_AS_IS, W_PER_ROW=fp8, QUANT_H=quant_h)
            constexprs |= dict(ACT_DTYPE=tl.bfloat16, PDL=True)
            variants.append(
                Variant(
                    f"fused_moe gluon gate-up {weights} {name}",
                    mod._gate_up_kernel,
                    {"x_ptr": row, "h_ptr": f"*{KV_DTYPES['fp8']}" if quant_h else "*bf16", **scales},
                    constexprs,
                    descriptor,
                    options={"num_warps": 4},
                    gluon=True,
                    max_shared=mod.SHARED_MEMORY_BUDGET + 1024,
                    integers=("stride_xm", "stride_hm"),
                )
            )
        for name, mode in [("dynamic", mod.ROW_DYNAMIC), ("static", mod.ROW_AS_IS)] if fp8 else [("bf16", 0)]:
            row = w if mode == mod.ROW_AS_IS else "*bf16"
            constexprs = dict(HIDDEN=hidden, INTER=inter, NUM_BUF=mod.down_slots(w2), A_MODE=mode, FP8=fp8)
            constexprs |= dict(A_PER_ROW=False, W_PER_ROW=fp8, PDL=True)
            variants.append(
                Variant(
                    f"fused_moe gluon down {weights} {name}",
                    mod._down_kernel,
                    {"h_ptr": row, "out_ptr": "*fp32", **scales},
                    constexprs,
                    descriptor,
                    options={"num_warps": 4, "maxnreg": mod.DOWN_LAUNCH_REGISTERS},
                    gluon=True,
                    max_shared=SM_SHARED_MEMORY // 2 - 1024,  # two programs per SM, 1 KB reserved each
                    integers=("stride_hm", "stride_om"),
                )
            )
    return variants


def persistent_moe_variants() -> list[Variant]:
    """The persistent Gluon GEMMs at Hy3's widths in the configs the prefill sweep tries (128 and 64
    columns per operand, the ring as deep as shared memory allows up to 4): the gate-up for the MoE
    input's per-token scales (x_q or quantized first) and a static scale with an e4m3 intermediate, the
    down for dynamic (per sorted row) and static intermediate scales, and bf16."""
    mod = fused_moe_persistent
    variants = []
    for weights in ("fp8", "bf16"):
        dtype = FP8_DTYPE if weights == "fp8" else torch.bfloat16
        fp8 = weights == "fp8"
        box_k, bits = mod.BOX_BYTES // dtype.itemsize, 8 * dtype.itemsize
        layout = (
            f"NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth={bits}, rank=2, transposed=False, "
        )
        layout += "fp4_padded=False, cga_layout=[])"
        cases = [("gate-up", 2, mod.SCALE_PER_TOKEN, False), ("gate-up", 2, mod.SCALE_STATIC, True)]
        cases += [("down", 1, mod.SCALE_PER_ROW, False), ("down", 1, mod.SCALE_STATIC, False)]
        for gemm, operands, a_scale, quant_h in (
            cases if fp8 else [("gate-up", 2, 0, False), ("down", 1, 0, False)]
        ):
            for block_n in (128, 64):
                n, k = (1536, 4096) if gemm == "gate-up" else (4096, 1536)
                constexprs = dict(N=n, K=k, ROWS_PER_EXPERT=n * operands, OPERANDS=operands)
                constexprs |= dict(NUM_BUF=min(4, mod.ring_slots(block_n, operands)), GROUP_M=8, FP8=fp8)
                constexprs |= dict(A_SCALE=a_scale, W_PER_ROW=fp8, QUANT_H=quant_h, ACT_DTYPE=tl.bfloat16)
                descriptors = {
                    "a_desc": f"tensordesc<{KV_DTYPES[weights]}[{mod.BLOCK_M}, {box_k}],{layout}>",
                    "w_desc": f"tensordesc<{KV_DTYPES[weights]}[{block_n}, {box_k}],{layout}>",
                }
                out = f"*{KV_DTYPES['fp8']}" if quant_h else "*bf16"
                variants.append(
                    Variant(
                        f"fused_moe persistent {gemm} {weights} scale={getattr(a_scale, 'value', a_scale)} "
                        f"quant_h={quant_h} block_n={block_n}",
                        mod._grouped_gemm_kernel,
                        {"out_ptr": out, "as_ptr": "*fp32", "ws_ptr": "*fp32", "hs_ptr": "*fp32"},
                        constexprs,
                        descriptors,
                        options={"num_warps": 4, "maxnreg": mod.LAUNCH_REGISTERS},
                        gluon=True,
                        max_shared=mod.SHARED_MEMORY_BUDGET + 1024,
                        integers=("stride_om",),
                    )
                )
    return variants


def router_variants() -> list[Variant]:
    pointers = {
        "x_ptr": "*bf16",
        "hi_ptr": "*bf16",
        "lo_ptr": "*bf16",
        "out_ptr": "*fp32",
        "partial_ptr": "*fp32",
    }
    return [
        Variant(
            f"router_gemm splits={splits}",
            router._router_gemm_kernel,
            pointers,
            dict(SPLITS=splits, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, PDL=True),
        )
        for splits in (1, 16)
    ]


def collective_variants() -> list[Variant]:
    """The fused all-reduce + residual add + RMSNorm over symmetric memory at Hy3's hidden size, one-shot
    and two-shot, for 2, 4 and 8 ranks, with its barriers' timeout (inline PTX: %globaltimer, trap) and
    the launch options `all_reduce.launch` gives it."""
    pointers = {name: "*bf16" for name in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "sum_ptr")}
    pointers |= {"bufs_ptr": "*i64", "pads_ptr": "*i64"}
    hidden = 4096
    variants = []
    for world in (2, 4, 8):
        for two_shot in (False, True):
            constexprs = dict(WORLD=world, TWO_SHOT=two_shot, PHASE=all_reduce.ALL_PHASES, PDL=True)
            constexprs |= dict(PROGRAMS=MAX_PROGRAMS, RESERVED=RESERVED_CHANNELS * world, BLOCK=hidden)
            constexprs |= dict(TIMEOUT_NS=all_reduce.BARRIER_TIMEOUT_S * 10**9)
            variants.append(
                Variant(
                    f"all_reduce_add_rms_norm {'two' if two_shot else 'one'}-shot world={world}",
                    all_reduce._all_reduce_add_rms_norm_kernel,
                    pointers,
                    constexprs,
                    fp32_scalars=("eps",),
                    options={"num_warps": all_reduce.num_warps(hidden)},
                    integers=("cols", "stride_x", "stride_r", "stride_o", "stride_s"),
                )
            )
    return variants


def main() -> int:
    failures = 0
    variants = attention_variants() + qknorm_variants() + moe_variants() + w4a8_moe_variants()
    variants += gluon_moe_variants() + persistent_moe_variants()
    for variant in variants + router_variants() + collective_variants():
        source_type = GluonASTSource if variant.gluon else ASTSource
        source = source_type(
            variant.kernel, variant.signature(), constexprs=variant.constexprs, attrs=variant.attrs()
        )
        try:
            compiled = triton.compile(source, target=TARGET, options=variant.options)
        except Exception as exc:  # report every failing variant, not only the first
            failures += 1
            print(f"FAIL {variant.label}: {type(exc).__name__}: {exc}")
            continue
        if variant.gluon and wgmma_serialized(compiled.asm["ptx"]):
            failures += 1
            print(f"FAIL {variant.label}: ptxas serializes its wgmma instructions (C7514)")
            continue
        if variant.max_shared is not None and compiled.metadata.shared > variant.max_shared:
            failures += 1
            print(f"FAIL {variant.label}: {compiled.metadata.shared} B shared memory > {variant.max_shared}")
            continue
        print(f"ok   {variant.label}: {compiled.metadata.shared} B shared memory")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

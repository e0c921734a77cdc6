"""Train a tiny Hy3 checkpoint here, deterministically, so the MTP layer has learned something.

A random checkpoint (`hy3c init-checkpoint`) is enough to test shapes and numerics, but its MTP layer
drafts noise, so speculative-decoding acceptance measured on it means nothing. `train_tiny` trains a
tiny-ish Hy3 (GQA, QK-norm, a dense first layer, MoE layers with a shared expert, one MTP layer) for a
few minutes on 2 CPU cores, on text every machine with Python has: the standard library's top-level
`.py` files, read in sorted order, every `HELDOUT_EVERY`-th file held out for evaluation.

    python -m hy3c.checkpoint.train_tiny --out ckpt/trained-tiny [--steps N]

The model's own forward (`hy3c.model`) runs over a paged KV cache with custom ops and is not meant to be
differentiated, so training uses `train_forward` / `train_mtp_forward` below: plain torch over the same
parameter names and shapes as `Hy3ForCausalLM` and the same math (docs/ARCHITECTURE.md §1.2–§1.5).

Loss = CE(main logits at t, x_{t+1}) + MTP_LOSS_WEIGHT * CE(MTP logits at t, x_{t+2}), where the MTP at
t consumes embedding(x_{t+1}) and the main model's post-norm hidden h_t. h_t is detached for the MTP
loss: the MTP is a drafter for the main model, so the main model is trained on its own objective only
and the MTP learns to predict on top of whatever hidden states the main model makes (the shared
embedding and lm_head still learn from both losses). Expert biases are not learned by gradient: they are
nudged towards balanced expert load after every step (auxiliary-loss-free balancing).

Reproducibility: every random draw comes from one seeded generator, deterministic algorithms are on and
the thread count is fixed while training (all three restored afterwards), so the same seed, steps,
torch version and machine give bit-equal weights. The checkpoint is written in the real HF (hub) layout,
fp32, atomically; `mtp_acceptance` / `evaluate` measure it with the real inference model.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import sys
import sysconfig
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import tokenizers
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor
from tqdm import tqdm

from hy3c.checkpoint.loader import load_model
from hy3c.checkpoint.random_checkpoint import write_config_files
from hy3c.checkpoint.safetensors_io import ShardedWriter, atomic_output_dir
from hy3c.checkpoint.tiny_tokenizer import write_tokenizer_files
from hy3c.checkpoint.weight_map import expected_tensors
from hy3c.config import Hy3Config, preset_config
from hy3c.model import SeqChunk, allocate_kv_cache, build_step_batch
from hy3c.model.hy3 import Hy3ForCausalLM
from hy3c.ops.moe import ROUTER_RENORM_EPS

# the trained model: the `tiny` preset's layout (GQA 4:2, QK-norm, a dense first layer, two MoE layers of
# 8 experts top-2 with one shared expert, one MTP layer), a little wider than it (hidden 96, dense FFN
# 256, experts 64) so that 500 steps on 2 cores learn the stdlib well enough for MTP drafts to be accepted
CONFIG_OVERRIDES: dict[str, object] = {
    "hidden_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "dtype": "float32",
}
DEFAULT_STEPS = 500
SEQ_LEN = 128  # tokens per training sequence (and per evaluation window)
BATCH = 16  # sequences per step
PEAK_LR = 3e-3
MIN_LR_FRACTION = 0.1  # cosine decay from PEAK_LR down to this fraction of it
WARMUP_STEPS = 30
WEIGHT_DECAY = 0.01
GRAD_CLIP = 1.0
BETAS = (0.9, 0.95)
MTP_LOSS_WEIGHT = 1.0
BIAS_UPDATE_RATE = 1e-3  # expert-bias step of the auxiliary-loss-free load balancing
THREADS = 2  # intra-op threads while training: results of a CPU GEMM can depend on the thread count
HELDOUT_EVERY = 10  # sorted file i is held out for evaluation when i % HELDOUT_EVERY == 0
FILE_SEPARATOR = 1  # the tiny tokenizer's eos id, put between files of the training stream


class TrainError(ValueError):
    """Bad input to training or evaluation (no corpus, an unusable argument); the message says which."""


@dataclass(frozen=True)
class TrainReport:
    """What `train_tiny` did: where it wrote, how long it took, the last losses."""

    path: Path
    steps: int
    seed: int
    seconds: float
    train_tokens: int
    train_files: int
    heldout_files: int
    final_loss: float  # main next-token CE, mean of the last 10 steps
    final_mtp_loss: float  # MTP CE on the token after next, mean of the last 10 steps
    checkpoint_bytes: int


@dataclass(frozen=True)
class EvalReport:
    """Teacher-forced greedy measurements on held-out text (K=1 MTP drafts)."""

    acceptance: float  # argmax MTP logits at t == argmax main logits at t+1
    main_accuracy: float  # argmax main logits at t == x_{t+1}
    mtp_accuracy: float  # argmax MTP logits at t == x_{t+2}
    positions: int  # MTP positions measured


# ---- config, corpus ----------------------------------------------------------------------------------


def trained_config() -> Hy3Config:
    """The config of the trained checkpoint (the tiny preset with CONFIG_OVERRIDES)."""
    return preset_config("tiny", **CONFIG_OVERRIDES)


def stdlib_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): the top-level .py files of the standard library, sorted by name;
    file i is held out when i % HELDOUT_EVERY == 0."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    files = sorted(root.glob("*.py"), key=lambda p: p.name)
    if len(files) < HELDOUT_EVERY:
        raise TrainError(f"{root}: found {len(files)} .py files, training needs at least {HELDOUT_EVERY}")
    train = [f for i, f in enumerate(files) if i % HELDOUT_EVERY]
    heldout = [f for i, f in enumerate(files) if i % HELDOUT_EVERY == 0]
    return train, heldout


def _read(files: Sequence[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def _token_stream(tok: Tokenizer, texts: Sequence[str]) -> Tensor:
    """All texts' ids in order, FILE_SEPARATOR between files (int64)."""
    parts: list[int] = []
    for enc in tok.encode_batch(list(texts)):
        parts.extend(enc.ids)
        parts.append(FILE_SEPARATOR)
    return torch.tensor(parts, dtype=torch.int64)


# ---- parameters --------------------------------------------------------------------------------------


def parameter_shapes(config: Hy3Config) -> dict[str, torch.Size]:
    """Name → shape of every checkpoint-backed parameter of `Hy3ForCausalLM` (the kv_scales excluded)."""
    meta = Hy3ForCausalLM(config, dtype=torch.float32, device="meta")
    return {n: p.shape for n, p in meta.named_parameters() if n != "kv_scales"}


def init_parameters(config: Hy3Config, gen: torch.Generator) -> dict[str, Tensor]:
    """Initial weights: norms 1, expert biases 0, matrices N(0, initializer_range²) with the residual
    output projections scaled down by sqrt(2 · blocks) (the usual depth scaling); drawn in name order."""
    std = config.initializer_range
    blocks = config.num_hidden_layers + config.num_nextn_predict_layers
    out: dict[str, Tensor] = {}
    for name, shape in sorted(parameter_shapes(config).items()):
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        elif name.endswith("expert_bias"):
            out[name] = torch.zeros(shape)
        else:
            scale = (
                std / math.sqrt(2 * blocks)
                if name.endswith(("o_proj.weight", "down_proj.weight", "w2"))
                else std
            )
            out[name] = scale * torch.randn(shape, generator=gen)
    return out


# ---- the differentiable training forward (same math as hy3c.model, whole sequences) -------------------


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """x [B, S, heads, d] rotated by the angles of positions [S] (rotate-half pairing)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    rotated = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)
    return x * cos + rotated * sin


def _swiglu(x: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    g, u = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, down)


def _attention(x: Tensor, positions: Tensor, p: Mapping[str, Tensor], prefix: str, cfg: Hy3Config) -> Tensor:
    b, s, _ = x.shape
    nh, nkv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    q, k, v = F.linear(x, p[f"{prefix}.qkv_proj.weight"]).split([nh * d, nkv * d, nkv * d], dim=-1)
    q = _rope(_rms(q.view(b, s, nh, d), p[f"{prefix}.q_norm.weight"], eps), positions, cfg.rope_theta)
    k = _rope(_rms(k.view(b, s, nkv, d), p[f"{prefix}.k_norm.weight"], eps), positions, cfg.rope_theta)
    v = v.view(b, s, nkv, d)
    k, v = k.repeat_interleave(nh // nkv, dim=2), v.repeat_interleave(nh // nkv, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * d**-0.5
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    o = torch.einsum("bhts,bshd->bthd", probs, v).reshape(b, s, nh * d)
    return F.linear(o, p[f"{prefix}.o_proj.weight"])


def _route(x: Tensor, p: Mapping[str, Tensor], prefix: str, cfg: Hy3Config) -> tuple[Tensor, Tensor]:
    """Sigmoid router: top-k of scores + expert_bias, weighted by the renormalised, scaled unbiased
    scores → (dense combine weights [N, E], chosen ids [N, k])."""
    scores = torch.sigmoid(F.linear(x, p[f"{prefix}.router.weight"]))
    ids = torch.topk(scores + p[f"{prefix}.expert_bias"], cfg.num_experts_per_tok, dim=-1).indices
    w = scores.gather(-1, ids)
    w = w / (w.sum(-1, keepdim=True) + ROUTER_RENORM_EPS) * cfg.router_scaling_factor
    return torch.zeros_like(scores).scatter(-1, ids, w), ids


def _moe(
    x: Tensor, p: Mapping[str, Tensor], prefix: str, cfg: Hy3Config, loads: list[Tensor] | None
) -> Tensor:
    """Routed experts (every expert computed on every token, weighted 0 where not chosen: the same sum
    as the sparse dispatch, cheaper than indexing at these sizes) + the shared expert."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    combine, ids = _route(flat, p, prefix, cfg)
    if loads is not None:
        loads.append(torch.bincount(ids.flatten(), minlength=cfg.num_experts))
    g, u = torch.einsum("nh,eih->eni", flat, p[f"{prefix}.experts.w13"]).chunk(2, dim=-1)
    y = torch.einsum("eni,ehi->enh", F.silu(g) * u, p[f"{prefix}.experts.w2"])
    out = torch.einsum("ne,enh->nh", combine, y)
    if cfg.num_shared_experts:
        out = out + _swiglu(
            flat, p[f"{prefix}.shared_mlp.gate_up_proj.weight"], p[f"{prefix}.shared_mlp.down_proj.weight"]
        )
    return out.view(shape)


def _decoder_layer(
    x: Tensor,
    positions: Tensor,
    p: Mapping[str, Tensor],
    prefix: str,
    sparse: bool,
    cfg: Hy3Config,
    loads: list[Tensor] | None,
) -> Tensor:
    eps = cfg.rms_norm_eps
    x = x + _attention(
        _rms(x, p[f"{prefix}.input_layernorm.weight"], eps), positions, p, f"{prefix}.self_attn", cfg
    )
    h = _rms(x, p[f"{prefix}.post_attention_layernorm.weight"], eps)
    if sparse:
        return x + _moe(h, p, f"{prefix}.mlp", cfg, loads)
    return x + _swiglu(h, p[f"{prefix}.mlp.gate_up_proj.weight"], p[f"{prefix}.mlp.down_proj.weight"])


def train_forward(
    params: Mapping[str, Tensor], cfg: Hy3Config, ids: Tensor, loads: list[Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    """Main model over whole sequences ids [B, S] (positions 0..S-1) → (logits [B, S, V], post-norm
    hidden [B, S, H]). `loads` collects each MoE layer's expert counts (for the bias update)."""
    positions = torch.arange(ids.shape[1])
    x = F.embedding(ids, params["embed_tokens.weight"])
    for i, kind in enumerate(cfg.layer_types):
        x = _decoder_layer(x, positions, params, f"layers.{i}", kind == "sparse", cfg, loads)
    hidden = _rms(x, params["norm.weight"], cfg.rms_norm_eps)
    return F.linear(hidden, params["lm_head.weight"]), hidden


def train_mtp_forward(
    params: Mapping[str, Tensor],
    cfg: Hy3Config,
    next_ids: Tensor,
    hidden_prev: Tensor,
    loads: list[Tensor] | None = None,
    depth: int = 0,
) -> tuple[Tensor, Tensor]:
    """MTP depth `depth` at positions 0..S-1: next_ids [B, S] (x_{t+1}), hidden_prev [B, S, H] (h_t) →
    (logits [B, S, V] predicting x_{t+2}, hidden). The embedding is zeroed at position 0, as in
    `Hy3ForCausalLM.mtp_forward`."""
    m, eps = f"mtp.{depth}", cfg.rms_norm_eps
    positions = torch.arange(next_ids.shape[1])
    e = F.embedding(next_ids, params["embed_tokens.weight"])
    e = torch.where((positions == 0)[None, :, None], torch.zeros_like(e), e)
    x = torch.cat(
        [_rms(e, params[f"{m}.enorm.weight"], eps), _rms(hidden_prev, params[f"{m}.hnorm.weight"], eps)], -1
    )
    x = F.linear(x, params[f"{m}.eh_proj.weight"])
    x = _decoder_layer(x, positions, params, f"{m}.layer", True, cfg, loads)
    hidden = _rms(x, params[f"{m}.final_layernorm.weight"], eps)
    return F.linear(hidden, params["lm_head.weight"]), hidden


# ---- training ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _deterministic_torch(threads: int) -> Iterator[None]:
    """Deterministic algorithms on and a fixed intra-op thread count inside the block; both restored."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(was_threads)
        torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)


def _learning_rate(step: int, steps: int) -> float:
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(steps - WARMUP_STEPS, 1)
    return PEAK_LR * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def _batches(stream: Tensor, steps: int, gen: torch.Generator) -> Iterator[Tensor]:
    """`steps` batches of BATCH windows of SEQ_LEN + 2 tokens at seeded random offsets."""
    span = SEQ_LEN + 2
    if stream.numel() < span:
        raise TrainError(f"the training text has {stream.numel()} tokens, fewer than one window ({span})")
    offsets = torch.arange(span)
    for _ in range(steps):
        starts = torch.randint(0, stream.numel() - span + 1, (BATCH,), generator=gen)
        yield stream[starts[:, None] + offsets]


def train_parameters(
    config: Hy3Config, stream: Tensor, steps: int, seed: int, progress: bool = True
) -> tuple[dict[str, Tensor], float, float]:
    """Train from seed on the token stream → (weights, final main loss, final MTP loss)."""
    gen = torch.Generator().manual_seed(seed)
    params = init_parameters(config, gen)
    biases = {n for n in params if n.endswith("expert_bias")}
    trainable = {n: t.requires_grad_() for n, t in params.items() if n not in biases}
    decay = [t for n, t in trainable.items() if t.dim() >= 2 and n != "embed_tokens.weight"]
    no_decay = [t for n, t in trainable.items() if not (t.dim() >= 2 and n != "embed_tokens.weight")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=PEAK_LR,
        betas=BETAS,
        foreach=False,
    )
    moe_prefixes = [f"layers.{i}.mlp" for i, k in enumerate(config.layer_types) if k == "sparse"]
    moe_prefixes += [f"mtp.{d}.layer.mlp" for d in range(config.num_nextn_predict_layers)]
    recent: list[tuple[float, float]] = []
    bar = tqdm(total=steps, desc="training tiny hy3", unit="step", disable=not progress)
    for step, window in enumerate(_batches(stream, steps, gen)):
        for group in opt.param_groups:
            group["lr"] = _learning_rate(step, steps)
        loads: list[Tensor] = []
        logits, hidden = train_forward(params, config, window[:, :SEQ_LEN], loads)
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1 : SEQ_LEN + 1].flatten())
        mtp_logits, _ = train_mtp_forward(params, config, window[:, 1 : SEQ_LEN + 1], hidden.detach(), loads)
        mtp_loss = F.cross_entropy(mtp_logits.flatten(0, 1), window[:, 2:].flatten())
        opt.zero_grad(set_to_none=True)
        (loss + MTP_LOSS_WEIGHT * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_(list(trainable.values()), GRAD_CLIP, foreach=False)
        opt.step()
        with torch.no_grad():
            for prefix, load in zip(moe_prefixes, loads):
                load = load.float()
                params[f"{prefix}.expert_bias"] += BIAS_UPDATE_RATE * torch.sign(load.mean() - load)
        recent = [*recent[-9:], (loss.item(), mtp_loss.item())]
        bar.set_postfix(loss=f"{loss.item():.3f}", mtp=f"{mtp_loss.item():.3f}", refresh=False)
        bar.update(1)
    bar.close()
    weights = {n: t.detach().clone() for n, t in params.items()}
    return weights, float(np.mean([r[0] for r in recent])), float(np.mean([r[1] for r in recent]))


def write_checkpoint(directory: Path, config: Hy3Config, weights: Mapping[str, Tensor]) -> int:
    """Write `weights` (hy3c parameter names) into `directory` as hub-named safetensors; return bytes."""
    writer = ShardedWriter(directory)
    for name, place in expected_tensors(config, "hub").items():
        full = weights[place.target]
        writer.add(name, (full[place.index()] if place.region else full).clone())
    writer.close()
    return writer.total_bytes


def train_tiny(
    out_dir: Path, steps: int = DEFAULT_STEPS, seed: int = 0, progress: bool = True, overwrite: bool = False
) -> TrainReport:
    """Train the tiny model for `steps` steps from `seed` and write it to `out_dir` (atomically: a
    temporary directory beside it is renamed into place only when everything is written)."""
    if steps < 1:
        raise TrainError(f"steps must be at least 1, got {steps}")
    start = time.perf_counter()
    out_dir = Path(out_dir)
    train_files, heldout_files = stdlib_files()
    with atomic_output_dir(out_dir, overwrite) as tmp:
        base = trained_config()
        token_ids = write_tokenizer_files(tmp, base.vocab_size, base.max_position_embeddings)
        config = preset_config("tiny", **{**CONFIG_OVERRIDES, **token_ids})
        write_config_files(tmp, config)
        stream = _token_stream(Tokenizer.from_file(str(tmp / "tokenizer.json")), _read(train_files))
        with _deterministic_torch(THREADS):
            weights, loss, mtp_loss = train_parameters(config, stream, steps, seed, progress)
        size = write_checkpoint(tmp, config, weights)
    return TrainReport(
        path=out_dir,
        steps=steps,
        seed=seed,
        seconds=time.perf_counter() - start,
        train_tokens=int(stream.numel()),
        train_files=len(train_files),
        heldout_files=len(heldout_files),
        final_loss=loss,
        final_mtp_loss=mtp_loss,
        checkpoint_bytes=size,
    )


# ---- evaluation with the real inference model ----------------------------------------------------------


def _eval_windows(model_dir: Path, text_or_files: str | Sequence[Path], max_tokens: int) -> list[list[int]]:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = [text_or_files] if isinstance(text_or_files, str) else _read(text_or_files)
    windows: list[list[int]] = []
    budget = max_tokens
    for enc in tok.encode_batch(texts):
        ids = enc.ids
        for i in range(0, len(ids) - 2, SEQ_LEN):
            window = ids[i : i + SEQ_LEN][:budget]
            if len(window) >= 3:
                windows.append(window)
                budget -= len(window)
            if budget < 3:
                return windows
    return windows


def evaluate(
    model_dir: str | Path, text_or_files: str | Sequence[Path] | None = None, max_tokens: int = 8192
) -> EvalReport:
    """Teacher-forced greedy K=1 measurements of the checkpoint at `model_dir` on held-out text (a
    string, or files; default: the held-out stdlib files), windows of SEQ_LEN tokens each starting at
    position 0, at most `max_tokens` tokens. Runs the real `Hy3ForCausalLM.forward` and `mtp_forward`
    (fp32) over a paged KV cache, as speculative decoding does."""
    model_dir = Path(model_dir)
    if text_or_files is None:
        text_or_files = stdlib_files()[1]
    windows = _eval_windows(model_dir, text_or_files, max_tokens)
    if not windows:
        raise TrainError("evaluation text has fewer than 3 tokens")
    model = load_model(model_dir, dtype=torch.float32, progress=False)
    page_size = 16
    pages = list(range(-(-SEQ_LEN // page_size)))
    accepted = main_hits = mtp_hits = total = 0
    with torch.no_grad():
        for ids in windows:
            kv = allocate_kv_cache(model.config, len(pages), page_size, torch.float32)
            batch = build_step_batch([SeqChunk(ids, 0, pages, "all")], page_size)
            logits, hidden = model(*batch.model_args(kv))
            mtp = build_step_batch([SeqChunk(ids[1:], 0, pages, "all")], page_size)
            mtp_logits, _ = model.mtp_forward(
                mtp.input_ids,
                mtp.positions,
                hidden[:-1],
                kv,
                mtp.page_table,
                mtp.seq_lens,
                mtp.query_start_loc,
                mtp.slot_mapping,
                mtp.logits_indices,
            )
            target = torch.tensor(ids)
            main_pred, mtp_pred = logits.argmax(-1), mtp_logits.argmax(-1)
            accepted += int((mtp_pred == main_pred[1:]).sum())
            main_hits += int((main_pred[:-1] == target[1:]).sum())
            mtp_hits += int((mtp_pred[:-1] == target[2:]).sum())
            total += len(ids) - 1
    n_mtp_scored = total - len(windows)  # MTP positions whose x_{t+2} lies inside the window
    return EvalReport(
        acceptance=accepted / total,
        main_accuracy=main_hits / total,
        mtp_accuracy=mtp_hits / max(n_mtp_scored, 1),
        positions=total,
    )


def mtp_acceptance(
    model_dir: str | Path, text_or_files: str | Sequence[Path] | None = None, max_tokens: int = 8192
) -> float:
    """Greedy K=1 MTP acceptance on held-out text: the fraction of positions t where the MTP's argmax at
    t equals the main model's argmax at t+1 (see `evaluate`)."""
    return evaluate(model_dir, text_or_files, max_tokens).acceptance


def cache_key() -> str:
    """A hash of what determines the trained weights: this module's and the tokenizer's sources, the
    tokenizer corpus, and the torch, tokenizers and Python versions (the stdlib text is the corpus)."""
    digest = hashlib.sha256()
    package = resources.files("hy3c.checkpoint")
    for name in ("train_tiny.py", "tiny_tokenizer.py", "tiny_corpus.txt"):
        digest.update(package.joinpath(name).read_bytes())
    for version in (torch.__version__, tokenizers.__version__, sys.version):
        digest.update(version.encode())
    return digest.hexdigest()[:16]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hy3c.checkpoint.train_tiny",
        description="Train the tiny Hy3 checkpoint on the Python standard library and report held-out "
        "MTP acceptance.",
    )
    parser.add_argument("--out", required=True, type=Path, help="checkpoint directory to write")
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"training steps (default {DEFAULT_STEPS})"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of initialisation and data order (default 0)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        report = train_tiny(args.out, args.steps, args.seed, not args.no_progress, args.overwrite)
        result = evaluate(report.path)
    except (TrainError, FileExistsError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {report.path} ({report.checkpoint_bytes / 2**20:.1f} MiB) in {report.seconds:.0f} s: "
        f"{report.steps} steps on {report.train_tokens} tokens of {report.train_files} files, "
        f"final loss {report.final_loss:.3f}, MTP loss {report.final_mtp_loss:.3f}"
    )
    print(
        f"held-out ({report.heldout_files} files, {result.positions} positions): MTP acceptance "
        f"{result.acceptance:.3f}, main next-token accuracy {result.main_accuracy:.3f}, MTP accuracy on the "
        f"token after next {result.mtp_accuracy:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

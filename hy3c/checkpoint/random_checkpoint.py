"""Write a random Hy3 checkpoint in the real Hugging Face layout (`hy3c init-checkpoint`).

The directory gets `config.json`, safetensors weights (sharded above `max_shard_bytes`, with
`model.safetensors.index.json`), `generation_config.json` and the tiny tokenizer files. Tensors are
generated one model tensor at a time from a seed derived from (seed, tensor name), so the same seed gives
the same model in either naming scheme; memory stays at one shard plus one tensor. The directory is
written atomically.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from hy3c.checkpoint.safetensors_io import ShardedWriter, atomic_output_dir
from hy3c.checkpoint.tiny_tokenizer import write_tokenizer_files
from hy3c.checkpoint.weight_map import Placement, Scheme, expected_tensors
from hy3c.config import Hy3Config, preset_config
from hy3c.logs import log_event
from hy3c.model.hy3 import Hy3ForCausalLM

log = logging.getLogger("hy3c.checkpoint.random_checkpoint")

NORM_NOISE = 0.1
EXPERT_BIAS_STD = 0.02


def _random_tensor(
    name: str, shape: torch.Size, dtype: torch.dtype, seed: int, std: float, device: str
) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith("norm.weight"):
        t = 1.0 + NORM_NOISE * torch.randn(shape, generator=gen, device=device)
    elif name.endswith("expert_bias"):
        t = EXPERT_BIAS_STD * torch.randn(shape, generator=gen, device=device)
    else:
        t = std * torch.randn(shape, generator=gen, device=device)
    return t.to(dtype)


def random_checkpoint_tensors(
    config: Hy3Config, scheme: Scheme, seed: int, device: str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) pairs of a random model, one model tensor generated at a time."""
    dtype = getattr(torch, config.dtype)
    shapes = Hy3ForCausalLM(config, dtype=dtype, device="meta")
    by_target: dict[str, list[tuple[str, Placement]]] = {}
    for name, place in expected_tensors(config, scheme).items():
        by_target.setdefault(place.target, []).append((name, place))
    for target, param in shapes.named_parameters():
        if target not in by_target:
            continue
        full = _random_tensor(target, param.shape, param.dtype, seed, config.initializer_range, device)
        for name, place in by_target[target]:
            yield name, (full[place.index()] if place.region else full).clone()


def write_config_files(directory: Path, config: Hy3Config) -> None:
    (directory / "config.json").write_text(json.dumps(config.to_json_dict(), indent=2))
    generation = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "do_sample": True,
        "temperature": 0.9,
        "top_p": 1.0,
        "transformers_version": config.transformers_version,
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))


def init_checkpoint(
    preset: str,
    out: str | Path,
    seed: int = 0,
    scheme: Scheme = "hub",
    max_shard_bytes: int = 4 << 30,
    overwrite: bool = False,
    device: str = "cpu",
    **config_overrides: object,
) -> Path:
    """Write a random checkpoint of `preset` (tiny, real-shapes:N, full) to `out`."""
    out = Path(out)
    with atomic_output_dir(out, overwrite) as tmp:
        base = preset_config(preset, **config_overrides)
        token_ids = write_tokenizer_files(tmp, base.vocab_size, base.max_position_embeddings)
        config = preset_config(preset, **{**config_overrides, **token_ids})
        write_config_files(tmp, config)
        writer = ShardedWriter(tmp, max_shard_bytes)
        total = len(expected_tensors(config, scheme))
        with tqdm(total=total, desc=f"writing {preset}", unit="tensor", disable=None) as bar:
            for name, tensor in random_checkpoint_tensors(config, scheme, seed, device):
                writer.add(name, tensor)
                bar.update(1)
        files = writer.close()
    log_event(
        log,
        "checkpoint_written",
        path=str(out),
        preset=preset,
        scheme=scheme,
        seed=seed,
        tensors=total,
        files=len(files),
        gib=writer.total_bytes / 2**30,
    )
    return out


def random_model(config: Hy3Config, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> Hy3ForCausalLM:
    """The model `init_checkpoint` would write, built directly in memory (benchmarks at real shapes)."""
    model = Hy3ForCausalLM(config, dtype=dtype, device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "kv_scales":
                param.fill_(1.0)
            else:
                param.copy_(
                    _random_tensor(name, param.shape, param.dtype, seed, config.initializer_range, device)
                )
    return model.eval()

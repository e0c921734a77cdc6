"""Load a Hy3 checkpoint directory into `Hy3ForCausalLM`, one tensor at a time.

    model = load_model("ckpt/", dtype=torch.float32)

1. `config.json` → `Hy3Config`; the weight files' headers are read (no data).
2. The naming scheme (hub or transformers, see `hy3c.checkpoint.weight_map`) and the FP8 layout (which linear
   layers carry e4m3 weights, static or dynamic activation scales) are read off the headers.
3. Every expected tensor is checked before any data is read: missing, unexpected (unless allow-listed)
   and mis-shaped or wrongly typed tensors are reported together, by name, in one `CheckpointError`.
4. The model is allocated empty on the target device and every tensor is streamed into its slot
   (fused qkv / gate_up rows, stacked expert slices, per-channel FP8 scales), so peak memory is the model
   plus one checkpoint tensor.
5. C8 KV scales come from `kv_cache_scales.safetensors` when present (else 1.0).
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from hy3c.checkpoint.int4_format import words_to_packed
from hy3c.checkpoint.safetensors_io import CheckpointError, CheckpointFiles, read_headers
from hy3c.checkpoint.weight_map import (
    Placement,
    Scheme,
    detect_scheme,
    expected_tensors,
    fp8_module_of,
    kv_scale_tensors,
)
from hy3c.config import Hy3Config
from hy3c.logs import log_event
from hy3c.model.hy3 import Hy3ForCausalLM
from hy3c.model.layers import QuantLayout

log = logging.getLogger("hy3c.checkpoint.loader")

KV_SCALES_FILE = "kv_cache_scales.safetensors"
_FLOAT_DTYPES = {"BF16", "F16", "F32"}
_MAX_LISTED = 12


@dataclass
class CheckpointLayout:
    """What a checkpoint holds, read from its headers."""

    config: Hy3Config
    files: CheckpointFiles
    scheme: Scheme
    quant: QuantLayout
    expected: dict[str, Placement]
    ignored: list[str] = field(default_factory=list)


def _torch_dtype(name: str) -> torch.dtype:
    try:
        return getattr(torch, name)
    except AttributeError:
        raise ValueError(f"unknown dtype '{name}'") from None


def _int4_experts(config: Hy3Config, files: CheckpointFiles, scheme: Scheme) -> tuple[frozenset[str], int]:
    """The expert stacks a compressed-tensors W4A8 checkpoint packs as int4, and its group size."""
    packed = [n for n in files.headers if n.endswith(".weight_packed")]
    qc = config.quantization_config
    group = qc.w4a8_group_size if qc is not None else None
    if not packed:
        if group is not None:
            raise CheckpointError(
                f"{files.root}: quantization_config is compressed-tensors W4A8 but no tensor is *.weight_packed"
            )
        return frozenset(), 0
    if group is None:
        raise CheckpointError(
            f"{files.root}: int4 tensors (*.weight_packed) need a compressed-tensors W4A8 quantization_config"
        )
    if scheme != "hub":
        raise CheckpointError(f"{files.root}: W4A8 weights are supported in the hub naming scheme only")
    modules = set()
    for name in packed:
        module = fp8_module_of(name, config)
        if module is None or not module.endswith(".mlp.experts"):
            raise CheckpointError(
                f"{files.root}: int4 tensor '{name}' is not a routed expert's weight (hy3c runs int4 experts only)"
            )
        modules.add(module)
    for dim, what in (
        (config.hidden_size, "hidden_size"),
        (config.moe_intermediate_size, "moe_intermediate_size"),
    ):
        if dim % group or dim % 8:
            raise CheckpointError(
                f"{files.root}: group_size {group} (or 8 columns per int32 word) does not divide {what} {dim}"
            )
    return frozenset(modules), group


def _quant_layout(config: Hy3Config, files: CheckpointFiles, scheme: Scheme) -> QuantLayout:
    int4, group = _int4_experts(config, files, scheme)
    fp8_names = [n for n, h in files.headers.items() if h.dtype == "F8_E4M3"]
    if not fp8_names:
        return QuantLayout(int4_experts=int4, group_size=group)
    if scheme != "hub":
        raise CheckpointError(f"{files.root}: FP8 weights are supported in the hub naming scheme only")
    modules = set()
    for name in fp8_names:
        module = fp8_module_of(name, config)
        if module is None:
            raise CheckpointError(
                f"{files.root}: FP8 tensor '{name}' is not a linear weight hy3c runs in FP8"
            )
        modules.add(module)
    qc = config.quantization_config
    if qc is not None:
        static = qc.activation_scheme == "static"  # (ModelOpt's FP8: always)
    else:
        static = any(n.endswith(".input_scale") for n in files.headers)
    return QuantLayout(frozenset(modules), static, int4, group)


def inspect_checkpoint(
    path: str | Path, with_mtp: bool = True, ignore_unexpected: Iterable[str] = ()
) -> CheckpointLayout:
    """Read config and headers and validate every tensor name, shape and dtype (no tensor data read)."""
    config = Hy3Config.from_dir(path)
    files = CheckpointFiles.open(path)
    scheme = detect_scheme(set(files.headers))
    quant = _quant_layout(config, files, scheme)
    expected = expected_tensors(
        config,
        scheme,
        quant.fp8_modules,
        quant.static_activations,
        with_mtp,
        quant.int4_experts,
        quant.group_size,
    )
    fp8_targets = {p.target for p in expected.values() if p.target.rsplit(".", 1)[0] in quant.fp8_modules}
    fp8_targets |= {f"{m}.{w}" for m in quant.fp8_modules for w in ("w13", "w2")}

    patterns = list(ignore_unexpected)
    if not with_mtp:
        patterns += [
            f"model.layers.{config.num_hidden_layers + d}.*" for d in range(config.num_nextn_predict_layers)
        ]
    present = set(files.headers)
    missing = sorted(set(expected) - present, key=_natural)
    extra = sorted(present - set(expected), key=_natural)
    ignored = [n for n in extra if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    unexpected = [n for n in extra if n not in set(ignored)]
    bad: list[str] = []
    for name in sorted(present & set(expected), key=_natural):
        header, place = files.headers[name], expected[name]
        problem = _check_tensor(header.shape, header.dtype, place, place.target in fp8_targets)
        if problem:
            bad.append(f"{name}: {problem}")
    problems = []
    for title, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped or mistyped", bad)):
        if names:
            listed = "\n    ".join(names[:_MAX_LISTED])
            more = f"\n    ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
            problems.append(f"  {len(names)} {title} tensor(s):\n    {listed}{more}")
    if problems:
        hint = (
            "\n  (unused tensors can be allowed with ignore_unexpected / --ignore-unexpected PATTERN)"
            if unexpected
            else ""
        )
        raise CheckpointError(
            f"{files.root}: checkpoint does not match its config ({scheme} naming):\n"
            + "\n".join(problems)
            + hint
        )
    return CheckpointLayout(config, files, scheme, quant, expected, ignored)


def _check_tensor(shape: tuple[int, ...], dtype: str, place: Placement, fp8_target: bool) -> str | None:
    numel = 1
    for s in shape:
        numel *= s
    if place.mode in ("int4", "shape"):
        dtypes = {"int4": {"I32"}, "shape": {"I32", "I64"}}[place.mode]
        if shape != place.shape or dtype not in dtypes:
            return f"{dtype} {list(shape)}, expected {'/'.join(sorted(dtypes))} {list(place.shape)}"
        return None
    if place.mode == "copy":
        if shape != place.shape:
            return f"shape {list(shape)}, expected {list(place.shape)}"
        if fp8_target and dtype != "F8_E4M3":
            return f"dtype {dtype}, expected F8_E4M3 (its fused/stacked siblings are FP8)"
        if not fp8_target and dtype not in _FLOAT_DTYPES:
            return f"dtype {dtype}, expected one of {sorted(_FLOAT_DTYPES)}"
        return None
    if dtype not in _FLOAT_DTYPES:
        return f"dtype {dtype}, expected a float scale"
    allowed = {1, place.shape[0]} if place.shape else {1}
    if numel not in allowed or len(shape) > 2:
        return f"shape {list(shape)}, expected a per-tensor scale [1] or {list(place.shape)}"
    return None


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in name.replace("_", ".").split(".")]


def _place(target: torch.Tensor, place: Placement, src: torch.Tensor, first: bool, name: str) -> None:
    view = target[place.index()] if place.region else target
    if place.mode == "shape":
        if tuple(src.tolist()) != place.values:
            raise CheckpointError(f"{name}: {src.tolist()}, expected {list(place.values)}")
    elif place.mode == "int4":
        view.copy_(words_to_packed(src))
    elif place.mode == "copy":
        view.copy_(src)
    elif place.mode == "scale":
        view.copy_(
            src.reshape(-1).to(torch.float32).expand(view.shape)
            if src.numel() == 1
            else src.reshape(view.shape)
        )
    else:
        value = src.to(torch.float32).reshape(-1).max().reshape(1).expand(view.shape)
        if first:
            view.copy_(value)
        else:
            torch.maximum(view, value, out=view)


def assemble_tensors(
    layout: CheckpointLayout, shapes: dict[str, torch.Tensor], kv_root: Path | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (model tensor name, CPU tensor) for every entry of `shapes` (name → tensor giving shape and
    dtype, e.g. a meta model's parameters), each assembled from its checkpoint tensors when needed:
    fused q/k/v and gate/up rows, stacked experts, expanded per-tensor FP8 scales. `kv_scales` comes
    from `kv_cache_scales.safetensors` under `kv_root` (1.0 without one, for a checkpoint with no static
    KV scheme)."""
    sources: dict[str, list[tuple[str, Placement]]] = {}
    for name, place in layout.expected.items():
        sources.setdefault(place.target, []).append((name, place))
    with layout.files.reader() as read:
        for target, like in shapes.items():
            out = torch.empty(like.shape, dtype=like.dtype)
            if target == "kv_scales":  # AngelSlim's own file, or ModelOpt's k_scale / v_scale (below)
                out.fill_(1.0)
                _load_kv_scales(kv_root, layout.config, out)
            seen: set[tuple] = set()
            for name, place in sources.get(target, []):
                key = (place.region, place.mode)
                _place(out, place, read(name), key not in seen, name)
                seen.add(key)
            yield target, out
            del out  # keep at most one assembled tensor alive (with the consumer's reference)


def _check_coverage(model: Hy3ForCausalLM, expected: dict[str, Placement]) -> None:
    """Every model tensor except kv_scales must be written completely by the expected placements."""
    tensors = dict(model.named_parameters())
    written: dict[str, int] = {}
    shared_regions: set[tuple[str, tuple]] = set()
    for place in expected.values():
        if place.mode == "shape":
            continue
        if place.mode == "max":
            if (place.target, place.region) in shared_regions:
                continue
            shared_regions.add((place.target, place.region))
        n = place.region_numel(tuple(tensors[place.target].shape))
        written[place.target] = written.get(place.target, 0) + n
    for name, tensor in tensors.items():
        if name != "kv_scales" and written.get(name, 0) != tensor.numel():
            raise RuntimeError(
                f"hy3c bug: weight map writes {written.get(name, 0)} of {tensor.numel()} elements of {name}"
            )


def load_model(
    path: str | Path,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    with_mtp: bool = True,
    ignore_unexpected: Iterable[str] = (),
    progress: bool | None = None,
) -> Hy3ForCausalLM:
    """Build `Hy3ForCausalLM` from a checkpoint directory (see the module docstring)."""
    start = time.perf_counter()
    layout = inspect_checkpoint(path, with_mtp, ignore_unexpected)
    config = layout.config
    if not with_mtp:
        config = config.model_copy(update={"num_nextn_predict_layers": 0})
    if isinstance(dtype, str):
        dtype = _torch_dtype(dtype)
    model = Hy3ForCausalLM(
        config, dtype=dtype or _torch_dtype(config.dtype), device=device, quant=layout.quant
    )
    _check_coverage(model, layout.expected)
    params = dict(model.named_parameters())
    loaded_bytes = 0
    disable = None if progress is None else not progress
    with (
        torch.no_grad(),
        tqdm(total=len(params), desc="loading weights", unit="tensor", disable=disable) as bar,
    ):
        for name, tensor in assemble_tensors(layout, params, Path(path)):
            params[name].copy_(tensor)
            loaded_bytes += tensor.numel() * tensor.element_size()
            del tensor
            bar.update(1)
    model.eval()
    log_event(
        log,
        "checkpoint_loaded",
        path=str(path),
        scheme=layout.scheme,
        tensors=len(layout.expected),
        gib=loaded_bytes / 2**30,
        fp8_modules=len(layout.quant.fp8_modules),
        int4_expert_stacks=len(layout.quant.int4_experts),
        static_activations=layout.quant.static_activations,
        ignored=len(layout.ignored),
        seconds=time.perf_counter() - start,
    )
    return model


def _load_kv_scales(root: Path | None, config: Hy3Config, out: torch.Tensor) -> None:
    """Fill kv_scales [layers, 2] from kv_cache_scales.safetensors: required, and complete, when the
    config says `kv_cache_scheme: static` (AngelSlim's layout); rows of an MTP layer the model does not
    hold are skipped."""
    if root is None:
        return
    file = root / KV_SCALES_FILE
    quant = config.quantization_config
    static = quant is not None and quant.kv_scales_file
    if not file.is_file():
        if static:
            raise CheckpointError(f"{file}: missing (quantization_config.kv_cache_scheme is 'static')")
        return
    headers = read_headers(file)
    expected = kv_scale_tensors(config)
    problems = []
    for name, header in headers.items():
        problem = (
            _check_tensor(header.shape, header.dtype, expected[name], False) if name in expected else None
        )
        if problem:
            problems.append(f"{name}: {problem}")
    problems += [f"unexpected tensor {n}" for n in sorted(set(headers) - set(expected), key=_natural)]
    missing = [n for n in set(expected) - set(headers) if expected[n].region[0] < out.shape[0]]
    problems += [f"missing tensor {n}" for n in sorted(missing, key=_natural)]
    if problems:
        raise CheckpointError(f"{file}: " + "; ".join(problems[:_MAX_LISTED]))
    with CheckpointFiles(root, headers).reader() as read:
        for name in headers:
            place = expected[name]
            if place.region[0] < out.shape[0]:
                _place(out, place, read(name), True, name)

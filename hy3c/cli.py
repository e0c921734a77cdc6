"""The `hy3c` command line.

    hy3c init-checkpoint --preset tiny --seed 0 --out ckpt/        random Hy3 checkpoint (HF layout)
    hy3c convert-fp8 --model ckpt/ --out ckpt-fp8/                 BF16 → FP8 W8A8C8 hub format
    hy3c convert-w4a8 --model ckpt/ --out ckpt-w4a8/               BF16 → int4 experts (GPTQ), W4A8
    hy3c generate --model ckpt/ --prompt "Hello" --max-tokens 32   offline, through the serving engine
    hy3c compile --model ckpt/ --recipe h20-w8a8c8 --out art/       trace + passes + package
    hy3c inspect art/ passes|ops|graph|diff|why-not|cache-key      what every pass did
    hy3c serve art/ --port 8000                                    OpenAI-compatible server
    torchrun --nnodes 2 --nproc-per-node 8 ... -m hy3c serve art/  an artifact for 16 ranks on 2 hosts
    hy3c bench serve --base-url http://127.0.0.1:8000              load it; TTFT / TPOT / ITL / E2E
    hy3c demo                                                      end to end on a tiny model

Every command exits with status 2 and a one-line `error: ...` message (no traceback) on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from hy3c.logs import setup_logging
from hy3c.recipe import SHIPPED, load_recipe

_DTYPES = ("bfloat16", "float16", "float32")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(text: str) -> str:
    """argparse type of --log-level: a level name in any case (argparse turns the error into one line)."""
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"unknown level {text!r}; choose one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def _existing_dir(path: Path, flag: str) -> Path:
    """A directory argument that must exist: checked before anything heavy is imported or loaded."""
    if not path.exists():
        raise FileNotFoundError(f"{flag} {path}: the directory does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"{flag} {path}: not a directory")
    return path


def _add_init_checkpoint(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init-checkpoint", help="write a random Hy3 checkpoint in the Hugging Face layout")
    p.add_argument("--preset", default="tiny", help="tiny | real-shapes:N | full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--scheme", choices=("hub", "transformers"), default="hub", help="tensor naming scheme")
    p.add_argument("--fp8", choices=("static", "dynamic"), help="also quantize to the FP8 W8A8C8 format")
    p.add_argument("--max-shard-gib", type=float, default=4.0)
    p.add_argument("--device", default="cpu", help="device that generates the random tensors")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_run_init_checkpoint)


def _add_checkpoint_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ignore-unexpected",
        action="append",
        default=[],
        metavar="PATTERN",
        help="leave checkpoint tensors matching this fnmatch pattern unused (repeatable)",
    )
    p.add_argument("--no-mtp", action="store_true", help="the checkpoint's MTP layer is absent or unused")


def _run_init_checkpoint(args: argparse.Namespace) -> None:
    from hy3c.checkpoint.random_checkpoint import init_checkpoint

    shard = int(args.max_shard_gib * 2**30)
    if args.fp8 is not None and args.scheme != "hub":
        raise ValueError("--fp8 writes the hub naming (FP8: docs/ARCHITECTURE.md §1.7); drop --scheme")
    if args.fp8 is None:
        init_checkpoint(args.preset, args.out, args.seed, args.scheme, shard, args.overwrite, args.device)
    else:
        with tempfile.TemporaryDirectory(dir=args.out.parent if args.out.parent.exists() else None) as tmp:
            bf16 = Path(tmp) / "bf16"
            init_checkpoint(args.preset, bf16, args.seed, "hub", shard, False, args.device)
            _convert(
                bf16,
                args.out,
                args.fp8,
                args.seed,
                args.overwrite,
                args.device,
                shard,
                True,
                [],
                "angelslim",
                calibrator="absmax",  # random weights for benchmarks: no ModelOpt needed where they run
            )
    print(args.out)


def _convert(
    src: Path,
    out: Path,
    scheme: str,
    seed: int,
    overwrite: bool,
    device: str,
    shard: int,
    with_mtp: bool,
    ignore_unexpected: list[str],
    layout: str,
    calibrate: Path | None = None,
    calibration_tokens: int | None = None,
    calibrator: str = "modelopt",
) -> None:
    """`convert-fp8`: calibrated on the text of `calibrate` (None: the default text), at most
    `calibration_tokens` tokens; without `calibration_tokens`, on random tokens drawn from `seed` (the
    random checkpoints of `init-checkpoint --fp8`)."""
    from hy3c.checkpoint.fp8_convert import convert_to_fp8
    from hy3c.checkpoint.safetensors_io import check_output_dir

    if layout == "modelopt" and scheme != "static":
        raise ValueError("--layout modelopt: ModelOpt's FP8 format has static activation scales only")
    check_output_dir(out, overwrite, inputs=[src])  # before loading and calibrating the model
    windows = None
    if calibration_tokens is not None:
        from hy3c.checkpoint.calibration_data import calibration_windows
        from hy3c.checkpoint.tokenizer import Hy3Tokenizer

        windows = calibration_windows(Hy3Tokenizer.from_dir(src), calibrate, calibration_tokens)
    convert_to_fp8(
        src,
        out,
        scheme,
        calibration=windows,
        seed=seed,
        overwrite=overwrite,
        max_shard_bytes=shard,
        layout=layout,
        calibrator=calibrator,
        device=device,
        with_mtp=with_mtp,
        ignore_unexpected=ignore_unexpected,
    )


def _add_convert_fp8(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert-fp8", help="quantize a BF16 Hy3 checkpoint into the FP8 W8A8C8 hub format")
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--activation", choices=("static", "dynamic"), default="static")
    p.add_argument(
        "--layout",
        choices=("angelslim", "modelopt"),
        default="angelslim",
        help="AngelSlim's layout (as tencent/Hy3-FP8 ships) or NVIDIA ModelOpt's HF export",
    )
    _add_calibration_options(
        p,
        "calibrate static scales on",
        ("absmax", "NVIDIA ModelOpt's FP8 post-training quantization (pip install -e '.[quant]'), or forward"
         " hooks taking the same absmax without it"),
    )  # fmt: skip
    p.set_defaults(func=_run_convert_fp8)


def _add_calibration_options(p: argparse.ArgumentParser, what: str, other: tuple[str, str]) -> None:
    """The options convert-fp8 and convert-w4a8 share: the calibration text and calibrator (modelopt, or
    `other` = (name, help of both)), the device, shards, overwrite and the checkpoint options."""
    p.add_argument(
        "--calibrate",
        type=Path,
        default=None,
        metavar="DATA",
        help=f"{what} this text or .jsonl file ({{'text': ...}} per line; default: the Python standard"
        " library's sources)",
    )
    p.add_argument("--calibrator", choices=("modelopt", other[0]), default="modelopt", help=other[1])
    p.add_argument(
        "--calibration-tokens",
        type=_positive_int,
        default=8192,
        help="tokens of calibration text at most (default: 8192)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-shard-gib", type=float, default=4.0)
    p.add_argument("--overwrite", action="store_true")
    _add_checkpoint_options(p)


def _run_convert_fp8(args: argparse.Namespace) -> None:
    _existing_dir(args.model, "--model")
    shard = int(args.max_shard_gib * 2**30)
    _convert(
        args.model,
        args.out,
        args.activation,
        0,
        args.overwrite,
        args.device,
        shard,
        not args.no_mtp,
        args.ignore_unexpected,
        args.layout,
        args.calibrate,
        args.calibration_tokens,
        args.calibrator,
    )
    print(args.out)


def _add_convert_w4a8(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert-w4a8",
        help="quantize a BF16 Hy3 checkpoint's routed experts to int4 (W4A8, compressed-tensors layout)",
    )
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--group-size", type=_positive_int, default=128, help="input columns per int4 scale")
    _add_calibration_options(
        p,
        "calibrate GPTQ on",
        ("rtn", "NVIDIA ModelOpt's GPTQ over the calibration text (pip install -e '.[quant]'), or"
         " round-to-nearest without data"),
    )  # fmt: skip
    p.set_defaults(func=_run_convert_w4a8)


def _run_convert_w4a8(args: argparse.Namespace) -> None:
    from hy3c.checkpoint.safetensors_io import check_output_dir
    from hy3c.checkpoint.w4a8_convert import convert_to_w4a8

    _existing_dir(args.model, "--model")
    check_output_dir(args.out, args.overwrite, inputs=[args.model])  # before calibrating
    windows = None
    if args.calibrator == "modelopt":
        from hy3c.checkpoint.calibration_data import calibration_windows
        from hy3c.checkpoint.tokenizer import Hy3Tokenizer

        tokenizer = Hy3Tokenizer.from_dir(args.model)
        windows = calibration_windows(tokenizer, args.calibrate, args.calibration_tokens)
    convert_to_w4a8(
        args.model,
        args.out,
        args.group_size,
        windows,
        args.calibrator,
        args.overwrite,
        int(args.max_shard_gib * 2**30),
        args.device,
        not args.no_mtp,
        args.ignore_unexpected,
    )
    print(args.out)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="generate text offline through the serving engine (eager model or compiled artifact)"
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="checkpoint directory (eager model)")
    source.add_argument("--artifact", type=Path, help="compiled artifact directory (hy3c compile)")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --artifact: run the program through torch.compile (default: off, as `hy3c serve`; it"
        " specializes on each step's token count)",
    )
    p.add_argument("--prompt", required=True, action="append", help="prompt text (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as a user turn")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--temperature",
        type=_non_negative_float,
        default=1.0,
        help="default 1.0, as the API's (OpenAI's and vLLM's); 0 = greedy",
    )
    p.add_argument("--top-p", type=_top_p, default=1.0, help="in (0, 1]; 1 = off")
    p.add_argument("--top-k", type=_non_negative_int, default=0, help="0 = off")
    p.add_argument("--min-p", type=_probability, default=0.0, help="in [0, 1]; 0 = off")
    p.add_argument("--seed", type=int, help="seed of each prompt's draws (as the API's `seed`)")
    p.add_argument("--dtype", choices=_DTYPES, help="default: the checkpoint's dtype")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument(
        "--page-size",
        type=_positive_int,
        help="tokens per KV page (default: the artifact recipe's; a recipe's default, 64, for --model)",
    )
    p.add_argument("--show-ids", action="store_true", help="print the generated token ids too")
    _add_engine_options(p)
    _add_rank_options(p)
    _add_checkpoint_options(p)
    p.set_defaults(func=_run_generate)


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    """The serving engine's flags that `generate` and `serve` share."""
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan and launch each step while the device runs the previous one (default: on)",
    )
    p.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='MTP speculative decoding, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\''
        ' (vLLM\'s spelling; "forced_acceptance": alpha is a benchmark mode)',
    )


def _add_rank_options(p: argparse.ArgumentParser) -> None:
    """The flags of running an artifact on its ranks: the collectives' timeout, random weights."""
    _add_collective_timeout(p)
    p.add_argument(
        "--random-weights",
        type=int,
        metavar="SEED",
        help="an artifact compiled from a config preset (no weights): run it with seeded random weights"
        " built on the device (benchmarks)",
    )


def _add_collective_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--collective-timeout",
        type=_positive_float,
        default=300.0,
        metavar="S",
        help="an artifact for several ranks: seconds the ranks' start, any collective and any wait for"
        " rank 0 may take before the run fails (default: 300)",
    )


def _torchrun_worker(args: argparse.Namespace, artifact: Path) -> bool:
    """Under torchrun, a rank other than 0 runs the worker loop instead of the command (every process
    runs the same command line); True when it did. Outside torchrun nothing is imported (a bad
    artifact or a busy port fails before torch loads)."""
    args.torchrun = None
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        return False
    from hy3c.runtime.distributed import torchrun_place

    place = args.torchrun = torchrun_place()
    if place is None or place.rank == 0:
        return False
    from datetime import timedelta

    from hy3c.runtime.distributed import run_worker

    timeout = timedelta(seconds=args.collective_timeout)
    run_worker(artifact, place, args.device, args.compile, timeout, False, args.random_weights)
    return True


def _run_generate(args: argparse.Namespace) -> None:
    """The prompts through the serving engine on this thread (`hy3c.serve.engine.offline`): the same loop,
    scheduler, page pool and sampler as `hy3c serve`, so a seeded request prints the server's text."""
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    if args.artifact is not None:
        _existing_dir(args.artifact, "--artifact")
        if _torchrun_worker(args, args.artifact):
            return
    else:
        _existing_dir(args.model, "--model")

    from hy3c.checkpoint.loader import load_model
    from hy3c.checkpoint.tokenizer import Hy3Tokenizer
    from hy3c.recipe import ServingSpec
    from hy3c.serve.engine.core import GenerationRequest
    from hy3c.serve.engine.offline import generate
    from hy3c.serve.engine.sampler import SamplingParams

    if args.artifact is not None:
        from datetime import timedelta

        from hy3c.runtime.distributed import start_ranks
        from hy3c.runtime.random_weights import artifact_tokenizer

        tokenizer = artifact_tokenizer(args.artifact, args.random_weights)  # before any rank starts
        timeout = timedelta(seconds=args.collective_timeout)
        model = start_ranks(
            args.artifact, args.device, args.compile, timeout, args.torchrun, args.random_weights
        )
        serving = model.recipe.serving
    else:
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        tokenizer = Hy3Tokenizer.from_dir(args.model)
        model = load_model(
            args.model,
            dtype=args.dtype,
            device=device,
            with_mtp=not args.no_mtp,
            ignore_unexpected=args.ignore_unexpected,
        )
        serving = ServingSpec()  # the eager model has no recipe: a recipe's defaults
    # as the API builds them: an oversized top_k is the whole vocabulary
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=min(args.top_k, model.config.vocab_size),
        min_p=args.min_p,
        seed=args.seed,
    )
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
        for p in args.prompt
    ]
    requests = [
        GenerationRequest(f"prompt-{i}", tokenizer.encode(text), params, args.max_tokens)
        for i, text in enumerate(texts)
    ]
    try:
        speculative = None
        if args.speculative_config is not None:
            from hy3c.serve.engine.spec_decode import parse_speculative_config

            layers = getattr(model, "num_draft_layers", 0)
            speculative = parse_speculative_config(args.speculative_config, layers)
        results = generate(
            model, tokenizer, requests, serving, args.page_size, args.async_scheduling, speculative
        )
    finally:
        shutdown = getattr(model, "shutdown", None)  # an artifact's ranks: the workers stop
        if shutdown is not None:
            shutdown()
    for result in results:
        print(result.text)
        if args.show_ids:
            print(" ".join(map(str, result.token_ids)))


def _add_compile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compile", help="trace + passes + quantize + package into an artifact directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="checkpoint directory")
    src.add_argument(
        "--preset",
        help="compile a config preset without weights (inspect it, or run it with --random-weights), e.g. full",
    )
    p.add_argument("--recipe", required=True, help=f"shipped recipe ({', '.join(SHIPPED)}) or a YAML file")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. quant.kv=bf16 or passes.lower.priority=[torch]",
    )
    p.add_argument("--dump-graphs", action="store_true", help="keep the graph after every pass in graphs/")
    p.add_argument("--max-shard-gib", type=float, default=4.0)
    p.add_argument("--overwrite", action="store_true")
    _add_checkpoint_options(p)
    p.set_defaults(func=_run_compile)


def _run_compile(args: argparse.Namespace) -> None:
    if args.model is not None:
        _existing_dir(args.model, "--model")
    recipe = load_recipe(args.recipe, args.overrides)  # a wrong name or key fails before the compiler loads

    from hy3c.compiler.driver import compile_artifact
    from hy3c.compiler.inspect_artifact import format_pass_table

    summary = compile_artifact(
        recipe,
        args.out,
        checkpoint=args.model,
        preset=args.preset,
        dump_graphs=args.dump_graphs,
        overwrite=args.overwrite,
        max_shard_bytes=int(args.max_shard_gib * 2**30),
        with_mtp=not args.no_mtp,
        ignore_unexpected=args.ignore_unexpected,
    )
    report = {"passes": [r.model_dump(mode="json") for r in summary.results]}
    print(format_pass_table(report))
    t = summary.timings
    print(
        f"\n{summary.out}: trace {t['trace_s']:.1f}s, passes {t['passes_s']:.1f}s, "
        f"package {t['package_s']:.1f}s, weights {summary.weights_bytes / 2**20:.1f} MiB"
    )


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show what the passes did to an artifact")
    p.add_argument("artifact", type=Path)
    p.add_argument("what", choices=("passes", "ops", "graph", "diff", "why-not", "cache-key"))
    p.add_argument("names", nargs="*", help="diff: PASS1 PASS2; why-not: PASS")
    p.add_argument("--after", help="ops / graph: the pass whose output to show ('traced' = before any pass)")
    p.add_argument("--layer", type=int, help="graph: only this decoder layer's nodes")
    p.add_argument("--node", help="why-not: the node name (as in the graph dumps)")
    p.set_defaults(func=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> None:
    _existing_dir(args.artifact, "artifact")
    from hy3c.compiler.inspect_artifact import inspect_command

    first = args.names[0] if args.names else None
    second = args.names[1] if len(args.names) > 1 else None
    if args.what == "diff" and second is None:
        raise ValueError("inspect diff needs two pass names: diff PASS1 PASS2")
    after = first if args.what == "why-not" else args.after
    print(
        inspect_command(
            args.artifact,
            args.what,
            after=after,
            layer=args.layer,
            first=first,
            second=second,
            node=args.node,
        ),
        end="",
    )
    print()


def _port(text: str) -> int:
    """argparse type of --port: 0 (any free port) to 65535; the socket layer would wrap a larger one."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0 to 65535)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0 to 65535)")
    return port


def _positive_int(text: str) -> int:
    """argparse type of a count or size of at least 1 (0 or less is no limit the server could keep)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {value})")
    return value


def _non_negative_int(text: str) -> int:
    """argparse type of a count where 0 means off (--top-k)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more (got {value})")
    return value


def _finite(text: str) -> float:
    """A number argparse reads, refusing inf and NaN (the sampling flags' common check)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not abs(value) < float("inf"):  # also NaN
        raise argparse.ArgumentTypeError(f"must be a finite number (got {text})")
    return value


def _non_negative_float(text: str) -> float:
    """argparse type of --temperature: a finite number, 0 or more."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more (got {text})")
    return value


def _json_object(flag: str):
    """argparse type of a flag that takes a JSON object."""

    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not JSON ({exc.msg} at character {exc.pos})") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"must be a JSON object (got {type(value).__name__})")
        return value

    parse.__name__ = flag  # argparse names the type in its error
    return parse


def _top_p(text: str) -> float:
    """argparse type of --top-p: the probability mass kept, in (0, 1]."""
    value = _finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1] (got {text})")
    return value


def _probability(text: str) -> float:
    """argparse type of --min-p: in [0, 1]."""
    value = _finite(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1] (got {text})")
    return value


def _positive_float(text: str) -> float:
    """argparse type of a time in seconds or a size in GiB: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0 (got {text})")
    return value


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a compiled artifact over an OpenAI-compatible HTTP API")
    p.add_argument("artifact", type=Path)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--served-model-name", help="model id in the API (default: the artifact directory name)")
    p.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' (all routes but /health, /metrics, /version)"
    )
    p.add_argument(
        "--max-num-seqs", type=_positive_int, help="requests in the running batch (default: the recipe's)"
    )
    p.add_argument(
        "--max-num-batched-tokens", type=_positive_int, help="tokens per engine step (default: the recipe's)"
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=_positive_int,
        help="a prompt chunk takes at most this many tokens a step, so running decodes keep their pace"
        " while long prompts come in (default: the step's budget)",
    )
    p.add_argument(
        "--max-num-partial-prefills",
        type=_positive_int,
        help="requests prefilling in one step at most (default: any number)",
    )
    p.add_argument(
        "--max-model-len",
        type=_positive_int,
        help="prompt + completion tokens per request (at most the model's max_position_embeddings)",
    )
    p.add_argument("--kv-memory", type=_positive_float, metavar="GIB", help="KV cache size in GiB")
    p.add_argument("--page-size", type=_positive_int, help="tokens per KV page (default: the recipe's)")
    p.add_argument(
        "--kv-host-gib",
        type=_positive_float,
        metavar="GIB",
        help="L2: pinned host memory holding KV pages evicted from the GPU (default: none)",
    )
    p.add_argument(
        "--kv-store",
        metavar="file:DIR",
        help="L3 below L2 (needs --kv-host-gib): file:DIR (page files, reused across restarts) or"
        " mooncake:HOST:PORT (a Mooncake Store master: pages shared between instances)",
    )
    p.add_argument(
        "--kv-store-gib",
        type=_positive_float,
        default=64.0,
        metavar="GIB",
        help="L3 size: the file store's bound, or the memory this server mounts into the Mooncake pool",
    )
    p.add_argument(
        "--kv-store-timeout", type=_positive_float, default=2.0, metavar="S", help="seconds per L3 call"
    )
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run the program through torch.compile (default: off; it specializes on each step's token count)",
    )
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    _add_engine_options(p)
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine in a process of its own, so the HTTP event loop never holds its GIL"
        " (default: on)",
    )
    p.add_argument("--max-request-bytes", type=_positive_int, default=1 << 20)
    p.add_argument("--max-waiting", type=_positive_int, default=1024, help="waiting requests before 503")
    p.add_argument(
        "--shutdown-timeout",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="on SIGTERM or Ctrl-C: seconds in-flight requests get to finish before they are aborted"
        " (default: 30; a second signal exits at once)",
    )
    p.add_argument(
        "--timeout-keep-alive",
        type=_positive_float,
        default=5.0,
        metavar="S",
        help="seconds an idle keep-alive connection stays open (default: 5)",
    )
    p.add_argument(
        "--header-timeout",
        type=_positive_float,
        default=10.0,
        metavar="S",
        help="seconds from connecting to the end of the request headers; then 408 and close (default: 10)",
    )
    p.add_argument(
        "--body-timeout",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="seconds from the headers to the end of the request body; then 408 and close (default: 30)",
    )
    p.add_argument(
        "--max-connections",
        type=_positive_int,
        default=2048,
        metavar="N",
        help="open connections at most; more are answered 503 and closed (default: 2048)",
    )
    p.add_argument(
        "--max-header-bytes",
        type=_positive_int,
        default=64 * 1024,
        metavar="N",
        help="bytes of a request line and headers at most; more are answered 431 and closed (default: 65536)",
    )
    _add_rank_options(p)
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> None:
    if _torchrun_worker(args, args.artifact):
        return
    from hy3c.serve.http.server import ServeOptions, serve

    serve(
        ServeOptions(
            args.artifact,
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name,
            api_key=args.api_key,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            max_num_partial_prefills=args.max_num_partial_prefills,
            max_model_len=args.max_model_len,
            kv_memory_gib=args.kv_memory,
            kv_host_gib=args.kv_host_gib,
            kv_store=args.kv_store,
            kv_store_gib=args.kv_store_gib,
            kv_store_timeout=args.kv_store_timeout,
            page_size=args.page_size,
            device=args.device,
            compile=args.compile,
            cuda_graphs=args.cuda_graphs,
            async_scheduling=args.async_scheduling,
            speculative_config=args.speculative_config,
            max_request_bytes=args.max_request_bytes,
            max_waiting=args.max_waiting,
            shutdown_timeout=args.shutdown_timeout,
            timeout_keep_alive=args.timeout_keep_alive,
            header_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
            max_connections=args.max_connections,
            max_header_bytes=args.max_header_bytes,
            collective_timeout=args.collective_timeout,
            torchrun=args.torchrun,
            random_weights=args.random_weights,
            engine_process=args.engine_process,
        )
    )


def _add_worker(sub: argparse._SubParsersAction) -> None:
    """`hy3c worker`: one rank other than 0 of a sharded artifact, started by `hy3c serve` / `hy3c
    generate` on this host (hidden: not for people to type)."""
    p = sub.add_parser("worker")
    p.add_argument("artifact", type=Path)
    p.add_argument("--rank", type=_positive_int, required=True)
    p.add_argument("--world-size", type=_positive_int, required=True)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=_port, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true")
    _add_rank_options(p)
    p.set_defaults(func=_run_worker)


def _run_worker(args: argparse.Namespace) -> None:
    from datetime import timedelta

    from hy3c.runtime.distributed import RankPlace, run_worker

    if args.rank >= args.world_size:
        raise ValueError(f"--rank {args.rank} is not a rank of --world-size {args.world_size}")
    place = RankPlace(args.rank, args.world_size, args.rank, args.master_addr, args.master_port)
    timeout = timedelta(seconds=args.collective_timeout)
    run_worker(args.artifact, place, args.device, args.compile, timeout, True, args.random_weights)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    kinds = p.add_subparsers(dest="bench_kind", required=True)
    s = kinds.add_parser(
        "serve", help="load an OpenAI-compatible server (`vllm bench serve`'s flags, metrics and JSON keys)"
    )
    s.add_argument("--base-url", help="the server (default: http://HOST:PORT)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument(
        "--backend",
        help="vLLM's: vllm, openai, sglang, lmdeploy, scalellm (completions) or openai-chat (chat);"
        " sets the default --endpoint",
    )
    s.add_argument(
        "--endpoint",
        help="/v1/completions or /v1/chat/completions (default: the backend's, else completions)",
    )
    s.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a tokenizer.json, or a directory holding one, to build the prompts with"
        " (default: the server's /tokenize and /detokenize)",
    )
    s.add_argument("--model", help="the model id to request (default: the server's first)")
    s.add_argument("--api-key", help="sent as a bearer token (default: $OPENAI_API_KEY)")
    s.add_argument("--label", help="the result's label and file name start (default: the backend)")
    s.add_argument(
        "--dataset-name",
        default="random",
        help="random | prefix_repetition (also prefix-repetition) | hy3-trace",
    )
    s.add_argument("--num-prompts", type=int, default=1000)
    s.add_argument("--input-len", type=int, help="sets --random-input-len")
    s.add_argument("--output-len", type=int, help="sets the dataset's output length")
    s.add_argument("--random-input-len", type=int, default=1024)
    s.add_argument("--random-output-len", type=int, default=128)
    s.add_argument("--random-prefix-len", type=int, default=0, help="tokens every random prompt starts with")
    s.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths drawn from ±this fraction")
    s.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    s.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    s.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    s.add_argument("--prefix-repetition-output-len", type=int, default=128)
    s.add_argument(
        "--prefix-repetition-hit-ratio",
        type=float,
        metavar="R",
        help="the share of all prompt tokens that repeat earlier ones, each prefix's first sending a miss (ours; sizes the shared prefix within prefix + suffix; default: the lengths as given)",
    )
    s.add_argument("--trace-scale", type=float, default=1.0, help="hy3-trace: lengths times this")
    s.add_argument("--trace-reuse", type=float, default=0.8, help="hy3-trace: the share of a prompt reused")
    s.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests per second (Poisson; default: inf)"
    )
    s.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)"
    )
    s.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: no limit)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--ignore-eos", action="store_true", help="always on for the random dataset")
    s.add_argument("--temperature", type=float, help="default: the server's")
    s.add_argument("--top-p", type=float)
    s.add_argument("--top-k", type=int)
    s.add_argument(
        "--extra-body",
        type=_json_object("--extra-body"),
        default={},
        metavar="JSON",
        help="a JSON object merged into every request, e.g. a response_format",
    )
    s.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="SLOs for goodput: ttft, tpot, e2el in ms",
    )
    s.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    s.add_argument("--metric-percentiles", default="50,90,99")
    s.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    s.add_argument("--save-result", action="store_true", help="write the result as JSON")
    s.add_argument("--save-detailed", action="store_true", help="with the per-request lists")
    s.add_argument("--result-dir", help="the JSON file's directory (default: the current one)")
    s.add_argument("--result-filename", help="the JSON file's name (default: vLLM's, from the run)")
    s.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="extra keys for the JSON")
    s.set_defaults(func=_run_bench_serve)


def _run_bench_serve(args: argparse.Namespace) -> None:
    import asyncio
    import json

    from hy3c.serve.http.bench_client import (
        DETAILED_KEYS,
        BenchConfig,
        format_report,
        parse_goodput,
        result_path,
        run_benchmark,
    )

    def numbers(flag: str, text: str) -> tuple[float, ...]:
        try:
            return tuple(float(p) for p in text.split(","))
        except ValueError:
            raise ValueError(f"--{flag}: {text!r} is not a comma-separated list of numbers") from None

    metadata = {}
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata {item!r}: write KEY=VALUE")
        metadata[key] = value
    config = BenchConfig(
        base_url=(args.base_url or f"http://{args.host}:{args.port}").rstrip("/"),
        endpoint=args.endpoint,
        backend=args.backend,
        tokenizer=args.tokenizer,
        model=args.model,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        dataset_name=args.dataset_name,
        num_prompts=args.num_prompts,
        random_input_len=args.input_len or args.random_input_len,
        random_output_len=args.output_len or args.random_output_len,
        random_prefix_len=args.random_prefix_len,
        random_range_ratio=args.random_range_ratio,
        prefix_repetition_prefix_len=args.prefix_repetition_prefix_len,
        prefix_repetition_suffix_len=args.prefix_repetition_suffix_len,
        prefix_repetition_num_prefixes=args.prefix_repetition_num_prefixes,
        prefix_repetition_output_len=args.output_len or args.prefix_repetition_output_len,
        prefix_repetition_hit_ratio=args.prefix_repetition_hit_ratio,
        trace_scale=args.trace_scale,
        trace_reuse=args.trace_reuse,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        extra_body=args.extra_body,
        goodput=parse_goodput(args.goodput),
        percentile_metrics=tuple(m for m in args.percentile_metrics.split(",") if m),
        metric_percentiles=numbers("metric-percentiles", args.metric_percentiles),
        disable_tqdm=args.disable_tqdm,
        label=args.label,
    )
    config.check()
    report = {**metadata, **asyncio.run(run_benchmark(config))}
    print(format_report(report, config))
    if args.save_result:
        saved = report if args.save_detailed else {k: v for k, v in report.items() if k not in DETAILED_KEYS}
        path = result_path(config, report, args.result_filename, args.result_dir)
        path.write_text(json.dumps(saved))
        print(f"result: {path}")
    if report["completed"] == 0:
        errors = sorted({e for e in report["errors"] if e})[:3]
        raise RuntimeError(f"all {report['num_prompts']} requests failed: {errors}")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="end to end on a tiny random checkpoint: init-checkpoint → compile → serve → chat"
    )
    p.add_argument("--workdir", type=Path, help="keep the files here (default: a temporary directory)")
    p.add_argument("--prompt", default="Hello, Hy3!")
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> None:
    from hy3c.serve.http.demo import run_demo

    with tempfile.TemporaryDirectory() as tmp:
        root = args.workdir or Path(tmp)
        ckpt, art = root / "tiny-ckpt", root / "tiny-art"
        steps = [] if ckpt.exists() else [["init-checkpoint", "--out", str(ckpt)]]
        steps.append(
            ["compile", "--model", str(ckpt), "--recipe", "cpu-reference", "--out", str(art), "--overwrite"]
        )
        for step in steps:
            print(f"$ hy3c {' '.join(step)}")
            parsed = build_parser().parse_args(step)
            parsed.func(parsed)
        print(f"$ hy3c serve {art}   (in the background)  +  POST /v1/chat/completions")
        print(run_demo(art, args.prompt))
        print(
            "(the checkpoint's weights are random, so the reply is noise: the demo shows the path, not a model)"
        )


_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_init_checkpoint,
    _add_convert_fp8,
    _add_convert_w4a8,
    _add_generate,
    _add_compile,
    _add_inspect,
    _add_serve,
    _add_bench,
    _add_demo,
)
_HIDDEN_COMMANDS = (_add_worker,)  # started by other commands, left out of --help


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's error convention: one `error:` line (no usage block before it),
    pointing at --help; exit status 2. Subcommand parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hy3c", description="Compiler-driven inference engine for Tencent Hy3")
    parser.add_argument(
        "--log-level", default="INFO", type=_log_level, help=f"one of {', '.join(LOG_LEVELS)} (default INFO)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # the public commands, before the hidden ones
    for add in _HIDDEN_COMMANDS:
        add(sub)
    return parser


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so atomic writers remove their temporary directories."""
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    previous = signal.signal(signal.SIGTERM, _terminate) if _main_thread() else None
    try:
        _check_device(getattr(args, "device", None))
        args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError, OSError) as exc:
        if args.log_level == "DEBUG":
            raise
        if isinstance(exc, BrokenPipeError):  # e.g. `hy3c inspect ... | head`: the reader has gone
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug, not bad input: still one line, the traceback on request
        if args.log_level == "DEBUG":
            raise
        print(
            f"error: internal error: {type(exc).__name__}: {exc} (--log-level DEBUG shows the traceback)",
            file=sys.stderr,
        )
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _check_device(device: str | None) -> None:
    if device and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")


if __name__ == "__main__":
    sys.exit(main())

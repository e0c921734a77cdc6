"""`hy3c serve`'s numeric flags are checked before anything loads (one `error:` line naming the flag),
`--max-model-len` may not exceed the model's `max_position_embeddings`, and a missing artifact or a
too long `--max-model-len` is answered without importing torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hy3c.cli import build_parser, main
from hy3c.serve.http.http_gate import HttpLimits
from hy3c.serve.http.server import ServeOptions

BAD = [
    (["--port", "99999"], "argument --port: 99999 is not a port number (0 to 65535)"),
    (["--port", "-1"], "argument --port: -1 is not a port number (0 to 65535)"),
    (["--port", "http"], "argument --port: 'http' is not a port number"),
    (["--max-model-len", "0"], "argument --max-model-len: must be a positive integer (got 0)"),
    (["--max-model-len", "-5"], "argument --max-model-len: must be a positive integer (got -5)"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be a positive integer (got 0)"),
    (["--max-num-batched-tokens", "0"], "argument --max-num-batched-tokens: must be a positive integer"),
    (["--page-size", "0"], "argument --page-size: must be a positive integer (got 0)"),
    (["--max-request-bytes", "0"], "argument --max-request-bytes: must be a positive integer (got 0)"),
    (["--max-waiting", "0"], "argument --max-waiting: must be a positive integer (got 0)"),
    (["--max-connections", "-3"], "argument --max-connections: must be a positive integer (got -3)"),
    (["--max-header-bytes", "0"], "argument --max-header-bytes: must be a positive integer (got 0)"),
    (["--max-num-seqs", "1.5"], "argument --max-num-seqs: '1.5' is not an integer"),
    (["--kv-memory", "0"], "argument --kv-memory: must be a finite number above 0 (got 0)"),
    (["--kv-memory", "nan"], "argument --kv-memory: must be a finite number above 0 (got nan)"),
    (["--shutdown-timeout", "0"], "argument --shutdown-timeout: must be a finite number above 0"),
    (["--header-timeout", "-1"], "argument --header-timeout: must be a finite number above 0 (got -1)"),
    (["--body-timeout", "inf"], "argument --body-timeout: must be a finite number above 0 (got inf)"),
    (["--timeout-keep-alive", "soon"], "argument --timeout-keep-alive: 'soon' is not a number"),
]


@pytest.mark.parametrize(("flags", "message"), BAD, ids=[" ".join(flags) for flags, _ in BAD])
def test_bad_numbers_are_one_error_line_naming_the_flag(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:  # argparse's: before the port is bound or anything loads
        main(["serve", str(tmp_path / "art"), *flags])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert exited.value.code == 2 and len(errors) == 1 and message in errors[0], err
    assert "--host" not in errors[0] and "Traceback" not in err


def test_limit_defaults():
    args = build_parser().parse_args(["serve", "art"])
    assert (args.max_header_bytes, args.max_request_bytes, args.max_connections) == (65536, 1 << 20, 2048)
    assert args.port == 8000 and args.max_model_len is None and args.max_num_seqs is None
    assert ServeOptions(Path("art")).limits() == HttpLimits()  # one default, whichever way one serves
    assert HttpLimits().max_header_bytes == args.max_header_bytes


def _serve_in_a_process(*argv: str) -> tuple[int, list[str], bool]:
    """`main(["serve", *argv])` in a fresh interpreter: its status, its stderr lines and whether torch
    was imported."""
    probe = (
        "import json, sys\n"
        "from hy3c.cli import main\n"
        f"status = main(['serve', *{list(argv)!r}])\n"
        "print(json.dumps([status, 'torch' in sys.modules]))\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    status, torch_imported = json.loads(run.stdout.strip().splitlines()[-1])
    return status, run.stderr.splitlines(), torch_imported


def test_a_missing_artifact_fails_without_importing_torch(tmp_path):
    status, err, torch_imported = _serve_in_a_process(str(tmp_path / "nope"), "--port", "0")
    assert status == 2 and len(err) == 1
    assert err[0].startswith(f"error: {tmp_path / 'nope' / 'manifest.json'}: missing"), err
    assert not torch_imported  # torch costs seconds of CPU before the message


def test_max_model_len_beyond_the_models_positions_is_refused_before_loading(tiny_artifact):
    args = (str(tiny_artifact), "--port", "0", "--max-model-len", "100000000")
    status, err, torch_imported = _serve_in_a_process(*args)
    assert status == 2 and not torch_imported
    assert err == ["error: --max-model-len 100000000 exceeds the model's max_position_embeddings (4096)"]


def test_async_scheduling_is_on_unless_turned_off(tiny_artifact):
    """`--no-async-scheduling` reaches the engine (serve and generate); the default is on."""
    from hy3c.serve.http.server import build_engine

    parser = build_parser()
    for command in ("serve", "generate"):
        base = ["serve", "ART"] if command == "serve" else ["generate", "--model", "M", "--prompt", "x"]
        assert parser.parse_args(base).async_scheduling is True
        assert parser.parse_args([*base, "--no-async-scheduling"]).async_scheduling is False
    for overlap in (True, False):
        options = ServeOptions(tiny_artifact, kv_memory_gib=0.02, async_scheduling=overlap)
        assert build_engine(options)[0].config.async_scheduling is overlap


def test_prefill_protection_and_speculative_flags_reach_the_engine(tiny_artifact):
    """--long-prefill-token-threshold and --max-num-partial-prefills reach the scheduler; a speculative
    config is checked against the artifact at start-up (one line naming the field)."""
    from hy3c.serve.http.server import build_engine

    args = build_parser().parse_args(
        ["serve", "ART", "--long-prefill-token-threshold", "256", "--max-num-partial-prefills", "2"]
    )
    assert (args.long_prefill_token_threshold, args.max_num_partial_prefills) == (256, 2)
    options = ServeOptions(
        tiny_artifact, kv_memory_gib=0.02, long_prefill_token_threshold=256, max_num_partial_prefills=2
    )
    scheduler = build_engine(options)[0].scheduler
    assert (scheduler.long_prefill_token_threshold, scheduler.max_num_partial_prefills) == (256, 2)
    bad = ServeOptions(
        tiny_artifact,
        kv_memory_gib=0.02,
        speculative_config='{"method": "eagle", "num_speculative_tokens": 1}',
    )
    with pytest.raises(ValueError, match="--speculative-config method: 'eagle' is not supported"):
        build_engine(bad)


def test_a_served_artifact_speculates_with_its_mtp_program(tiny_artifact):
    """`--speculative-config` over the compiled tiny artifact: the engine drafts with the artifact's
    MTP program and its greedy tokens are those of the engine without speculation."""
    from hy3c.serve.engine.core import GenerationRequest
    from hy3c.serve.engine.sampler import SamplingParams
    from hy3c.serve.http.server import build_engine

    config = '{"method": "mtp", "num_speculative_tokens": 2}'
    results = []
    for speculative in (None, config):
        engine = build_engine(
            ServeOptions(tiny_artifact, kv_memory_gib=0.02, speculative_config=speculative)
        )[0]
        outputs = {name: [] for name in "ab"}
        for name, prompt in zip("ab", ([5, 6, 7, 8], [9, 3])):
            request = GenerationRequest(name, prompt, SamplingParams(temperature=0.0), 12, ignore_eos=True)
            engine.submit(request, outputs[name].append)
        engine.run_until_done()
        results.append({n: [t for o in outs for t in o.token_ids] for n, outs in outputs.items()})
        assert (engine.speculator is not None) == (speculative is not None)
        if speculative is not None:
            assert engine.metrics.spec_draft_tokens._value.get() > 0
    assert results[1] == results[0] and all(len(t) == 12 for t in results[0].values())

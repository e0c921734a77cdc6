"""`hy3c bench serve` with `vllm bench serve`'s flags and JSON keys, against a BackgroundServer of the
tiny model; the arrival process, the statistics and the goodput checked on their own."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

from hy3c.cli import main
from hy3c.serve.engine.metrics import EngineMetrics
from hy3c.serve.http.bench_client import (
    DETAILED_KEYS,
    BenchConfig,
    RequestResult,
    arrival_times,
    engine_report,
    format_report,
    make_prompts,
    parse_engine_totals,
    summarize,
)
from hy3c.serve.http.demo import BackgroundServer
from hy3c.serve.http.server import ServeOptions

VLLM_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")),
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_artifact):
    with BackgroundServer(ServeOptions(tiny_artifact, port=0, kv_memory_gib=0.02)) as srv:
        yield srv


def bench(server, *flags: str) -> int:
    return main(["bench", "serve", "--base-url", server.base_url, *flags])


def test_random_dataset_at_a_seeded_poisson_rate_saves_vllm_keys(server, tmp_path, capsys):
    flags = ["--dataset-name", "random", "--num-prompts", "12", "--random-input-len", "8"]
    flags += ["--random-output-len", "5", "--random-prefix-len", "4", "--request-rate", "20", "--seed", "3"]
    flags += ["--max-concurrency", "4", "--goodput", "ttft:60000", "tpot:60000", "e2el:60000"]
    flags += ["--save-result", "--save-detailed", "--result-dir", str(tmp_path / "out")]
    flags += ["--result-filename", "run.json", "--metadata", "commit=abc", "--disable-tqdm"]
    assert bench(server, *flags) == 0
    result = json.loads((tmp_path / "out" / "run.json").read_text())
    assert result.keys() >= VLLM_KEYS and set(DETAILED_KEYS) <= result.keys()
    assert {f"p{p}_{m}_ms" for p in (50, 90) for m in ("ttft", "tpot", "itl", "e2el")} <= result.keys()
    assert result["completed"] == 12 and result["failed"] == 0 and result["errors"] == [""] * 12
    assert result["input_lens"] == [12] * 12 and result["output_lens"] == [5] * 12  # ignore_eos for random
    assert result["total_input_tokens"] == 144 and result["total_output_tokens"] == 60
    # one gap per chunk after the first; a token ending inside a UTF-8 character waits for the next one
    assert all(1 <= len(itl) <= 4 for itl in result["itls"]) and all(t > 0 for t in result["ttfts"])
    assert result["request_rate"] == 20.0 and result["burstiness"] == 1.0 and result["max_concurrency"] == 4
    assert result["duration"] >= 12 / 20  # the last request is sent at n / rate
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # every SLO met
    assert 1 <= result["max_concurrent_requests"] <= 4 and result["commit"] == "abc"
    assert result["dataset_name"] == "random" and result["model_id"] == "art"
    ttfts = np.array(result["ttfts"]) * 1e3
    assert result["p90_ttft_ms"] == pytest.approx(np.percentile(ttfts, 90))
    assert result["median_ttft_ms"] == pytest.approx(np.median(ttfts))
    assert result["engine_steps"] >= 5 and 0 < result["engine_host_ms"] < result["engine_step_ms"]
    busy = result["engine_steps"] * result["engine_step_ms"] / 1e3 / result["duration"]
    assert 0 < result["engine_busy_percent"] <= 100 and result["engine_busy_percent"] == pytest.approx(
        busy * 100
    )
    assert result["engine_kernel_builds"] == 0  # the CPU server runs torch providers: nothing to compile
    # the run's time is in steps or in the loop's turns that ran none (the rest: launching a step after
    # one); an empty turn is counted as it goes, so one that straddles a scrape is split there
    idle = result["engine_idle_empty_percent"] + result.get("engine_idle_held_percent", 0.0)
    slack = 1 + 0.01 / result["duration"] * 100
    assert (
        result["engine_idle_empty_percent"] > 0 and 50 < result["engine_busy_percent"] + idle <= 100 + slack
    )
    # the server's TTFT lies inside the client's, and splits into its queue and prefill parts
    assert 0 < result["engine_ttft_ms"] < result["mean_ttft_ms"]
    assert result["engine_queue_ms"] > 0 and result["engine_prefill_ms"] > 0
    parts = result["engine_queue_ms"] + result["engine_prefill_ms"]
    assert parts == pytest.approx(result["engine_ttft_ms"], rel=0.05, abs=1.0)
    printed = capsys.readouterr().out
    for line in (
        "Serving Benchmark Result",
        "Request goodput (req/s):",
        "P90 TTFT (ms):",
        "Mean step (ms):",
        "Engine busy (% of the run):",
        "Engine idle, no request (%):",
        "Server TTFT, mean (ms):",
        "  arrival to scheduled (ms):",
    ):
        assert line in printed


def test_prefix_repetition_reuses_its_prefixes_and_shows_progress(server, tmp_path, capsys):
    hits = server.engine.metrics.sample("hy3c:prefix_cache_hits_total")
    flags = [
        "--dataset-name",
        "prefix-repetition",
        "--num-prompts",
        "8",
        "--prefix-repetition-prefix-len",
        "40",
    ]
    flags += ["--prefix-repetition-suffix-len", "4", "--prefix-repetition-num-prefixes", "2"]
    flags += ["--prefix-repetition-output-len", "3", "--ignore-eos", "--max-concurrency", "1"]
    flags += ["--save-result", "--result-dir", str(tmp_path)]
    assert bench(server, *flags) == 0
    (path,) = tmp_path.glob("*.json")
    assert path.name.startswith("openai-infqps-concurrency1-art-")  # vLLM's file name for the run
    result = json.loads(path.read_text())
    assert not set(DETAILED_KEYS) & result.keys()  # kept with --save-detailed only
    assert result["completed"] == 8 and result["total_input_tokens"] == 8 * 44
    assert result["total_output_tokens"] == 24 and result["request_goodput"] is None
    # one at a time: the first prompt of each prefix computes it, the 3 after it reuse its 2 full pages
    assert server.engine.metrics.sample("hy3c:prefix_cache_hits_total") - hits >= 6 * 32
    assert "8/8" in capsys.readouterr().err  # the progress bar


def test_chat_endpoint(server, tmp_path):
    flags = ["--endpoint", "/v1/chat/completions", "--num-prompts", "3", "--random-input-len", "6"]
    flags += ["--random-output-len", "3", "--save-result", "--result-filename", str(tmp_path / "chat.json")]
    assert bench(server, *flags, "--disable-tqdm") == 0
    result = json.loads((tmp_path / "chat.json").read_text())
    assert result["completed"] == 3 and result["total_output_tokens"] == 9
    assert result["backend"] == "openai-chat" and result["total_input_tokens"] > 3 * 6  # the chat template


def test_extra_body_reaches_every_request(server, tmp_path):
    """`--extra-body` (vLLM's flag) merged into each body: a response_format whose choice of two words
    the outputs then are (and end on: stop before the 8 tokens asked)."""
    pytest.importorskip("llguidance")
    choice = {"structured_outputs": {"choice": ["alpha", "beta"]}}
    flags = ["--endpoint", "/v1/chat/completions", "--num-prompts", "3", "--random-input-len", "6"]
    flags += ["--random-output-len", "8", "--extra-body", json.dumps(choice), "--save-detailed"]
    flags += ["--save-result", "--result-filename", str(tmp_path / "extra.json")]
    assert bench(server, *flags, "--disable-tqdm") == 0
    result = json.loads((tmp_path / "extra.json").read_text())
    assert result["completed"] == 3 and set(result["generated_texts"]) <= {"alpha", "beta"}


class _AccessLines(logging.Handler):
    """The paths of the server's access log lines while installed."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.paths.append(record.getMessage().split(" path=", 1)[1].split(" ", 1)[0])


@pytest.fixture
def access_paths():
    logger, lines = logging.getLogger("hy3c.access"), _AccessLines()
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    yield lines.paths
    logger.removeHandler(lines)
    logger.setLevel(level)


def test_vllm_backends_pick_the_endpoint_and_a_local_tokenizer_builds_the_prompts(
    server, tiny_artifact, tmp_path, access_paths
):
    flags = ["--num-prompts", "2", "--random-input-len", "6", "--random-output-len", "2", "--disable-tqdm"]
    assert bench(server, "--backend", "vllm", *flags, "--save-result", "--result-dir", str(tmp_path)) == 0
    (path,) = tmp_path.glob("vllm-*.json")  # the file is named after the backend, as vLLM's
    result = json.loads(path.read_text())
    assert result["backend"] == "vllm" and result["endpoint_type"] == "openai" and result["completed"] == 2
    assert "/v1/completions" in access_paths and "/tokenize" in access_paths  # the server's tokenizer
    access_paths.clear()
    saved = ["--save-result", "--result-filename", str(tmp_path / "chat.json")]
    assert bench(server, "--backend", "openai-chat", "--tokenizer", str(tiny_artifact), *flags, *saved) == 0
    result = json.loads((tmp_path / "chat.json").read_text())
    assert result["backend"] == "openai-chat" and result["completed"] == 2
    assert result["tokenizer_id"] == str(tiny_artifact)
    # the chat endpoint without --endpoint; prompts from the local tokenizer, not /tokenize, /detokenize
    assert set(access_paths) == {"/v1/models", "/v1/chat/completions"}, access_paths
    access_paths.clear()
    assert bench(server, "--tokenizer", str(tiny_artifact / "tokenizer.json"), *flags) == 0
    assert set(access_paths) == {"/v1/models", "/v1/completions"}, access_paths


def test_arrivals_follow_the_rate_and_the_seed():
    def draw(seed: int, burstiness: float = 1.0) -> np.ndarray:
        return arrival_times(2000, 50.0, burstiness, np.random.default_rng(seed))

    assert np.array_equal(draw(1), draw(1)) and not np.array_equal(draw(1), draw(2))
    gaps = np.diff(draw(1))
    assert draw(1)[-1] == pytest.approx(2000 / 50) and gaps.mean() == pytest.approx(1 / 50, rel=0.01)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.1)  # exponential gaps: Poisson
    assert np.diff(draw(1, burstiness=100.0)).std() / (1 / 50) < 0.2  # near-uniform
    assert not arrival_times(5, math.inf, 1.0, np.random.default_rng(0)).any()


def test_statistics_and_goodput():
    results = [
        RequestResult(prompt_len=10, success=True, ttft=t, itl=[0.01] * 4, latency=t + 0.04, output_tokens=5)
        for t in (0.1, 0.2, 0.3, 0.4)
    ] + [RequestResult(prompt_len=10, error="HTTP 500")]
    config = BenchConfig(goodput={"ttft": 250.0, "tpot": 11.0}, metric_percentiles=(25.0, 99.9))
    report = summarize(results, 2.0, config)
    assert report["completed"] == 4 and report["failed"] == 1 and report["request_goodput"] == 1.0
    assert report["total_input_tokens"] == 40 and report["output_lens"] == [5, 5, 5, 5, 0]
    ttfts = np.array([100.0, 200.0, 300.0, 400.0])
    assert report["mean_ttft_ms"] == pytest.approx(250.0) and report["std_ttft_ms"] == pytest.approx(
        ttfts.std()
    )
    assert report["p25_ttft_ms"] == pytest.approx(np.percentile(ttfts, 25))
    assert report["p99.9_ttft_ms"] == pytest.approx(np.percentile(ttfts, 99.9))
    assert report["mean_tpot_ms"] == pytest.approx(10.0) and report["median_itl_ms"] == pytest.approx(10.0)
    assert report["total_token_throughput"] == pytest.approx((40 + 20) / 2.0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-prompts", "0"], "error: --num-prompts must be positive (got 0)"),
        (["--goodput", "ttft=5"], "error: --goodput 'ttft=5': write METRIC:MS"),
        (["--goodput", "itl:5"], "error: --goodput itl:5.0: give ttft, tpot or e2el"),
        (
            ["--dataset-name", "sharegpt"],
            "error: --dataset-name: 'sharegpt' is not one of random, prefix_repetition",
        ),
        (["--percentile-metrics", "ttft,foo"], "error: --percentile-metrics: 'foo' is not one of"),
        (
            ["--metric-percentiles", "50,x"],
            "error: --metric-percentiles: '50,x' is not a comma-separated list",
        ),
        (["--request-rate", "0"], "error: --request-rate must be positive (got 0.0)"),
        (["--endpoint", "/v1/embeddings"], "error: --endpoint: '/v1/embeddings' is not one of"),
        (
            ["--backend", "tgi"],
            "error: --backend: 'tgi' is not one of vllm, openai, openai-chat, sglang, lmdeploy, scalellm",
        ),
        (
            ["--backend", "openai-chat", "--endpoint", "/v1/completions"],
            "error: --backend openai-chat sends to /v1/chat/completions, not --endpoint /v1/completions",
        ),
        (["--tokenizer", "/nonexistent"], "error: --tokenizer /nonexistent: no tokenizer.json there"),
        (["--tokenizer", "{bad}"], "error: --tokenizer {bad}: not a tokenizer.json"),
        (["--port", "70000"], "argument --port: 70000 is not a port number (0 to 65535)"),
        (["--extra-body", "[1]"], "argument --extra-body: must be a JSON object (got list)"),
        (["--extra-body", "nope"], "argument --extra-body: not JSON"),
    ],
)
def test_bad_flags_are_one_line_errors(flags, message, capsys, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    flags, message = [f.format(bad=bad) for f in flags], message.format(bad=bad)
    try:
        status = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", *flags])
    except SystemExit as exc:  # argparse's
        status = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def _metrics_text(steps: int, drafts: int, drafted: int, accepted: int, per_pos: list[int]) -> str:
    """A hy3c /metrics text (as prometheus_client renders it) with the step histogram and the spec-decode counters at these totals."""
    lines = [
        "# TYPE hy3c:engine_step_seconds histogram",
        f'hy3c:engine_step_seconds_bucket{{le="+Inf",model_name="art"}} {steps}',
        f'hy3c:engine_step_seconds_count{{model_name="art"}} {steps}',
        f'hy3c:engine_step_seconds_sum{{model_name="art"}} {steps * 0.02}',
    ]
    if drafts:
        for name, value in (
            ("num_drafts", drafts),
            ("num_draft_tokens", drafted),
            ("num_accepted_tokens", accepted),
        ):
            lines += [
                f"# TYPE hy3c:spec_decode_{name}_total counter",
                f'hy3c:spec_decode_{name}_total{{model_name="art"}} {value}',
            ]
        lines.append("# TYPE hy3c:spec_decode_num_accepted_tokens_per_pos_total counter")
        lines += [
            f'hy3c:spec_decode_num_accepted_tokens_per_pos_total{{model_name="art",position="{j}"}} {v}'
            for j, v in enumerate(per_pos)
        ]
    return "\n".join(lines) + "\n"


def test_spec_decode_acceptance_from_metrics_before_and_after():
    """Counter changes over the run: 40 drafts of 3 tokens, 66 accepted (30, 22, 14 at positions 0..2)
    → 55 % accepted, mean acceptance length 1 + 66/40, per position 30/40, 22/40, 14/40; the printed
    report gets its section. A server that did not draft during the run reports none of it."""
    before = parse_engine_totals(_metrics_text(10, 10, 30, 12, [6, 4, 2]))
    after = parse_engine_totals(_metrics_text(60, 50, 150, 78, [36, 26, 16]))
    report = engine_report(before, after)
    assert report["engine_steps"] == 50
    assert report["spec_decode_num_drafts"] == 40 and report["spec_decode_draft_tokens"] == 120
    assert report["spec_decode_accepted_tokens"] == 66
    assert report["spec_decode_acceptance_rate"] == pytest.approx(55.0)
    assert report["spec_decode_acceptance_length"] == pytest.approx(1 + 66 / 40)
    assert report["spec_decode_per_position_acceptance_rates"] == pytest.approx([0.75, 0.55, 0.35])
    results = [RequestResult(prompt_len=4, success=True, ttft=0.1, itl=[0.01], latency=0.2, output_tokens=2)]
    config = BenchConfig()
    text = format_report({**summarize(results, 1.0, config), **report}, config)
    assert "Speculative Decoding" in text and "Acceptance length:" in text and "Position 2:" in text
    idle = parse_engine_totals(_metrics_text(60, 50, 150, 78, [36, 26, 16]))
    assert not any(key.startswith("spec_decode") for key in engine_report(after, idle))
    plain = engine_report(parse_engine_totals(_metrics_text(1, 0, 0, 0, [])), after)
    assert plain["spec_decode_num_drafts"] == 50  # counters that appear during the run count from zero
    without = engine_report(
        parse_engine_totals(_metrics_text(1, 0, 0, 0, [])), parse_engine_totals(_metrics_text(5, 0, 0, 0, []))
    )
    assert without["engine_steps"] == 4 and "Speculative" not in format_report(
        {**summarize(results, 1.0, config), **without}, config
    )


def test_spec_decode_report_reads_what_the_engine_metrics_render():
    """The names bench serve scrapes are those EngineMetrics renders (a round trip through the text)."""
    metrics = EngineMetrics()
    metrics.step(0.01, 0.001, 4, 0)
    before = parse_engine_totals(metrics.render("art"))
    metrics.step(0.01, 0.001, 4, 0)
    metrics.speculated([2, 2, 2], [2, 1, 0])
    report = engine_report(before, parse_engine_totals(metrics.render("art")))
    assert report["spec_decode_num_drafts"] == 3 and report["spec_decode_draft_tokens"] == 6
    assert report["spec_decode_acceptance_rate"] == pytest.approx(50.0)
    assert report["spec_decode_acceptance_length"] == pytest.approx(2.0)
    assert report["spec_decode_per_position_acceptance_rates"] == pytest.approx([2 / 3, 1 / 3])


@pytest.mark.parametrize("ratio", [0.0, 0.2, 0.5, 0.8])
def test_prefix_repetition_hit_ratio_is_the_share_of_prompt_tokens_a_cache_can_serve(ratio):
    """With R set, a share R of all prompt tokens repeat earlier ones (each prefix's first sending is
    a miss, so the shared prefix is R · N / (N − P) of each prompt)."""
    config = BenchConfig(
        base_url="http://x", dataset_name="prefix_repetition", num_prompts=200,
        prefix_repetition_num_prefixes=10, prefix_repetition_hit_ratio=ratio,
    )  # fmt: skip
    prompts = make_prompts(config, list(range(1000, 5000)), np.random.default_rng(0))
    assert all(len(p) == 512 for p, _ in prompts)
    shared = round(ratio * 200 / 190 * 512)
    seen, repeated, total = set(), 0, 0
    for prompt, _ in prompts:
        prefix = tuple(prompt[:shared])
        repeated += len(prefix) if prefix in seen else 0
        seen.add(prefix)
        total += len(prompt)
    assert len(seen) == (10 if ratio else 1)
    assert repeated / total == pytest.approx(ratio, abs=1 / 512)


def test_a_prefix_repetition_hit_ratio_the_first_sendings_rule_out_is_refused():
    """48 prefixes over 96 prompts: half the prompts are first sendings, so 0.5 or more cannot hit."""
    with pytest.raises(ValueError, match="--prefix-repetition-hit-ratio 0.5: 48 prefixes over 96 prompts"):
        BenchConfig(
            base_url="http://x", dataset_name="prefix_repetition", num_prompts=96,
            prefix_repetition_num_prefixes=48, prefix_repetition_hit_ratio=0.5,
        ).check()  # fmt: skip


def test_the_hy3_trace_has_a_long_tail_short_outputs_and_the_chosen_reuse():
    config = BenchConfig(
        base_url="http://x", dataset_name="hy3-trace", num_prompts=400, trace_scale=0.01, trace_reuse=0.6
    )
    prompts = make_prompts(config, list(range(1000, 5000)), np.random.default_rng(1))
    inputs = np.array([len(p) for p, _ in prompts])
    outputs = np.array([o for _, o in prompts])
    assert 500 < np.median(inputs) < 900 and inputs.max() > 3 * np.median(inputs)  # median 680, long tail
    assert 5 < np.median(outputs) < 13
    by_session: dict[int, list[list[int]]] = {}
    for prompt, _ in prompts:
        by_session.setdefault(prompt[0], []).append(prompt)
    assert 40 <= len(by_session) <= 50  # 400 prompts in sessions of ~8 (a first token may repeat)
    session = max(by_session.values(), key=len)
    shortest = min(session, key=len)
    shared = int(0.6 * len(shortest))
    assert all(p[:shared] == shortest[:shared] for p in session)


def test_prefix_cache_figures_from_metrics_before_and_after():
    """Prompt tokens found / looked up over the run, and the pages each KV tier found."""

    def text(queries: int, hits: int, l2: int, l3: int) -> str:
        return (
            _metrics_text(10 + queries, 0, 0, 0, [])
            + "\n".join(
                [
                    "# TYPE hy3c:prefix_cache_queries_total counter",
                    f'hy3c:prefix_cache_queries_total{{model_name="art"}} {queries}',
                    "# TYPE hy3c:prefix_cache_hits_total counter",
                    f'hy3c:prefix_cache_hits_total{{model_name="art"}} {hits}',
                    "# TYPE hy3c:kv_tier_pages gauge",
                    f'hy3c:kv_tier_pages{{event="hits",model_name="art",tier="l2"}} {l2}',
                    f'hy3c:kv_tier_pages{{event="hits",model_name="art",tier="l3"}} {l3}',
                    f'hy3c:kv_tier_pages{{event="queries",model_name="art",tier="l3"}} {l3 + 5}',
                ]
            )
            + "\n"
        )

    report = engine_report(
        parse_engine_totals(text(100, 20, 1, 2)), parse_engine_totals(text(500, 220, 9, 12))
    )
    assert report["prefix_cache_hit_rate"] == pytest.approx(50.0)
    assert report["kv_l2_hit_pages"] == 8 and report["kv_l3_hit_pages"] == 10
    results = [RequestResult(prompt_len=4, success=True, ttft=0.1, itl=[0.01], latency=0.2, output_tokens=2)]
    printed = format_report({**summarize(results, 1.0, BenchConfig()), **report}, BenchConfig())
    assert "Prefix cache hit rate (%):" in printed and "pages found in L3:" in printed

"""/metrics through prometheus_client: vLLM's names and types, values after known traffic, gauges that
are right when nothing runs, label escaping; and the access log's line per request."""

from __future__ import annotations

import contextlib
import logging
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hy3c.serve.engine.metrics import EngineMetrics
from hy3c.serve.http.demo import BackgroundServer
from hy3c.serve.http.server import ServeOptions

PROMPT = "a prompt long enough to fill a few pages of the KV cache, so that the prefix cache can hit " * 2


@pytest.fixture(scope="module")
def server(tiny_artifact):
    with BackgroundServer(ServeOptions(tiny_artifact, port=0, kv_memory_gib=0.02)) as srv:
        yield srv


def scrape(server) -> dict:
    """{family name: (type, {(sample name, labels without model_name): value})}; every sample carries
    model_name=art."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        samples = {}
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name") == "art", s
            samples[(s.name, tuple(sorted(labels.items())))] = s.value
        out[family.name] = (family.type, samples)
    return out


def value(metrics: dict, family: str, sample: str | None = None, **labels) -> float:
    return metrics[family][1].get((sample or family, tuple(sorted(labels.items()))), 0.0)


def wait_idle(server, timeout: float = 10.0) -> dict:
    """The scrape once no request runs or waits (without sending one)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(server)
        idle = value(metrics, "hy3c:num_requests_running") == value(metrics, "hy3c:num_requests_waiting") == 0
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def test_metric_types_and_values_after_known_traffic(server):
    before = wait_idle(server)
    prompt_tokens = len(httpx.post(f"{server.base_url}/tokenize", json={"prompt": PROMPT}).json()["tokens"])
    usages = []
    for _ in range(2):  # the second finds the first's full pages in the prefix cache
        body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
        usages.append(response.json()["usage"])
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16 and usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    after = wait_idle(server)

    types = {
        "hy3c:num_requests_running": "gauge",
        "hy3c:num_requests_waiting": "gauge",
        "hy3c:kv_cache_usage_perc": "gauge",
        "hy3c:cache_config_info": "gauge",
        "hy3c:prompt_tokens": "counter",
        "hy3c:generation_tokens": "counter",
        "hy3c:num_preemptions": "counter",
        "hy3c:prefix_cache_queries": "counter",
        "hy3c:prefix_cache_hits": "counter",
        "hy3c:request_success": "counter",
        "hy3c:request_aborted": "counter",
        "hy3c:kernel_builds": "counter",
        "hy3c:time_to_first_token_seconds": "histogram",
        "hy3c:inter_token_latency_seconds": "histogram",
        "hy3c:e2e_request_latency_seconds": "histogram",
        "hy3c:request_queue_time_seconds": "histogram",
        "hy3c:request_prefill_time_seconds": "histogram",
        "hy3c:request_decode_time_seconds": "histogram",
        "hy3c:request_inference_time_seconds": "histogram",
        "hy3c:request_time_per_output_token_seconds": "histogram",
        "hy3c:request_prompt_tokens": "histogram",
        "hy3c:request_generation_tokens": "histogram",
        "hy3c:iteration_tokens_total": "histogram",
        "hy3c:engine_step_seconds": "histogram",
        "hy3c:engine_host_seconds": "histogram",
    }
    assert {name: after[name][0] for name in types} == types

    def delta(family: str, sample: str | None = None, **labels) -> float:
        return value(after, family, sample, **labels) - value(before, family, sample, **labels)

    assert delta("hy3c:request_success", "hy3c:request_success_total", finished_reason="length") == 2
    assert delta("hy3c:prompt_tokens", "hy3c:prompt_tokens_total") == 2 * prompt_tokens
    assert delta("hy3c:generation_tokens", "hy3c:generation_tokens_total") == 10
    assert delta("hy3c:prefix_cache_queries", "hy3c:prefix_cache_queries_total") == 2 * prompt_tokens
    assert delta("hy3c:prefix_cache_hits", "hy3c:prefix_cache_hits_total") == cached
    for family in (
        "hy3c:time_to_first_token_seconds",
        "hy3c:e2e_request_latency_seconds",
        "hy3c:request_queue_time_seconds",
        "hy3c:request_prefill_time_seconds",
        "hy3c:request_decode_time_seconds",
        "hy3c:request_inference_time_seconds",
        "hy3c:request_time_per_output_token_seconds",
        "hy3c:request_prompt_tokens",
        "hy3c:request_generation_tokens",
    ):
        assert delta(family, f"{family}_count") == 2, family
    assert delta("hy3c:inter_token_latency_seconds", "hy3c:inter_token_latency_seconds_count") == 8
    assert delta("hy3c:request_prompt_tokens", "hy3c:request_prompt_tokens_sum") == 2 * prompt_tokens
    assert delta("hy3c:request_generation_tokens", "hy3c:request_generation_tokens_sum") == 10
    steps = delta("hy3c:engine_step_seconds", "hy3c:engine_step_seconds_count")
    assert steps >= 10 and delta("hy3c:iteration_tokens_total", "hy3c:iteration_tokens_total_count") == steps
    fed = delta("hy3c:iteration_tokens_total", "hy3c:iteration_tokens_total_sum")
    assert fed == 2 * prompt_tokens - cached + 2 * 4  # prompts less the reused pages, then 4 decodes each
    prefill = delta("hy3c:request_prefill_time_seconds", "hy3c:request_prefill_time_seconds_sum")
    inference = delta("hy3c:request_inference_time_seconds", "hy3c:request_inference_time_seconds_sum")
    decode = delta("hy3c:request_decode_time_seconds", "hy3c:request_decode_time_seconds_sum")
    assert 0 < prefill < inference and inference == pytest.approx(prefill + decode)
    assert delta("hy3c:num_preemptions", "hy3c:num_preemptions_total") == 0
    info = [labels for (name, labels), v in after["hy3c:cache_config_info"][1].items() if v == 1]
    assert info == [
        (("block_size", "16"), ("cache_dtype", "float32"), ("enable_prefix_caching", "True"),
         ("num_gpu_blocks", str(server.engine.config.num_pages)))
    ]  # fmt: skip


def test_gauges_are_zero_once_aborted_requests_leave_an_idle_engine(server):
    """Two streams abandoned by their clients: while they run the gauges show them; after, with no
    further request, 0 running, 0 waiting and no KV pages held (vLLM's meaning of usage)."""
    before = wait_idle(server)
    body = {"prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
    with contextlib.ExitStack() as stack:
        readers = []  # kept: a line iterator that is dropped closes its response
        for _ in range(2):
            client = stack.enter_context(httpx.Client(timeout=60))
            response = stack.enter_context(
                client.stream("POST", f"{server.base_url}/v1/completions", json=body)
            )
            readers.append(response.iter_lines())
            for _ in range(3):
                next(readers[-1])
        running = scrape(server)
        assert value(running, "hy3c:num_requests_running") == 2
        assert value(running, "hy3c:kv_cache_usage_perc") > 0
    after = wait_idle(server)
    assert value(after, "hy3c:num_requests_running") == 0
    assert value(after, "hy3c:num_requests_waiting") == 0
    assert value(after, "hy3c:kv_cache_usage_perc") == 0
    aborted = value(after, "hy3c:request_aborted", "hy3c:request_aborted_total") - value(
        before, "hy3c:request_aborted", "hy3c:request_aborted_total"
    )
    success = "hy3c:request_success", "hy3c:request_success_total"
    assert aborted == 2
    assert (
        value(after, *success, finished_reason="abort") - value(before, *success, finished_reason="abort")
        == 2
    )
    assert server.engine.pool.page_of  # the aborted prompts' full pages stay published for reuse


def test_label_values_are_escaped():
    metrics = EngineMetrics()
    metrics.kernel_builds.labels(kernel='k"1\\\n').inc(3)
    model = 'my "model"\\v2\n'
    families = {f.name: f for f in text_string_to_metric_families(metrics.render(model))}
    (sample,) = families["hy3c:kernel_builds"].samples
    assert sample.labels == {"kernel": 'k"1\\\n', "model_name": model} and sample.value == 3


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_access_log_has_one_line_per_request(server):
    logger, lines = logging.getLogger("hy3c.access"), _Lines()
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        ok = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "n": 2},
            timeout=60,
        )
        missing = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x", "model": "gpt-9"})
        httpx.get(f"{server.base_url}/metrics")  # scrapes log at DEBUG only
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    assert ok.status_code == 200 and missing.status_code == 404
    assert len(lines.lines) == 2, lines.lines
    first, second = lines.lines
    prompt = ok.json()["usage"]["prompt_tokens"]
    assert first.startswith("request method=POST path=/v1/completions status=200 ms=")
    assert f"prompt_tokens={2 * prompt} completion_tokens=6 cached_tokens=" in first  # n=2: per choice
    assert "error=" not in first and "client=127.0.0.1:" in first
    assert second.startswith("request method=POST path=/v1/completions status=404 ms=")
    assert "error=\"model 'gpt-9' does not exist" in second

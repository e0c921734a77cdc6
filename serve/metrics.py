"""Prometheus metrics of the server, in the text exposition format (no client library needed).

Names mirror vLLM's with a `hy3c:` prefix: request counts by finish reason, TTFT / inter-token /
end-to-end latency histograms, prompt and generation token counters, KV-cache usage, running and
waiting requests, preemptions, aborts and the engine step time.
"""

from __future__ import annotations

import threading
from bisect import bisect_left

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Counter:
    def __init__(self, name: str, help_: str) -> None:
        self.name, self.help, self.value, self._lock = name, help_, 0.0, threading.Lock()

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value += amount

    def render(self, model: str) -> list[str]:
        return [
            f"# HELP {self.name} {self.help}",
            f"# TYPE {self.name} counter",
            f'{self.name}{{model_name="{model}"}} {self.value}',
        ]


class Gauge(Counter):
    def set(self, value: float) -> None:
        self.value = value

    def render(self, model: str) -> list[str]:
        return [
            f"# HELP {self.name} {self.help}",
            f"# TYPE {self.name} gauge",
            f'{self.name}{{model_name="{model}"}} {self.value}',
        ]


class LabeledCounter(Counter):
    def __init__(self, name: str, help_: str, label: str) -> None:
        super().__init__(name, help_)
        self.label, self.values = label, {}

    def inc_label(self, value: str, amount: float = 1.0) -> None:
        with self._lock:
            self.values[value] = self.values.get(value, 0.0) + amount

    def render(self, model: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for key, value in sorted(self.values.items()):
            lines.append(f'{self.name}{{model_name="{model}",{self.label}="{key}"}} {value}')
        return lines


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> None:
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum, self.count, self._lock = 0.0, 0, threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect_left(self.buckets, value)] += 1
            self.sum += value
            self.count += 1

    def render(self, model: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{model_name="{model}",le="{le}"}} {running}')
        lines.append(f'{self.name}_sum{{model_name="{model}"}} {self.sum}')
        lines.append(f'{self.name}_count{{model_name="{model}"}} {self.count}')
        return lines


class EngineMetrics:
    def __init__(self) -> None:
        self.success = LabeledCounter(
            "hy3c:request_success_total", "Finished requests by finish reason.", "finished_reason"
        )
        self.aborted = Counter(
            "hy3c:request_aborted_total", "Requests aborted (client disconnect or cancel)."
        )
        self.prompt_tokens = Counter("hy3c:prompt_tokens_total", "Prompt tokens received.")
        self.generation_tokens = Counter("hy3c:generation_tokens_total", "Tokens generated.")
        self.preemptions = Gauge("hy3c:num_preemptions_total", "Sequences preempted for lack of KV pages.")
        self.running = Gauge("hy3c:num_requests_running", "Requests in the running batch.")
        self.waiting = Gauge("hy3c:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = Gauge("hy3c:kv_cache_usage_perc", "Fraction of KV pages in use.")
        self.ttft = Histogram("hy3c:time_to_first_token_seconds", "Time to first token.")
        self.itl = Histogram("hy3c:inter_token_latency_seconds", "Time between consecutive tokens.")
        self.e2e = Histogram("hy3c:e2e_request_latency_seconds", "End-to-end request latency.")
        self.step_time = Histogram("hy3c:engine_step_seconds", "Wall time of one engine step.")
        self.host_time = Histogram(
            "hy3c:engine_host_seconds",
            "Host time of one engine step outside the model and the sampler: scheduling, batch building,"
            " detokenization and emitting.",
        )
        self.batch_tokens = Counter("hy3c:scheduled_tokens_total", "Tokens fed to the model.")
        self.kernel_builds = LabeledCounter(
            "hy3c:kernel_builds_total",
            "Triton kernel variants built while serving (compiled, or read from the disk cache); each one"
            " stalls the engine step that needs it. Warm-up should leave this at zero.",
            "kernel",
        )

    def step(
        self,
        seconds: float,
        host_seconds: float,
        tokens: int,
        kv_usage: float,
        running: int,
        waiting: int,
        preemptions: int,
    ) -> None:
        self.step_time.observe(seconds)
        self.host_time.observe(host_seconds)
        self.batch_tokens.inc(tokens)
        self.kv_usage.set(kv_usage)
        self.running.set(running)
        self.waiting.set(waiting)
        self.preemptions.set(preemptions)

    def finished(self, reason: str, seconds: float, tokens: int) -> None:
        self.success.inc_label(reason)
        if reason in ("stop", "length"):
            self.e2e.observe(seconds)

    def render(self, model: str) -> str:
        items = [
            self.success,
            self.aborted,
            self.prompt_tokens,
            self.generation_tokens,
            self.preemptions,
            self.running,
            self.waiting,
            self.kv_usage,
            self.ttft,
            self.itl,
            self.e2e,
            self.step_time,
            self.host_time,
            self.batch_tokens,
            self.kernel_builds,
        ]
        return "\n".join(line for item in items for line in item.render(model)) + "\n"

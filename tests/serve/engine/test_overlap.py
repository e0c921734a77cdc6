"""Overlapped scheduling: the engine plans and launches step N+1 before it reads step N's tokens. Its
outputs must equal those of the engine that reads every step at once (`async_scheduling=False`), with
greedy and seeded sampling, stop tokens and strings, preemptions forced by a small page pool, aborts
and prefix-cache hits, penalties and grammars (whose next draws need the previous tokens on the host:
read while the next model step runs) — and leave no page held."""

from __future__ import annotations

from collections import Counter

import pytest

from hy3c.serve.engine.core import Engine, EngineConfig, GenerationRequest, StepOutput
from hy3c.serve.engine.sampler import SamplingParams


def _engine(model, tokenizer, overlap: bool, num_pages: int = 64) -> Engine:
    config = EngineConfig(
        num_pages=num_pages,
        page_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=48,
        max_model_len=96,
        async_scheduling=overlap,
    )
    return Engine(model, tokenizer, config)


def _requests(stop_token: int | None = None, penalties: bool = True) -> list[GenerationRequest]:
    """Greedy, seeded and (with `penalties`) penalised requests of different lengths (one stopped by
    a token id when `stop_token` is given, one by a string)."""
    prompts = [[5 + i, 17, 33 + 2 * i, 9, 41][: 2 + i % 4] * (1 + i % 3) for i in range(6)]
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, seed=7),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=20, seed=3),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, seed=5)
        if penalties
        else SamplingParams(temperature=0.7, seed=5),
        SamplingParams(temperature=0.0),
    ]
    # the penalised request is the longest: every step runs while it does (and so is read before the
    # next is planned), whatever the others' stops
    requests = [
        GenerationRequest(f"r{i}", prompt, p, max_tokens=40 if i == 4 else 12 + 3 * i, ignore_eos=True)
        for i, (prompt, p) in enumerate(zip(prompts, params))
    ]
    if stop_token is not None:
        requests[2].stop_token_ids = [stop_token]
    requests[5].stop = ["e"]
    return requests


def _run(engine: Engine, requests: list[GenerationRequest], abort: str | None = None) -> dict[str, list]:
    """Run the requests to their end (aborting `abort` after three turns of the loop); each request's
    tokens, text and finish reason. Records whether a step fed a token still on the device."""
    outputs: dict[str, list[StepOutput]] = {r.request_id: [] for r in requests}
    for request in requests:
        engine.submit(request, outputs[request.request_id].append)
    schedule = engine.scheduler.schedule
    engine.fed_from_device = 0
    engine.fed_ids = Counter()

    def recording():
        work = schedule()
        engine.fed_from_device += sum(w.from_device for w in work)
        engine.fed_ids.update(w.seq.request_id for w in work if w.from_device)
        return work

    engine.scheduler.schedule = recording
    turns = 0
    while engine._iterate():
        turns += 1
        if turns == 3 and abort is not None:
            engine.abort(abort)
    assert engine.pool.num_free == engine.pool.usable, "pages leaked"
    assert not engine._live and engine._in_flight is None
    return {
        rid: (
            [t for o in outs for t in o.token_ids],
            "".join(o.text for o in outs),
            outs[-1].finish_reason,
            outs[-1].cached_tokens,
        )
        for rid, outs in outputs.items()
    }


@pytest.mark.parametrize("penalties", [False, True])
def test_overlap_gives_the_outputs_of_the_step_by_step_engine(model, tokenizer, penalties):
    """Greedy and seeded requests, a stop token met mid-way and a stop string: the same tokens, text
    and finish reasons with overlap on and off; with it on, steps really were fed tokens still on the
    device — the penalised request's too (its previous step is read while the next model step runs,
    before the draws that need its history)."""
    first = _run(_engine(model, tokenizer, overlap=False), _requests(penalties=penalties))
    stop_token = first["r2"][0][4]  # r2's fifth greedy token: it stops there when asked to
    sync_engine, overlap_engine = (_engine(model, tokenizer, o) for o in (False, True))
    sync = _run(sync_engine, _requests(stop_token, penalties))
    overlapped = _run(overlap_engine, _requests(stop_token, penalties))
    assert overlapped == sync
    assert sync["r2"][2] == "stop" and len(sync["r2"][0]) == first["r2"][0].index(stop_token)
    assert sync_engine.fed_from_device == 0
    assert overlap_engine.fed_from_device > 0 and overlap_engine.fed_ids["r4"] > 20


def test_grammar_requests_overlap_and_equal_the_step_by_step_engine(model, tokenizer):
    """Requests under a grammar (a regex, a choice) beside free ones, greedy and seeded: overlap on and
    off give the same outputs, each output follows its grammar and ends when it is complete, and the
    constrained requests' steps were fed tokens still on the device (the masks built while the next
    model step runs)."""
    import re

    pytest.importorskip("llguidance")
    from hy3c.serve.agent.structured import Grammars, GrammarSpec

    grammars = Grammars(tokenizer, model.config.vocab_size)
    pattern = "(ab|cd){3,6}e"
    regex = grammars.compile(GrammarSpec("regex", pattern, "guided_regex"))
    choice = grammars.compile(GrammarSpec("choice", ["sunny", "cloudy", "rain"], "guided_choice"))

    def requests():
        out = _requests(penalties=False)[:4]
        for i, (grammar, seed) in enumerate([(regex, None), (regex, 11), (choice, 4)]):
            params = (
                SamplingParams(temperature=0.0)
                if seed is None
                else SamplingParams(temperature=1.0, seed=seed)
            )
            out.append(GenerationRequest(f"g{i}", [9, 17, 4 + i], params, max_tokens=40, grammar=grammar))
        return out

    results = {}
    for overlap in (False, True):
        engine = _engine(model, tokenizer, overlap)
        results[overlap] = _run(engine, requests())
        if overlap:
            assert all(engine.fed_ids[f"g{i}"] > 0 for i in range(3))
    assert results[True] == results[False]
    alone = _run(_engine(model, tokenizer, False), _requests(penalties=False)[:4])
    assert {rid: results[True][rid] for rid in alone} == alone  # rows without a grammar allow every token
    for i in range(2):
        _, text, reason, _ = results[True][f"g{i}"]
        assert re.fullmatch(pattern, text) and reason == "stop"
    assert results[True]["g2"][1] in ("sunny", "cloudy", "rain")


def test_a_step_read_before_the_draws_delivers_its_outputs_after_them(model, tokenizer, monkeypatch):
    """A step read between the next model launch and its draws (a penalised request's history) holds
    its outputs until those draws are launched: no output reaches a consumer (the HTTP server's event
    loop, which then takes the GIL) between a model step and its draws."""
    from hy3c.serve.engine import core

    engine = _engine(model, tokenizer, overlap=True)
    events: list[str] = []
    step, draws = engine.runner.step, core.sample_async

    def model_step(*args, **kwargs):
        events.append("model")
        return step(*args, **kwargs)

    def sample(*args, **kwargs):
        events.append("draws")
        return draws(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "step", model_step)
    monkeypatch.setattr(core, "sample_async", sample)
    requests = _requests(penalties=True)
    for request in requests:
        engine.submit(request, lambda out: events.append("output"))
    while engine._iterate():
        pass
    launched = [i for i, e in enumerate(events) if e == "model"]
    assert len(launched) > 20 and events.count("output") > 20
    for at in launched:
        following = events[at + 1 : events.index("draws", at)]
        assert "output" not in following, events[at : at + 10]


def test_overlap_survives_preemption_and_aborts(model, tokenizer):
    """A page pool too small for every request preempts some (a sequence with a token in flight
    among them) and an abort lands mid-way: overlap on and off agree, and no page is left held."""
    results = {}
    whole = _run(_engine(model, tokenizer, False), _requests(penalties=False))["r3"][0]
    for overlap in (False, True):
        engine = _engine(model, tokenizer, overlap, num_pages=24)
        results[overlap] = _run(engine, _requests(penalties=False), abort="r3")
        assert engine.scheduler.num_preemptions > 0
    aborted = {overlap: out.pop("r3") for overlap, out in results.items()}
    assert results[True] == results[False]
    for tokens, _, reason, _ in aborted.values():  # how far it got depends on the loop's pace
        assert reason == "abort" and tokens == whole[: len(tokens)]


def test_pages_published_under_overlap_are_hit_by_a_later_request(model, tokenizer):
    """A finished request's prompt and output pages are published only as far as the host has read
    its tokens; a later request extending them hits the cache and continues as without overlap."""
    results = {}
    for overlap in (False, True):
        engine = _engine(model, tokenizer, overlap)
        first = GenerationRequest("first", [7, 3, 11, 19, 23, 5], SamplingParams(temperature=0.0), 14)
        tokens = _run(engine, [first])["first"][0]
        again = GenerationRequest("again", first.prompt_ids + tokens, SamplingParams(temperature=0.0), 6)
        results[overlap] = _run(engine, [again])["again"]
    assert results[True] == results[False]
    assert results[True][3] == 16  # cached: the 4 full pages of the 20 tokens it had (19 + 1 computed)


def test_a_stopped_request_gets_no_output_from_the_extra_step(model, tokenizer):
    """Under overlap a request that meets its stop token has one more step launched before the host
    reads the token; that step's row is dropped: nothing is emitted after the final output."""
    greedy = SamplingParams(temperature=0.0)
    probe = _run(_engine(model, tokenizer, False), [GenerationRequest("p", [5, 9, 13], greedy, 10)])
    stop = probe["p"][0][2]
    outputs: list[StepOutput] = []
    engine = _engine(model, tokenizer, True)
    engine.submit(GenerationRequest("p", [5, 9, 13], greedy, 10, stop_token_ids=[stop]), outputs.append)
    engine.run_until_done()
    assert [o.finished for o in outputs] == [False, False, True]
    assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason == stop


@pytest.mark.gpu
def test_on_cuda_grammar_masks_reach_the_kernels_through_the_staging_buffers(cuda_artifact, tokenizer):
    """The served engine on the GPU (CUDA graphs, the fused sampler reading the masks, the pinned
    staging buffers used in turn): requests under a regex and a choice beside free ones, overlap on
    and off, and MTP at K = 1: the same outputs, each following its grammar."""
    import re

    pytest.importorskip("llguidance")
    from hy3c.serve.agent.structured import Grammars, GrammarSpec
    from hy3c.serve.http.server import ServeOptions, build_engine

    from .conftest import free_cuda_memory, speculative_engine

    pattern = "(ab|cd){3,6}e"
    results = {}
    for setting in ("sync", "overlap", "mtp"):
        if setting == "mtp":
            engine = speculative_engine(cuda_artifact, 1)
        else:
            options = ServeOptions(artifact=cuda_artifact, max_num_seqs=8, kv_memory_gib=1.0)
            engine = build_engine(options)[0]
            engine.config.async_scheduling = setting == "overlap"
        grammars = Grammars(engine.tokenizer, engine.runner.config.vocab_size)
        regex = grammars.compile(GrammarSpec("regex", pattern, "guided_regex"))
        choice = grammars.compile(GrammarSpec("choice", ["sunny", "cloudy"], "guided_choice"))
        requests = _requests(penalties=False)[:4]
        for i, (grammar, seed) in enumerate([(regex, None), (regex, 3), (choice, None)] * 2):
            params = (
                SamplingParams(temperature=0.0)
                if seed is None
                else SamplingParams(temperature=1.0, seed=seed)
            )
            requests.append(GenerationRequest(f"g{i}", [9, 17, 4 + i], params, 40, grammar=grammar))
        results[setting] = _run(engine, requests)
        del engine
        free_cuda_memory()
    assert results["overlap"] == results["sync"]
    for i in range(6):
        text, reason = results["sync"][f"g{i}"][1:3]
        assert reason == "stop" and (
            text in ("sunny", "cloudy") if i % 3 == 2 else re.fullmatch(pattern, text)
        )
    greedy = [f"g{i}" for i in (0, 2, 3, 5)] + [
        "r0",
        "r2",
    ]  # MTP's sampled draws differ from plain decoding's
    assert {r: results["mtp"][r] for r in greedy} == {r: results["sync"][r] for r in greedy}


@pytest.mark.parametrize("budget", [16, 24])
def test_concurrent_requests_with_one_prefix_compute_it_once(model, tokenizer, budget):
    """Six requests on one 40-token prefix, submitted together: the prefix is computed once (the
    tokens computed are the prefix plus each request's own 8), with overlap on — where the chunk that
    writes the prefix's last pages is still in flight when the next step is planned — as off, and
    the outputs agree."""
    prefix = [(7 * i + 3) % 90 + 3 for i in range(40)]
    results = {}
    for overlap in (False, True):
        config = EngineConfig(
            num_pages=256, page_size=4, max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=96,
            async_scheduling=overlap,
        )  # fmt: skip
        engine = Engine(model, tokenizer, config)
        requests = [
            GenerationRequest(
                f"r{r}",
                prefix + [(5 * i + 11 * r) % 80 + 5 for i in range(8)],
                SamplingParams(temperature=0.0),
                max_tokens=3,
                ignore_eos=True,
            )
            for r in range(6)
        ]
        results[overlap] = _run(engine, requests)
        metrics = engine.metrics
        computed = metrics.prefix_queries._value.get() - metrics.prefix_hits._value.get()
        assert computed == 40 + 6 * 8, (overlap, computed)
    assert results[True] == results[False]


def test_a_step_that_fails_while_read_before_the_draws_ends_each_request_last(model, tokenizer, monkeypatch):
    """A failure while reading a step whose outputs are held (a penalised request's history read
    before the next draws): each request's error output comes after the tokens already emitted for
    it, never before them."""
    engine = _engine(model, tokenizer, overlap=True)
    emit_sampled, calls = engine._emit_sampled, []

    def failing(*args, **kwargs):
        emit_sampled(*args, **kwargs)  # this step's tokens are emitted (and held) ...
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("boom")  # ... then reading it fails

    monkeypatch.setattr(engine, "_emit_sampled", failing)
    outputs: dict[str, list[StepOutput]] = {}
    for request in _requests(penalties=True):
        engine.submit(request, outputs.setdefault(request.request_id, []).append)
    while engine._iterate():
        pass
    failed = [rid for rid, outs in outputs.items() if outs[-1].finish_reason == "error"]
    assert failed
    for outs in outputs.values():
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished

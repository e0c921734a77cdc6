import math

import pytest
import torch

from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.serve.engine.detokenizer import IncrementalDetokenizer
from hy3c.serve.engine.sampler import History, SamplingParams, apply_penalties, sample


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    out = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], [History([0], [1])])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    out = apply_penalties(
        logits, [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], [History([0], [2, 2, 3])]
    )
    assert out.tolist() == [[2.0, -2.0, 0.0, -0.25]]


def test_greedy_seeded_and_injected_noise():
    logits = torch.randn(3, 50)
    hist = [History([], [])] * 3
    greedy = sample(logits, [SamplingParams(temperature=0.0)] * 3, hist, [None] * 3, num_logprobs=2)
    assert greedy.tokens == logits.argmax(-1).tolist()
    assert greedy.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1).max()))
    assert next(t for t, _ in greedy.top[1]) == greedy.tokens[1]
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=5)] * 3

    def run(seed):
        gens = [torch.Generator().manual_seed(seed + i) for i in range(3)]
        return sample(logits, params, hist, gens).tokens

    assert run(1) == run(1)
    noise = torch.rand(3, 50)
    a = sample(logits, params, hist, [None] * 3, noise=noise).tokens
    assert a == sample(logits, params, hist, [None] * 3, noise=noise).tokens


def test_seeded_samples_follow_the_distribution():
    """Chi-square goodness of fit of 4000 seeded draws against softmax(logits / T) (fixed seed)."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0]])
    p = SamplingParams(temperature=0.8)
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(6)
    for _ in range(4000):
        counts[sample(logits, [p], [History([], [])], [gen]).tokens[0]] += 1
    expected = torch.softmax(logits[0] / 0.8, -1) * 4000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # p = 0.001 at 5 degrees of freedom
    assert math.isfinite(chi2)


@pytest.mark.parametrize("byte_table", [True, False])
def test_detokenizer_streams_utf8_safely_and_stops_across_tokens(tiny_ckpt, byte_table):
    tok = Hy3Tokenizer.from_dir(tiny_ckpt) if byte_table else _without_byte_table(tiny_ckpt)
    text = "naïve 日本語 café, then STOP and more"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, ["STOP"])
    pieces = [detok.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == "naïve 日本語 café, then "
    assert detok.stopped_by == "STOP"
    plain = IncrementalDetokenizer(tok)
    assert "".join(plain.push(i) for i in ids) + plain.flush() == text


def test_the_first_stop_string_in_the_text_wins_whatever_their_order(tiny_ckpt):
    tok = Hy3Tokenizer.from_dir(tiny_ckpt)
    ids = tok.encode("say I said it")
    for stops in (["I", " "], [" ", "I"]):
        detok = IncrementalDetokenizer(tok, stops)
        out = "".join(detok.push(i) for i in ids) + detok.flush()
        assert out == "say" and detok.stopped_by == " "


def test_logprob_token_text_and_bytes_round_trip(tiny_ckpt):
    """OpenAI's token strings: whole characters as text, partial UTF-8 as `bytes:\\x..`; bytes exact."""
    tok = Hy3Tokenizer.from_dir(tiny_ckpt)
    ids = tok.encode("日本 and ü")
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == "日本 and ü"
    texts = [tok.token_text(i) for i in ids]
    assert any(t.startswith("bytes:\\x") for t in texts) and " and" in "".join(texts)


def test_every_id_of_a_larger_vocabulary_decodes_to_its_own_text(tmp_path):
    """Real-shape checkpoints (vocab 120832) get placeholder tokens past the 512 trained entries, so a
    random model's tokens stream as text one by one."""
    from hy3c.checkpoint.tiny_tokenizer import write_tokenizer_files

    write_tokenizer_files(tmp_path, 2000, 4096)
    tok = Hy3Tokenizer.from_dir(tmp_path)
    assert tok.vocab_size == 2000
    assert tok.decode([1999]) == "<|t1999|>" and tok.decode([700, 701]) == "<|t700|><|t701|>"
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(t) for t in (900, 901)] == ["<|t900|>", "<|t901|>"]
    assert max(tok.encode("Hello, world <t5>")) < 512  # plain text still uses the trained entries


def test_penalties_of_many_rows_at_once_match_row_by_row():
    logits = torch.randn(4, 30)
    params = [
        SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2),
        SamplingParams(),
        SamplingParams(frequency_penalty=-0.5),
        SamplingParams(repetition_penalty=0.8),
    ]
    history = [
        History([1, 2, 2], [2, 5, 5, 5]),
        History([3], [4]),
        History([], [7, 7, 9]),
        History([0, 29], []),
    ]
    out = apply_penalties(logits, params, history)
    expected = logits.clone()
    for row, (p, h) in enumerate(zip(params, history)):
        for t in set(h.prompt) | set(h.output):
            v = expected[row, t]
            expected[row, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(h.output):
            expected[row, t] -= p.presence_penalty + p.frequency_penalty * h.output.count(t)
    torch.testing.assert_close(out, expected)
    untouched = [SamplingParams()] * 4
    assert apply_penalties(logits, untouched, history) is logits  # nothing to apply: no copy


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 30])
def test_fused_sampler_columns_start_aligned_for_every_batch_size(rows):
    """Triton specializes on 16-byte pointer alignment: the per-row parameter columns must be aligned
    whatever the batch size, or a new batch size compiles new kernel variants on live traffic."""
    from hy3c.serve.engine.sampler import fused_inputs

    params = [SamplingParams(temperature=0.5 + r, top_k=r, top_p=0.9, min_p=0.01 * r) for r in range(rows)]
    seeds = [7 * r + 1 for r in range(rows)]
    columns = fused_inputs(params, seeds, torch.device("cpu")).columns
    assert len(columns) == 5 and all(c.shape == (rows,) and c.data_ptr() % 16 == 0 for c in columns)
    temperature, top_k, top_p, min_p, seed = columns
    assert temperature.tolist() == pytest.approx([p.temperature for p in params])
    assert top_k.tolist() == [p.top_k for p in params] and seed.tolist() == seeds
    assert top_p.tolist() == pytest.approx([0.9] * rows)
    assert min_p.tolist() == pytest.approx([p.min_p for p in params])


def test_prepared_inputs_are_the_ones_the_fused_sampler_uses(monkeypatch):
    """The engine uploads the columns before the model step; `sample` must use them as they are (and
    draw no second seed from the request's generator), and prepare them itself when not given."""
    import hy3c.serve.engine.sampler as sampler_mod

    used = []

    def fake_kernel(logits, *columns_noise_and_num_logprobs):
        used.append(columns_noise_and_num_logprobs[:5])
        return torch.ops.hy3.sample(logits, *columns_noise_and_num_logprobs)

    monkeypatch.setattr(sampler_mod, "_triton_sampler", lambda: fake_kernel)
    logits = torch.randn(2, 11)
    monkeypatch.setattr(type(logits), "is_cuda", property(lambda self: True))
    params, history = [SamplingParams(), SamplingParams(top_k=3)], [History([], []), History([], [])]
    prepared = sampler_mod.fused_inputs(params, [5, 6], torch.device("cpu"))
    gens = [torch.Generator().manual_seed(0), None]
    state = gens[0].get_state()
    sample(logits, params, history, gens, prepared=prepared)
    assert used[-1] == prepared.columns and torch.equal(gens[0].get_state(), state)
    monkeypatch.setattr(sampler_mod, "prepare_fused", lambda p, g, d: sampler_mod.fused_inputs(p, [9, 9], d))
    sample(logits, params, history, gens)
    assert used[-1][4].tolist() == [9, 9]


def test_no_rows_sample_nothing_and_integer_parameters_stay_floats(monkeypatch):
    """A step whose chunks want no logits samples nothing (on the fused path too); parameters that are
    whole numbers still travel as fp32 columns."""
    import hy3c.serve.engine.sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "_triton_sampler", lambda: None)
    empty = sample(torch.empty(0, 11), [], [], [])
    assert empty.tokens == [] and empty.logprobs == [] and empty.top == []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(sampler_mod, "_triton_sampler", lambda: pytest.fail)  # never reached for no rows
    assert sample(torch.empty(0, 11), [], [], []).tokens == []
    columns = sampler_mod.fused_inputs(
        [SamplingParams(temperature=1, top_p=1, min_p=0)], [3], torch.device("cpu")
    )
    assert [c.dtype for c in columns.columns] == [
        torch.float32,
        torch.int32,
        torch.float32,
        torch.float32,
        torch.int32,
    ]


def _without_byte_table(directory) -> Hy3Tokenizer:
    """The checkpoint's tokenizer with the byte-table fast path off: text goes through DecodeStream."""
    tok = Hy3Tokenizer.from_dir(directory)
    tok.streaming_bytes = None
    return tok


def test_byte_table_streaming_equals_decoding_the_whole_sequence(tiny_ckpt, monkeypatch):
    """The byte-level fast path (one table lookup per token) streams exactly what decoding the whole
    sequence gives, like the DecodeStream path — random ids (past the tokenizer's vocabulary too, as a
    padded model vocabulary gives), partial UTF-8 and special tokens included — and a tokenizer
    without a plain byte-level decoder streams through DecodeStream."""
    import random

    tok = Hy3Tokenizer.from_dir(tiny_ckpt)
    streaming = _without_byte_table(tiny_ckpt)
    assert tok.streaming_bytes is not None and len(tok.streaming_bytes) == tok.vocab_size
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size + 8) for _step in range(rng.randint(1, 40))]
        fast = IncrementalDetokenizer(tok)
        streamed = "".join(fast.push(i) for i in ids) + fast.flush()
        assert streamed == tok.decode(ids), ids
        slow = IncrementalDetokenizer(streaming)
        assert slow.stream is not None and slow.utf8 is None
        assert "".join(slow.push(i) for i in ids) + slow.flush() == streamed
    text = "naïve 日本語 café"
    for t in (tok, streaming):
        detok = IncrementalDetokenizer(t)
        assert [p for p in (detok.push(i) for i in t.encode(text)) if "\ufffd" in p] == []
    other = Hy3Tokenizer.from_dir(tiny_ckpt)
    from tokenizers import decoders

    other.tokenizer.decoder = decoders.Metaspace()
    assert other.streaming_bytes is None and IncrementalDetokenizer(other).stream is not None


def test_decode_stream_splits_multibyte_characters_and_flushes_a_partial_one(tiny_ckpt):
    """A character whose UTF-8 bytes span tokens comes out whole, with the token that completes it; a
    generation that ends inside one flushes it as U+FFFD, exactly like decoding the whole sequence."""
    tok = _without_byte_table(tiny_ckpt)
    ids = tok.encode("日本")
    assert len(ids) > 2  # the tiny byte-level BPE splits each character over tokens
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert [p for p in pieces if p] == ["日", "本"] and "".join(pieces) + detok.flush() == "日本"
    cut = ids[:-1]
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.push(i) for i in cut)
    assert (
        streamed == "日"
        and streamed + detok.flush() == tok.decode(cut)
        and tok.decode(cut).endswith("\ufffd")
    )


@pytest.mark.parametrize("fast", [True, False])
def test_a_long_generation_keeps_a_short_buffer_and_finds_a_late_stop(tiny_ckpt, fast):
    """Thousands of tokens: the streamed text is the whole decode, the detokenizer keeps only what a stop
    search can still reach, and a stop string that arrives late (split over tokens) is still found."""
    tok = Hy3Tokenizer.from_dir(tiny_ckpt)
    ids = tok.encode("naïve 日本語 café, more words; " * 300)
    stop_ids = tok.encode(" then STOP here")
    detok = IncrementalDetokenizer(tok if fast else _without_byte_table(tiny_ckpt), ["STOP"])
    sizes, pieces = [], []
    for i in ids + stop_ids:
        pieces.append(detok.push(i))
        sizes.append(len(detok.text))
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids) + " then " and detok.stopped_by == "STOP"
    assert max(sizes) < 1100 < len(tok.decode(ids))


def _fused(logits, params, history, num_logprobs=0, noise=None):
    """The fused-sampler dispatch (`_sample_fused`: penalties and bias, then the Triton kernel, under
    TRITON_INTERPRET=1 on CPU) with the columns the engine would upload."""
    import hy3c.serve.engine.sampler as sampler_mod

    inputs = sampler_mod.fused_inputs(params, [11 + r for r in range(len(params))], logits.device)
    return sampler_mod._sample_fused(logits, params, history, inputs, num_logprobs, noise).result()


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 1e-6, 5e-324])
def test_temperatures_below_the_epsilon_are_greedy_on_both_paths(temperature):
    """1 / 1e-40 overflows fp32: such temperatures are greedy (vLLM's 1e-5 epsilon), with finite
    logprobs, in the reference and through the fused kernel — and 1e-5 itself samples, finitely."""
    from hy3c.serve.engine.sampler import SAMPLING_EPS

    logits = torch.randn(3, 300) * 4
    history = [History([1, 2], [3])] * 3
    params = [SamplingParams(temperature=temperature, top_p=0.9, top_k=20)] * 3
    assert params[0].greedy and params[0].temperature == 0.0
    for result in (
        sample(logits, params, history, [None] * 3, num_logprobs=3),
        _fused(logits, params, history, 3),
    ):
        assert result.tokens == logits.argmax(-1).tolist()
        assert all(math.isfinite(v) for v in result.logprobs)
        assert all(math.isfinite(v) for row in result.top for _, v in row)
    edge = [SamplingParams(temperature=SAMPLING_EPS)] * 3
    assert not edge[0].greedy
    noise = torch.rand(3, 300)
    ref = sample(logits, edge, history, [None] * 3, num_logprobs=2, noise=noise)
    fused = _fused(logits, edge, history, 2, noise)
    assert fused.tokens == ref.tokens == logits.argmax(-1).tolist()  # T = 1e-5: as good as greedy
    assert all(math.isfinite(v) for v in ref.logprobs + fused.logprobs)


def test_an_extreme_repetition_penalty_keeps_logits_and_logprobs_finite():
    """A repetition penalty of 1e-300 is 0 in fp32: dividing a positive logit by it gives inf, and inf
    logits give NaN logprobs. Penalised logits are clamped to ±PENALISED_LOGIT_LIMIT (a -inf mask
    stays -inf), so both paths stay finite and agree."""
    from hy3c.serve.engine.sampler import PENALISED_LOGIT_LIMIT

    logits = torch.randn(2, 200)
    logits[:, 7] = 3.0
    logits[:, 8] = -3.0
    logits[:, 9] = float("-inf")
    history = [History([7, 8, 9], [])] * 2
    params = [SamplingParams(temperature=1e-5, repetition_penalty=1e-300)] * 2
    penalised = apply_penalties(logits, params, history)
    assert penalised[0, 7] == PENALISED_LOGIT_LIMIT and penalised[0, 8] == 0.0
    assert penalised[0, 9] == float("-inf") and torch.isfinite(penalised[:, :9]).all()
    noise = torch.rand(2, 200)
    ref = sample(logits, params, history, [None] * 2, num_logprobs=2, noise=noise)
    fused = _fused(logits, params, history, 2, noise)
    assert ref.tokens == fused.tokens == [7, 7]
    for result in (ref, fused):
        assert all(math.isfinite(v) for v in result.logprobs)
        assert all(math.isfinite(v) for row in result.top for _, v in row)


def test_logit_bias_steers_both_paths_alike():
    """+100 makes a token the greedy pick, -100 removes the argmax, in the reference and through the
    fused dispatch (the bias is added before the kernel); logprobs follow the biased distribution."""
    logits = torch.randn(3, 400)
    best = logits.argmax(-1).tolist()
    history = [History([], [])] * 3
    params = [
        SamplingParams(temperature=0.0, logit_bias=((5, 100.0),)),
        SamplingParams(temperature=0.0, logit_bias=((best[1], -100.0),)),
        SamplingParams(temperature=0.7, logit_bias=((9, 100.0), (10, -100.0))),
    ]
    noise = torch.rand(3, 400)
    ref = sample(logits, params, history, [None] * 3, num_logprobs=1, noise=noise)
    fused = _fused(logits, params, history, 1, noise)
    second = logits[1].clone()
    second[best[1]] = float("-inf")
    assert ref.tokens == fused.tokens == [5, int(second.argmax()), 9]
    biased = logits[0].clone()
    biased[5] += 100.0
    assert ref.logprobs[0] == pytest.approx(float(torch.log_softmax(biased, -1)[5]), abs=1e-5)
    torch.testing.assert_close(torch.tensor(fused.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=1e-4)
    assert apply_penalties(logits, [SamplingParams()] * 3, history) is logits  # no bias: no copy


def test_a_completed_event_is_not_waited_on():
    """`wait_event` asks first (`query` keeps the GIL) and synchronizes only an event still pending."""
    from hy3c.serve.engine.sampler import wait_event

    class Event:
        def __init__(self, done: bool) -> None:
            self.done, self.waited = done, False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.waited = True

    done, pending = Event(True), Event(False)
    wait_event(done)
    wait_event(pending)
    assert not done.waited and pending.waited

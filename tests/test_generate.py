import pytest
import torch

from hy3c.checkpoint.loader import load_model
from hy3c.checkpoint.reference import model_logits
from hy3c.generate import generate_tokens
from hy3c.sampling import SamplingParams, filtered_probs


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt, dtype=torch.float32, progress=False)


def test_greedy_generation_equals_step_by_step_recompute(model):
    prompts = [[5, 9, 100, 7], list(range(20, 51))]
    outputs = generate_tokens(model, prompts, max_tokens=6, stop_ids=[])
    for prompt, out in zip(prompts, outputs):
        seq = list(prompt)
        for _ in range(6):
            seq.append(int(model_logits(model, torch.tensor([seq]))[0, -1].argmax()))
        assert out == seq[len(prompt) :]


def test_chunked_prefill_and_page_size_do_not_change_greedy_output(model):
    prompts = [list(range(3, 40)), [7]]
    base = generate_tokens(model, prompts, 5, stop_ids=[])
    assert generate_tokens(model, prompts, 5, stop_ids=[], page_size=3, prefill_chunk=4) == base


def test_seeded_sampling_is_reproducible(model):
    p = [SamplingParams(temperature=1.0, seed=11)]
    a = generate_tokens(model, [[1, 2, 3]], 20, p, stop_ids=[])
    assert a == generate_tokens(model, [[1, 2, 3]], 20, p, stop_ids=[])
    assert a != generate_tokens(
        model, [[1, 2, 3]], 20, [SamplingParams(temperature=1.0, seed=12)], stop_ids=[]
    )


def test_stop_token_ends_generation_and_is_not_returned(model):
    first = generate_tokens(model, [[4, 5, 6]], 1, stop_ids=[])[0][0]
    assert generate_tokens(model, [[4, 5, 6]], 8, stop_ids=[first]) == [[]]


def test_sampling_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert filtered_probs(logits, SamplingParams(1.0, top_k=2)).tolist() == pytest.approx(
        [0.625, 0.375, 0, 0]
    )
    assert filtered_probs(logits, SamplingParams(1.0, top_p=0.7)).tolist() == pytest.approx(
        [0.625, 0.375, 0, 0]
    )
    assert filtered_probs(logits, SamplingParams(1.0, min_p=0.25)).tolist() == pytest.approx(
        [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
    ],
)
def test_bad_sampling_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_generate_rejects_mismatched_parameters_and_zero_tokens(tiny_ckpt):
    model = load_model(tiny_ckpt, dtype=torch.float32, progress=False)
    with pytest.raises(ValueError, match="1 sampling parameter sets for 2 prompts"):
        generate_tokens(model, [[1, 2], [3]], 2, params=[SamplingParams()])
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        generate_tokens(model, [[1, 2]], 0)

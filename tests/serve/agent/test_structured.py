"""The grammar masks of structured outputs (`serve/agent/structured.py`) against their references: the
parallel fill equals one request at a time and into the rows asked, the sampler op's unpacking leaves
exactly the allowed tokens, and a
grammar's tokens walk to a complete document that the stop token then ends."""

from __future__ import annotations

import json

import pytest
import torch

from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.ops.sample import unpack_allowed
from hy3c.serve.agent.structured import (
    Grammars,
    GrammarSpec,
    allocate_masks,
    fill_masks,
    new_constraint,
)

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def grammars(tiny_ckpt) -> Grammars:
    tokenizer = Hy3Tokenizer.from_dir(tiny_ckpt)
    return Grammars(tokenizer, tokenizer.vocab_size)


def _allowed(mask: torch.Tensor, row: int, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(mask[row, t // 32]) >> (t % 32)) & 1}


def test_parallel_fill_equals_one_at_a_time_and_masks_apply(grammars):
    tok, vocab = grammars.tokenizer, grammars.vocab_size
    specs = [
        GrammarSpec("json", SCHEMA, "x"),
        GrammarSpec("regex", "[ab]+c", "y"),
        GrammarSpec("choice", ["yes", "no"], "z"),
    ]
    constraints = [new_constraint(grammars.compile(spec)) for spec in specs]
    assert constraints[0].accept(tok.encode("{")[0])  # states differ per request
    together = allocate_masks(3, vocab)
    fill_masks(constraints, together)
    for row, constraint in enumerate(constraints):
        alone = allocate_masks(1, vocab)
        constraint.fill(alone, 0)
        assert _allowed(together, row, vocab) == _allowed(alone, 0, vocab) != set()
    step = allocate_masks(5, vocab)  # a step's rows: those without a grammar allow every token
    fill_masks(constraints, step, [0, 2, 3])
    unpacked = unpack_allowed(step, vocab)
    assert unpacked[1].all() and unpacked[4].all()
    for row, mask_row in ((0, 0), (2, 1), (3, 2)):
        assert {t for t in range(vocab) if unpacked[row, t]} == _allowed(together, mask_row, vocab)


def test_a_walk_under_the_mask_ends_in_a_valid_document_and_then_only_eos(grammars):
    tok, vocab = grammars.tokenizer, grammars.vocab_size
    bounded = {**SCHEMA, "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    constraint = new_constraint(grammars.compile(GrammarSpec("json", bounded, "x")))
    eos = tok.token_to_id(tok.eos_token)
    out = []
    for _ in range(60):
        mask = allocate_masks(1, vocab)
        constraint.fill(mask, 0)
        allowed = sorted(_allowed(mask, 0, vocab))
        if allowed == [eos]:
            break
        token = next(t for t in reversed(allowed) if t != eos)  # the highest id: some walk
        assert constraint.accept(token)
        out.append(token)
    assert json.loads(tok.decode(out)).keys() == {"n"}


def test_a_grammar_the_library_rejects_names_the_field(grammars):
    from hy3c.serve.agent.structured import GrammarError

    with pytest.raises(GrammarError, match="guided_regex: not a grammar"):
        grammars.compile(GrammarSpec("regex", "(", "guided_regex"))


@pytest.mark.parametrize(
    ("spec", "answer"),
    [(GrammarSpec("json", SCHEMA, "x"), '{"n":42}'), (GrammarSpec("choice", ["yes", "no"], "y"), "no")],
)
def test_after_the_reasoning_tag_the_grammar_holds_only_what_follows(grammars, spec, answer):
    """Reasoning on (`after`): any text runs until the think block's end tag, where the stop token
    is not allowed; past the tag only the grammar's own output, then only the stop token."""
    from dataclasses import replace

    from hy3c.serve.agent.markup import Hy3Markup

    tok, vocab = grammars.tokenizer, grammars.vocab_size
    close = Hy3Markup.of(tok).think_close
    close_id, eos = tok.added_tokens[close], tok.token_to_id(tok.eos_token)
    constraint = new_constraint(grammars.compile(replace(spec, after=close)))
    free_text = tok.encode("let me think: it is not JSON")

    def allowed() -> set[int]:
        mask = allocate_masks(1, vocab)
        constraint.fill(mask, 0)
        return _allowed(mask, 0, vocab)

    for token in free_text:
        assert token in allowed() and close_id in allowed() and eos not in allowed()
        assert constraint.accept(token)
    assert constraint.accept(close_id)
    after_tag = allowed()
    assert free_text[0] not in after_tag and close_id not in after_tag and eos not in after_tag
    for token in tok.encode(answer):
        assert constraint.accept(token)
    assert allowed() == {eos}
    assert not new_constraint(grammars.compile(spec)).accept(free_text[0])  # without `after`: refused


def test_many_masks_go_to_the_pool_and_few_cheap_ones_are_filled_in_turn(grammars, monkeypatch):
    """Past IN_TURN_AT_MOST masks after the first (an engine sharing its process with the HTTP loop),
    llguidance's pool fills them (one GIL release a step, not one a mask); either way the rows equal
    one-at-a-time fills. Without that bound, only the fills' expected time sends them to the pool."""
    import llguidance.torch

    from hy3c.serve.agent import structured

    pooled = []
    real = llguidance.torch.fill_next_token_bitmask_par
    monkeypatch.setattr(
        llguidance.torch, "fill_next_token_bitmask_par", lambda *a: (pooled.append(len(a[1])), real(*a))
    )
    monkeypatch.setattr(structured, "PARALLEL_AFTER_S", float("inf"))  # the count alone decides here
    vocab = grammars.vocab_size
    grammar = grammars.compile(GrammarSpec("regex", "[ab]+c", "y"))
    for count, through_pool in (
        (1 + structured.IN_TURN_AT_MOST, False),
        (2 + structured.IN_TURN_AT_MOST, True),
    ):
        pooled.clear()
        constraints = [new_constraint(grammar) for _ in range(count)]
        for i, constraint in enumerate(constraints):  # states differ per row
            for token in grammars.tokenizer.encode("ab" * i):
                assert constraint.accept(token)
        masks = allocate_masks(count, vocab)
        fill_masks(constraints, masks)
        assert pooled == ([count - 1] if through_pool else [])
        for row, constraint in enumerate(constraints):
            alone = allocate_masks(1, vocab)
            constraint.fill(alone, 0)
            assert _allowed(masks, row, vocab) == _allowed(alone, 0, vocab)
    # an engine in a process of its own: no count bound, their time alone decides
    constraints = [new_constraint(grammar) for _ in range(2 + structured.IN_TURN_AT_MOST)]
    pooled.clear()
    fill_masks(constraints, allocate_masks(len(constraints), vocab), in_turn_at_most=None)
    assert pooled == []
    monkeypatch.setattr(structured, "PARALLEL_AFTER_S", 0.0)
    fill_masks(constraints, allocate_masks(len(constraints), vocab), in_turn_at_most=None)
    assert pooled == [len(constraints) - 1]


@pytest.mark.parametrize("padded", [0, 64])
@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec("json", SCHEMA, "x"),
        GrammarSpec("regex", "[ab]+ é\u4e2d{2}", "y"),
        GrammarSpec("choice", ["yes", "no", "<think>"], "z"),
        GrammarSpec("regex", "[\\s\\S]{0,40}", "w"),  # special tokens are never text
    ],
)
def test_the_byte_table_gives_the_masks_the_tokenizer_json_gives(tiny_ckpt, spec, padded):
    """llguidance's token table built from the byte-level vocabulary (`byte_level_table`, fast at any
    number of added tokens) allows exactly the tokens of the one it builds from the tokenizer's JSON,
    at every state of walks under the mask (specials, markup tokens and multi-byte text included), also
    for a model whose vocabulary is padded past the tokenizer's."""
    import llguidance

    from hy3c.serve.agent import structured

    tokenizer = Hy3Tokenizer.from_dir(tiny_ckpt)
    vocab, eos = tokenizer.vocab_size + padded, tokenizer.token_to_id(tokenizer.eos_token)
    table = structured.byte_level_table(tokenizer.tokenizer, eos, vocab)
    assert table is not None and len(table.tokens) == vocab
    tables = {
        "bytes": llguidance.LLTokenizer(llguidance.TokenizerWrapper(table), n_vocab=vocab, eos_token=eos),
        "json": llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=vocab, eos_token=eos),
    }
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        grammars = {}
        for name, tokens in tables.items():
            grammars[name] = Grammars(tokenizer, vocab)
            grammars[name]._tokens = tokens
        walkers = {name: new_constraint(g.compile(spec)) for name, g in grammars.items()}
        for _ in range(24):
            masks = {}
            for name, walker in walkers.items():
                masks[name] = allocate_masks(1, vocab)
                walker.fill(masks[name], 0)
            allowed = _allowed(masks["bytes"], 0, vocab)
            assert allowed == _allowed(masks["json"], 0, vocab) and allowed
            if allowed == {eos}:
                break
            token = sorted(allowed)[int(torch.randint(len(allowed), (1,), generator=generator))]
            assert all(walker.accept(token) for walker in walkers.values())


def test_warming_the_token_table_never_raises_and_the_first_request_builds_it(tiny_ckpt, monkeypatch):
    """`warm` runs on a daemon thread as the server starts: a failure there (the process stopping
    under the import) is only logged, and the table is built by the first grammar compiled."""
    tokenizer = Hy3Tokenizer.from_dir(tiny_ckpt)
    cold = Grammars(tokenizer, tokenizer.vocab_size)
    build = cold._tokens_of
    monkeypatch.setattr(cold, "_tokens_of", lambda: (_ for _ in ()).throw(RuntimeError("shutting down")))
    cold.warm()
    assert cold._tokens is None
    monkeypatch.setattr(cold, "_tokens_of", build)
    assert cold.compile(GrammarSpec("regex", "[ab]+c", "y")) is not None and cold._tokens is not None

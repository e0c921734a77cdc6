"""Grammar token masks on the host, the two libraries side by side (issue: pick by measurement):
llguidance and xgrammar, each given the same tokenizer and the same JSON schema, timed per decoded
token — compile the grammar once, then for each token of a valid JSON document generated under the
mask (the lowest allowed id each time: a walk through the grammar) compute the next mask and accept the
token. The tiny checkpoint's tokenizer and, for the real vocabulary's size, a byte-level vocabulary of
`--vocab` tokens (random byte strings: the libraries read only the tokens' bytes).

    python3 bench/grammar_mask_bench.py [--vocab 120832] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def synthetic_tokenizer(vocab: int) -> Tokenizer:
    """A byte-level BPE of `vocab` entries: the 256 bytes, then random 2–8 byte pieces, eos last."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    rng = random.Random(0)
    pieces = {ch: i for i, ch in enumerate(sorted(alphabet))}
    printable = [ch for ch in sorted(alphabet) if ch.isprintable()]
    while len(pieces) < vocab - 1:
        pieces.setdefault("".join(rng.choice(printable) for _ in range(rng.randint(2, 8))), len(pieces))
    pieces["<eos>"] = len(pieces)
    tok = Tokenizer(models.BPE(pieces, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def time_llguidance(tok: Tokenizer, eos: int, tokens: int) -> tuple[float, float, int]:
    import llguidance
    import llguidance.torch as lt

    started = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - started
    mask = lt.allocate_token_bitmask(1, tok.get_vocab_size())
    times, n = [], 0
    for _ in range(tokens):
        started = time.perf_counter()
        lt.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - started)
        bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: tok.get_vocab_size()])
        token = int(allowed[0]) if allowed[0] != eos or len(allowed) == 1 else int(allowed[1])
        matcher.consume_token(token)
        n += 1
        if token == eos or matcher.is_stopped():
            break
    return compile_s, statistics.median(times), n


def time_xgrammar(tok: Tokenizer, eos: int, tokens: int) -> tuple[float, float, int]:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    started = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=tok.id_to_token(eos))
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=tok.get_vocab_size())
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    matcher = xgrammar.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - started
    mask = xgrammar.allocate_token_bitmask(1, tok.get_vocab_size())
    times, n = [], 0
    for _ in range(tokens):
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - started)
        bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: tok.get_vocab_size()])
        token = int(allowed[0]) if allowed[0] != eos or len(allowed) == 1 else int(allowed[1])
        matcher.accept_token(token)
        n += 1
        if token == eos or matcher.is_terminated():
            break
    return compile_s, statistics.median(times), n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=120832)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    from hy3c.checkpoint.tiny_tokenizer import train_tiny_tokenizer
    from hy3c.checkpoint.tokenizer import EOS

    tiny = train_tiny_tokenizer()
    cases = [
        ("tiny (512)", tiny, tiny.token_to_id(EOS)),
        (f"synthetic ({args.vocab})", synthetic_tokenizer(args.vocab), args.vocab - 1),
    ]
    print(f"grammar masks on the host: torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| vocabulary | library | compile ms | mask per token µs (median) | tokens |")
    print("|---|---|---|---|---|")
    for name, tok, eos in cases:
        for library, run in (("llguidance", time_llguidance), ("xgrammar", time_xgrammar)):
            compile_s, per_token, n = run(tok, eos, args.tokens)
            print(f"| {name} | {library} | {compile_s * 1e3:.1f} | {per_token * 1e6:.1f} | {n} |")


if __name__ == "__main__":
    main()

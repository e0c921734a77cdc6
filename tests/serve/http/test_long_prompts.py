"""Long prompts and the HTTP event loop: a long text is tokenized on a worker thread, and the tokenizer
lets go of the GIL meanwhile, so the other requests' streams keep flowing (a 68K-token prompt held the
loop for ~70 ms before). The ids are those of the tokenizer's single `encode`."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from types import SimpleNamespace

from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.serve.http.api_context import OFF_LOOP_CHARS, ApiContext


def _code(chars: int) -> str:
    lines = (f"def f_{i}(x):\n    return x * {i} + 'é中🙂'\n" for i in range(chars))
    text = ""
    while len(text) < chars:
        text += next(lines)
    return text[:chars]


def test_encode_gives_the_single_encodes_ids(tiny_ckpt):
    tok = Hy3Tokenizer.from_dir(tiny_ckpt)
    added = [token.content for token in tok.tokenizer.get_added_tokens_decoder().values()]
    rng = random.Random(0)
    texts = ["", " ", _code(5000)]
    texts += [
        "".join(rng.choice([*added, "a", " ", "\n", "é", "中文", "🙂"]) for _ in range(100))
        for _ in range(50)
    ]
    for text in texts:
        assert tok.encode(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids


def test_a_long_text_is_tokenized_on_a_worker_thread(tiny_ckpt, monkeypatch):
    tok = Hy3Tokenizer.from_dir(tiny_ckpt)
    ctx = ApiContext(engine=SimpleNamespace(vocab_size=tok.vocab_size), tokenizer=tok, config=None)
    threads: list[int] = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text: threads.append(threading.get_ident()) or encode(text))

    half = "a" * (OFF_LOOP_CHARS // 2)

    async def run() -> int:
        await ctx.encode_text("a" * OFF_LOOP_CHARS, "prompt")
        await ctx.encode_text("a" * (OFF_LOOP_CHARS + 1), "prompt")
        await ctx.prompts_ids([half, [1, 2]])  # ids: nothing to tokenize
        await ctx.prompts_ids([half, half, "a"])  # short texts, long together
        return threading.get_ident()

    loop_thread = asyncio.run(run())
    assert len(threads) == 6
    assert threads[0] == loop_thread and threads[1] != loop_thread and threads[2] == loop_thread
    assert loop_thread not in threads[3:]


def test_the_tokenizer_lets_other_threads_run_while_it_encodes(tiny_ckpt):
    """While a long text encodes on one thread, another wakes every millisecond; the single `encode`
    held the GIL throughout (no wake-up at all in ~0.1 s)."""
    tok = Hy3Tokenizer.from_dir(tiny_ckpt)
    text = _code(400_000)
    done = threading.Event()

    def encode() -> None:
        try:
            tok.encode(text)
        finally:
            done.set()

    worker = threading.Thread(target=encode)
    wakeups = 0
    worker.start()
    while not done.is_set():
        time.sleep(0.001)
        wakeups += 1
    worker.join()
    assert wakeups >= 10, wakeups

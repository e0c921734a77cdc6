"""The tiny tokenizer of random checkpoints: a small real byte-level BPE trained here, with Hy3's special
tokens and chat template, so demos and tests need no download.

* `train_tiny_tokenizer()` trains a byte-level BPE locally with `tokenizers` on `tiny_corpus.txt`, with
  the Hy3 special tokens first (ids 0..6). Any text round-trips (byte-level), which is all a random
  checkpoint needs.
* `write_tokenizer_files(dir)` writes `tokenizer.json`, `tokenizer_config.json` and
  `chat_template.jinja` (the Hy3 chat format of docs/ARCHITECTURE.md §1.8).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from hy3c.checkpoint.tokenizer import ASSISTANT, BOS, EOS, PAD, SPECIAL_TOKENS, USER

CORPUS_FILE = "tiny_corpus.txt"  # package data beside this module; trained on four times over


# Hy3 chat format: <bos>{system}<User>{user}<Assistant>{assistant}<eos> (no role token for system).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def train_tiny_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Byte-level BPE with the Hy3 special tokens at ids 0..6; at most `vocab_size` entries."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = resources.files("hy3c.checkpoint").joinpath(CORPUS_FILE).read_text() * 4
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i, f"special token {token} got id {tok.token_to_id(token)}"
    return tok


def write_tokenizer_files(directory: Path, vocab_size: int, model_max_length: int) -> dict[str, int]:
    """Write the tiny tokenizer into `directory`; return its special token ids.

    Past its 512 trained entries, every id up to `vocab_size` is a placeholder token `<|t{id}|>`, so
    whatever a random model emits decodes to text (as every id of a real checkpoint's tokenizer does):
    a stream of random tokens at real shapes is then text, token by token.
    """
    tok = train_tiny_tokenizer(min(vocab_size, 512))
    trained = tok.get_vocab_size()
    tok.add_tokens([AddedToken(f"<|t{i}|>", normalized=False) for i in range(trained, vocab_size)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}

"""The tokenizer of a checkpoint or an artifact (random checkpoints get theirs from `tiny_tokenizer`).

* `Hy3Tokenizer.from_dir(dir)` loads any checkpoint's `tokenizer.json` + chat template and offers
  encode / decode / apply_chat_template.
  A corrupt or empty `tokenizer.json`, `tokenizer_config.json` or chat template is a `TokenizerError`
  naming the file (`hy3c compile` loads the checkpoint's tokenizer this way before writing anything).
  In an artifact (a directory with manifest.json) each of them must be a regular file inside it.
"""

from __future__ import annotations

import json
import os
import random
from functools import cache, cached_property
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders

# Hy3's special tokens as the released tokenizer spells them (HY3_SPEC §11, with the ":opensource"
# suffix the release added; the preview's had none and `hy3c.serve.agent.markup` reads either spelling
# off a tokenizer). Control tokens are special (dropped from decoded text); the markup tokens of
# reasoning and tool calls are not (they reach the text, where the parsers find them).
TOKEN_SUFFIX = ":opensource"
BOS = "<｜hy_begin_of_sentence:opensource｜>"
EOS = "<｜hy_eos:opensource｜>"
PAD = "<｜hy_pad:opensource｜>"
USER = "<｜hy_User:opensource｜>"
ASSISTANT = "<｜hy_Assistant:opensource｜>"
REASONING_MODE = "<｜reasoning_mode:opensource｜>"
CONTROL_TOKENS = (BOS, EOS, PAD, USER, ASSISTANT, REASONING_MODE)
# markup tags: `<name:opensource>` and (all but tool_sep) `</name:opensource>`
MARKUP_NAMES = (
    "think",
    "tool_calls",
    "tool_call",
    "tool_sep",
    "arg_key",
    "arg_value",
    "tool_responses",
    "tool_response",
)


def markup_token(name: str, closing: bool = False, suffix: str = TOKEN_SUFFIX) -> str:
    return f"<{'/' if closing else ''}{name}{suffix}>"


MARKUP_TOKENS = tuple(
    token
    for name in MARKUP_NAMES
    for token in (markup_token(name), *(() if name == "tool_sep" else (markup_token(name, closing=True),)))
)
THINK_OPEN, THINK_CLOSE = markup_token("think"), markup_token("think", closing=True)
SPECIAL_TOKENS = CONTROL_TOKENS + MARKUP_TOKENS  # the tiny tokenizer's ids 0, 1, … in this order

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")  # what from_dir reads


class TokenizerError(ValueError):
    """A tokenizer file that cannot be read; the message names the file."""


def _read_tokenizer_files(directory: Path) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer of `directory/tokenizer.json` and the object in `tokenizer_config.json` ({} when
    there is none); TokenizerError naming the file when either is corrupt or empty."""
    file = directory / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: not found (the checkpoint has no tokenizer.json)")
    try:
        tokenizer = Tokenizer.from_str(file.read_text(encoding="utf-8"))
    except Exception as exc:  # the tokenizers library raises plain Exception; also bad UTF-8
        raise TokenizerError(f"{file}: not a valid tokenizer ({str(exc)[:200] or 'empty'})") from None
    config: dict[str, Any] = {}
    cfg_file = directory / "tokenizer_config.json"
    if cfg_file.is_file():
        try:
            config = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as exc:  # also an integer past Python's digit limit
            raise TokenizerError(f"{cfg_file}: corrupt JSON ({str(exc)[:200]})") from None
        if not isinstance(config, dict):
            raise TokenizerError(f"{cfg_file}: expected a JSON object, found {type(config).__name__}")
    return tokenizer, config


def _check_artifact_files(directory: Path) -> None:
    """An artifact's tokenizer files are untrusted like the rest of it: each one present must be a
    regular file inside the artifact (`hy3c.program.artifact.artifact_file`, ArtifactError otherwise). A
    checkpoint's are not checked so: a Hugging Face cache snapshot links its files to blobs elsewhere."""
    from hy3c.program.artifact import artifact_file

    for name in _TOKENIZER_FILES:
        if os.path.lexists(directory / name):
            artifact_file(directory, name)


class Hy3Tokenizer:
    """tokenizer.json + chat template of a checkpoint (or artifact) directory."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, special: dict[str, str]) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = special.get("bos_token", BOS)
        self.eos_token = special.get("eos_token", EOS)
        env = ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False)
        env.globals["raise_exception"] = _raise_template_error
        env.filters["tojson"] = _tojson  # as transformers renders chat templates (not HTML-escaped)
        self._template = env.from_string(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, directory: str | Path) -> Hy3Tokenizer:
        directory = Path(directory)
        if (directory / "manifest.json").is_file():
            _check_artifact_files(directory)
        tokenizer, config = _read_tokenizer_files(directory)
        template_file = directory / "chat_template.jinja"
        source = template_file if template_file.is_file() else directory / "tokenizer_config.json"
        special = {k: v for k, v in config.items() if k in ("bos_token", "eos_token") and isinstance(v, str)}
        try:
            template = (
                template_file.read_text(encoding="utf-8")
                if template_file.is_file()
                else config.get("chat_template")
            )
            if template is not None and not isinstance(template, str):
                raise TokenizerError(f"{source}: chat_template must be text, not {type(template).__name__}")
            return cls(tokenizer, template, special)
        except (UnicodeDecodeError, TemplateError) as exc:
            raise TokenizerError(f"{source}: invalid chat template ({str(exc)[:200]})") from None

    @cached_property
    def vocab_size(self) -> int:
        """The ids the tokenizer knows, added tokens included (read once: `tokenizers` builds the whole
        vocabulary to count it, 3.4 ms at 120,832 tokens, and the engine asks every constrained step)."""
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """The text's ids (no special tokens added). Through the batch call: it lets go of the GIL while
        it runs, where the single `encode` holds it, so a long prompt tokenized on a worker thread leaves
        the server's event loop running (a 200K-token text: the loop's longest stall 197 ms → 4 ms); and
        `encode_batch_fast` (tokenizers ≥ 0.21: no offsets) takes a fifth less time."""
        encoded = self._encode_batch([text], add_special_tokens=False)
        return encoded[0].ids

    @cached_property
    def _encode_batch(self):
        return getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_string(self, token_id: int) -> str:
        """The vocabulary entry of an id (unique per id, unlike decoding a partial UTF-8 byte)."""
        return self.tokenizer.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a byte-level BPE piece may hold part of a UTF-8 character)."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        piece = self.token_string(token_id)
        table = _byte_level_table()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return text.encode()

    @cached_property
    def streaming_bytes(self) -> tuple[bytes, ...] | None:
        """Each id's bytes under `decode` (special tokens: none), when decoding a sequence is exactly
        decoding the concatenation of its tokens' bytes as UTF-8 — a plain byte-level BPE decoder, as
        Hy3's. None otherwise, or when a check on random sequences finds a difference: then text is
        streamed by decoding windows of ids (`IncrementalDetokenizer`)."""
        if not isinstance(self.tokenizer.decoder, decoders.ByteLevel):
            return None
        table = _byte_level_table()
        added = self.tokenizer.get_added_tokens_decoder()
        vocab = self.vocab_size  # a call that costs milliseconds on a large vocabulary
        pieces = []
        for token_id in range(vocab):
            if token_id in added:
                token = added[token_id]
                pieces.append(b"" if token.special else token.content.encode())
                continue
            piece = self.tokenizer.id_to_token(token_id) or ""
            if any(ch not in table for ch in piece):
                return None
            pieces.append(bytes(table[ch] for ch in piece))
        rng = random.Random(0)
        for _ in range(256):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            if b"".join(pieces[i] for i in ids).decode("utf-8", "replace") != self.decode(ids):
                return None
        return tuple(pieces)

    def token_text(self, token_id: int) -> str:
        """A token as OpenAI's logprobs show it: its text, or `bytes:\\xe6\\x97` for a partial character."""
        data = self.token_bytes(token_id)
        try:
            return data.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    @cached_property
    def added_tokens(self) -> dict[str, int]:
        """The added (special and markup) tokens' texts and ids."""
        return {
            token.content: token_id for token_id, token in self.tokenizer.get_added_tokens_decoder().items()
        }

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if self._template is None:
            raise ValueError("this checkpoint has no chat template")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )


@cache
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's printable character for each of the 256 byte values, inverted."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")

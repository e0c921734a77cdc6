"""Structured outputs: a request's output held to a grammar by a token mask at each step.

`Grammars(tokenizer, vocab_size)` compiles what a request asks for — `response_format` `json_object`
or `json_schema`, vLLM's `structured_outputs` / `guided_json` / `guided_regex` / `guided_choice` — with
llguidance (bench/grammar_mask_bench.py measured xgrammar 0.2.9's masks 6× faster at Hy3's
vocabulary size, but its JSON-schema strings with `maxLength` admit raw control characters — invalid
JSON — where llguidance's do not; bench/LOG.md); the engine
gives each such request a `Constraint`, which before every draw writes the packed mask of the tokens the
grammar allows next (`fill`) and after it takes the drawn token (`accept`). Once the grammar is complete
the mask allows only the stop tokens, so the request ends there. A schema or pattern the library
rejects is a `GrammarError` naming the field."""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.logs import log_event
from hy3c.serve.agent.markup import Hy3Markup
from hy3c.serve.agent.tool_calls import schema_types, string_choices

log = logging.getLogger("hy3c.serve.agent.structured")

CACHED = 64  # compiled grammars kept (requests of one schema share one)
MAX_GRAMMAR_CHARS = 64 * 1024  # a schema, pattern or list of choices longer than this (as JSON) is refused
# A step's masks go to llguidance's pool when filling them in turn would take long (PARALLEL_AFTER_S at
# the first one's pace). Alone, in turn is the faster: 32 masks took 0.59 ms in turn against 1.23 ms
# through the pool on the H100's host (BENCHMARKS, issue 29). But each mask filled on the engine's
# thread releases and retakes the GIL, and an engine on a thread of the HTTP server may wait for the
# server's loop at every retake (32 masks in turn beside a spinning thread: ~40 ms against ~5 ms through
# the pool, on the CPU machine): there, more than IN_TURN_AT_MOST masks after the first always go to
# the pool (`EngineConfig.masks_in_turn_at_most`).
PARALLEL_AFTER_S = 1e-3
IN_TURN_AT_MOST = 3  # masks after the first, for an engine that shares its process with the HTTP loop


def _limits():
    import llguidance

    # a grammar that needs more is refused (a 400 at compile, or the request ends in error), not served
    # slowly: a tenth of llguidance's default lexer states, two fifths of its items per step
    return llguidance.LLParserLimits(max_lexer_states=25_000, step_max_items=20_000)


class GrammarError(ValueError):
    """A grammar the request asked for that cannot be compiled; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: kind ∈ json (a JSON schema), regex, choice (a list of
    strings), tool_calls (`tool_call_grammar`'s arguments); `param` the request field it came from.
    `after`: a special token the output runs free up to (the reasoning's end, `</think>`), the grammar
    holding what follows it (None: the grammar holds the whole output)."""

    kind: str
    value: Any
    param: str
    after: str | None = None


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled grammar: a matcher at its start, which each request's `Constraint` copies, the
    request field it came from (named by the 400 of a grammar that fails while generating), and its
    `source` in llguidance's grammar format (what an engine in another process compiles it from:
    `Grammars.compile_source`)."""

    matcher: Any
    param: str
    source: str


class Constraint:
    """One request's grammar state: `fill` its row of a packed int32 mask, `accept` each drawn token."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def fill(self, mask: Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, mask, row)

    def accept(self, token: int) -> bool:
        """Take a drawn token; False when the grammar does not allow it (a bug upstream of the mask)."""
        return self.matcher.consume_token(token)

    def ahead(self, drafts: list[int]) -> list[Constraint]:
        """The states a speculative step's rows are masked by: this one, then after each of `drafts`
        in turn, up to the first the grammar refuses or that ends it (the rows past it are never
        emitted from). Copies: this state is untouched until the tokens kept are `accept`ed."""
        states = [self]
        for token in drafts:
            state = states[-1].matcher.deep_copy()
            if not state.consume_token(token) or state.is_error() or state.is_stopped():
                break
            states.append(Constraint(state))
        return states

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): the printable character each byte is written as."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(shifted)}
    return {c: b for b, c in chars.items()}


class _TokenTable:
    """A byte-level tokenizer as llguidance's `TokenizerWrapper` reads it: every id's bytes, the
    special ids, and an encoder. llguidance builds its token table from these in well under a second,
    where from the tokenizer's JSON it spent ~100 s on the CPU machine on one with 120K added tokens
    (the placeholder tokenizer of `--random-weights` servers at Hy3's vocabulary: bench/LOG.md)."""

    def __init__(self, tokenizer, tokens: list[bytes], special: list[int], eos: int) -> None:
        self._tokenizer = tokenizer
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = eos
        self.bos_token_id = None

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def byte_level_table(tokenizer, eos: int, width: int) -> _TokenTable | None:
    """The token table of a `tokenizers.Tokenizer` whose decoder is byte-level BPE (Hy3's and the tiny
    one's), `eos` its stop token, `width` entries (ids past the tokenizer's, which a model's padded
    vocabulary has, are never allowed); None for any other kind (llguidance then reads the
    tokenizer's JSON itself)."""
    from tokenizers import decoders

    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return None
    added = tokenizer.get_added_tokens_decoder()
    byte_of = _byte_of_char()
    tokens = []
    for i in range(tokenizer.get_vocab_size()):
        piece = tokenizer.id_to_token(i) or ""
        if i in added:
            tokens.append(piece.encode())
        elif all(c in byte_of for c in piece):
            tokens.append(bytes(byte_of[c] for c in piece))
        else:  # a piece off the byte alphabet has no bytes: never allowed (as llguidance reads the JSON)
            tokens.append(b"")
    tokens += [b""] * (width - len(tokens))
    # every added token is a special token to the grammar, never text (as llguidance reads a
    # tokenizer's JSON): the markup tokens too, which tool-call grammars name by id
    return _TokenTable(tokenizer, tokens, sorted(added), eos)


class Grammars:
    """Compiles grammars for one tokenizer (its token table is built on first use: about a second at
    Hy3's vocabulary size). A compiled grammar is a matcher at its start, which each request copies."""

    def __init__(self, tokenizer: Hy3Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._tokens = None
        self._lock = threading.Lock()
        # the last CACHED grammars, by (kind, value as JSON, field, special token they follow)
        self._compiled: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self.width = max(vocab_size, tokenizer.vocab_size)  # of the masks: the logits' or the vocabulary's

    def warm(self) -> None:
        """Build the token table and import the mask helpers now (a server starting; the import of
        `llguidance.torch` alone takes seconds), if the library is installed. Only a head start: what
        fails here (the server stopped under the import, say) is logged, and the first structured
        request builds the table itself, reporting a real failure as its error."""
        try:
            self._tokens_of()
            import llguidance.torch  # noqa: F401
        except (GrammarError, ImportError):
            return
        except Exception as exc:
            log_event(log, "grammar_table_warm_failed", level=logging.DEBUG, error=repr(exc))

    def _tokens_of(self):
        with self._lock:
            if self._tokens is None:
                try:
                    import llguidance
                except ImportError as exc:
                    raise GrammarError(
                        "response_format", f"structured outputs need llguidance ({exc})"
                    ) from None
                tok = self.tokenizer
                eos = tok.token_to_id(tok.eos_token)
                table = byte_level_table(tok.tokenizer, eos, self.width)
                source = tok.tokenizer.to_str() if table is None else llguidance.TokenizerWrapper(table)
                self._tokens = llguidance.LLTokenizer(source, n_vocab=self.width, eos_token=eos)
            return self._tokens

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of `spec` (shared by its requests' constraints); GrammarError naming
        `spec.param` when the library rejects it."""
        text = json.dumps(spec.value, sort_keys=True, default=repr)
        if len(text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(
                spec.param, f"{len(text)} characters, more than the {MAX_GRAMMAR_CHARS} allowed"
            )
        key = (spec.kind, text, spec.param, spec.after)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        grammar = CompiledGrammar(*self._compile(spec))
        self._keep(key, grammar)
        return grammar

    def compile_source(self, source: str, param: str) -> CompiledGrammar:
        """The grammar of a `CompiledGrammar.source` another process compiled (and checked) already."""
        import llguidance

        key = ("source", source, param, None)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        grammar = CompiledGrammar(
            llguidance.LLMatcher(self._tokens_of(), source, limits=_limits()), param, source
        )
        self._keep(key, grammar)
        return grammar

    def _keep(self, key: tuple, grammar: CompiledGrammar) -> None:
        with self._lock:
            self._compiled[key] = grammar
            while len(self._compiled) > CACHED:
                self._compiled.popitem(last=False)

    def _compile(self, spec: GrammarSpec) -> tuple[Any, str, str]:
        """(matcher, the request field, the grammar in llguidance's format) of `spec`."""
        import llguidance

        tokens = self._tokens_of()
        try:
            if spec.kind == "json":
                text = llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(spec.value), defaults={"whitespace_flexible": False}
                )
            elif spec.kind == "regex":
                text = llguidance.LLMatcher.grammar_from_regex(spec.value)
            elif spec.kind == "choice":
                text = llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in spec.value))
            elif spec.kind == "tool_calls":
                text = llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(self.tokenizer, **spec.value))
            else:
                raise GrammarError(spec.param, f"unknown kind {spec.kind!r}")
            if spec.after is not None:
                text = self._after(spec.after, text)
            matcher = llguidance.LLMatcher(tokens, text, limits=_limits())
            probe = Constraint(matcher.deep_copy())
            if not matcher.is_error():  # a first mask: grammars that blow the limits fail here, not in a step
                probe.fill(allocate_masks(1, self.width), 0)
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            raise GrammarError(spec.param, _first_line(exc)) from None
        error = matcher.get_error() if matcher.is_error() else probe.error
        if error:
            raise GrammarError(spec.param, _first_line(error))
        return matcher, spec.param, text

    def _after(self, token: str, grammar: str) -> str:
        """`grammar` (llguidance's JSON form) preceded by free text up to the special token `token`:
        a Lark start rule referring to it by name (`@body`)."""
        ids = self.tokenizer.added_tokens
        if token not in ids:
            raise ValueError(f"the tokenizer has no special token {token!r}")
        inner = json.loads(grammar)["grammars"]
        inner[0]["name"] = "body"
        start = f"start: free @body\nfree: /(.|\\n)*/ <[{ids[token]}]>"
        return json.dumps({"grammars": [{"name": "start", "lark_grammar": start}, *inner]})


def tool_call_grammar(
    tokenizer: Hy3Tokenizer,
    markup: Hy3Markup,
    functions: dict[str, list[tuple[str, Any, bool]]],
    thinking: bool,
    parallel: bool,
) -> str:
    """A Lark grammar of Hy3 tool calls (`tool_calls` module docstring) to the `functions` given
    (name → (argument, its schema, whether required) of each argument, in order) — one call, or several
    with `parallel` — after the reasoning when `thinking` (the prompt ends inside a think block);
    `tool_choice` required / a named function. The tags are the tokenizer's tokens (llguidance sees
    added tokens as tokens, not text). A call writes its arguments in the order given, each at most
    once, every required one (as JSON-schema-guided decoding holds an object's properties to the
    schema's order). A value is JSON of its argument's schema when that schema is self-contained and
    admits no string (an integer, an enum of numbers, an object, …: what the parser then reads as that
    type). A string argument is written raw, as Hy3 writes strings: one of its `enum` (or its `const`)
    when those are all strings, else any text within its `minLength` / `maxLength` (bounds up to
    MAX_BOUNDED_CHARS; `pattern` and `format` are not held); one without a usable schema takes any
    text."""
    ids = tokenizer.added_tokens

    def tag(text: str) -> str:
        return f"<[{ids[text]}]>"

    m = markup
    rules = [
        f"start: {'reasoning ' if thinking else ''}calls",
        f"reasoning: /(.|\\n)*/ {tag(m.think_close)}",
        f'calls: {tag(m.tool_calls_open)} "\\n" call{"+" if parallel else ""} {tag(m.tool_calls_close)}',
        "call: " + " | ".join(f"call_{i}" for i in range(len(functions))),
        "VALUE: /(.|\\n)*/",
    ]
    for i, (name, arguments) in enumerate(functions.items()):
        head = f'{tag(m.tool_call_open)} {json.dumps(name)} {tag(m.tool_sep)} "\\n"'
        end = f'{tag(m.tool_call_close)} "\\n"'
        items = []
        for j, (key, schema, required) in enumerate(arguments):
            value = "VALUE"
            if _typed_value(schema):
                value = f"value_{i}_{j}"
                rules.append(f"{value}: %json {json.dumps(schema)}")
            elif (text := _string_value(schema)) is not None:
                value = f"value_{i}_{j}"
                rules.append(f"{value}: {text}")
            rules.append(
                f'arg_{i}_{j}: {tag(m.arg_key_open)} {json.dumps(key)} {tag(m.arg_key_close)} "\\n" '
                f'{tag(m.arg_value_open)} {value} {tag(m.arg_value_close)} "\\n"'
            )
            items.append(f"arg_{i}_{j}{'' if required else '?'}")
        rules.append(f"call_{i}: {' '.join([head, *items, end])}")
    return "\n".join(rules)


def _typed_value(schema: Any) -> bool:
    """Whether a parameter's value is held to JSON of its schema (`tool_call_grammar`)."""
    if not isinstance(schema, dict) or "$ref" in json.dumps(schema):
        return False
    types = schema_types(schema)
    return bool(types) and "string" not in types


MAX_BOUNDED_CHARS = 4096  # a string argument's length bound beyond this is not held (`_string_value`)


def _string_value(schema: Any) -> str | None:
    """The Lark rule of a string argument's raw text under its schema (`tool_call_grammar`): its
    string `enum` / `const` as alternatives, or its length bounds as a regex; None: any text."""
    options = string_choices(schema)
    if options is not None:
        return " | ".join(json.dumps(o, ensure_ascii=False) for o in dict.fromkeys(options))
    if schema_types(schema) != ["string"]:
        return None
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    low = low if type(low) is int and 0 < low <= MAX_BOUNDED_CHARS else 0
    high = high if type(high) is int and low <= high <= MAX_BOUNDED_CHARS else None
    if not low and high is None:
        return None
    return f"/(.|\\n){{{low},{'' if high is None else high}}}/"


STRUCTURED_ERROR = "structured output: "  # how the engine's error of a failing grammar begins


def _first_line(error: object) -> str:
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return f"not a grammar the server can use ({lines[0][:200]})"


def new_constraint(grammar: CompiledGrammar) -> Constraint:
    """A request's own state of a compiled grammar."""
    return Constraint(grammar.matcher.deep_copy())


@functools.cache
def _executor():
    import llguidance

    return llguidance.LLExecutor()  # its own threads, one per core


def fill_masks(
    constraints: list[Constraint],
    mask: Tensor,
    rows: list[int] | None = None,
    in_turn_at_most: int | None = IN_TURN_AT_MOST,
) -> None:
    """Row rows[i] (default i) of `mask` for constraint i. The first is filled on this thread and
    timed: when more than `in_turn_at_most` others remain (None: no such bound), or they would take
    longer than PARALLEL_AFTER_S at its pace, they are filled in parallel on llguidance's threads (a
    mask of a 120,832-token vocabulary inside a JSON string takes ~0.2 ms: BENCHMARKS), else here too."""
    rows = list(range(len(constraints))) if rows is None else rows
    if not constraints:
        return
    started = time.perf_counter()
    constraints[0].fill(mask, rows[0])
    first = time.perf_counter() - started
    rest = list(zip(constraints[1:], rows[1:]))
    few = in_turn_at_most is None or len(rest) <= in_turn_at_most
    if few and first * len(rest) < PARALLEL_AFTER_S:
        for constraint, row in rest:
            constraint.fill(mask, row)
        return
    from llguidance.torch import fill_next_token_bitmask_par

    fill_next_token_bitmask_par(_executor(), [(c.matcher, row) for c, row in rest], mask)


def allow_other_rows(masks: Tensor, filled: list[int]) -> None:
    """Every token allowed in the rows of `masks` not in `filled` (those a grammar wrote whole). The
    engine writes each row of a step's masks once: resetting the whole buffer first was a torch call
    between the model launch and the draws, where each GIL release lets the HTTP loop in (bench/LOG.md)."""
    others = sorted(set(range(masks.shape[0])) - set(filled))
    if others:
        masks[others] = -1


def allocate_masks(rows: int, vocab_size: int) -> Tensor:
    """A packed mask of `rows` rows, every token allowed: bit j of word w allows token 32·w + j (the
    layout `hy3.sample` reads, `hy3c.ops.sample`)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)

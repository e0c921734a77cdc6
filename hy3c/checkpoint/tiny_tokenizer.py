"""The tiny tokenizer of random checkpoints: a small real byte-level BPE trained here, with Hy3's special
tokens and chat template, so demos and tests need no download.

* `train_tiny_tokenizer()` trains a byte-level BPE locally with `tokenizers` on `tiny_corpus.txt`, with
  the Hy3 control and markup tokens first (ids 0..20). Any text round-trips (byte-level), which is all a random
  checkpoint needs.
* `write_tokenizer_files(dir)` writes `tokenizer.json`, `tokenizer_config.json` and
  `chat_template.jinja` (Hy3's chat template: tools, tool calls and results, reasoning effort).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from hy3c.checkpoint.tokenizer import (
    ASSISTANT,
    BOS,
    EOS,
    MARKUP_TOKENS,
    PAD,
    REASONING_MODE,
    SPECIAL_TOKENS,
    USER,
    markup_token,
)

CORPUS_FILE = "tiny_corpus.txt"  # package data beside this module; trained on four times over


# Hy3's chat template, written here to render as the released one does (HY3_SPEC §11): system text
# right after BOS (no role token), then the reasoning-mode marker (after the tools block when there are
# tools); user / assistant turns; an assistant's tool calls as <tool_calls> of <tool_call>name
# <tool_sep> <arg_key>k</arg_key> <arg_value>v</arg_value> … (a string value raw, others as JSON);
# tool results as <tool_response>s in one <tool_responses>; every assistant turn opens with a think
# block (its reasoning kept when `preserved_thinking`, the default with tools, or after the last user
# turn); the generation prompt opens the assistant turn with <think> (low / high) or an empty think
# block (no_think, the default). `reasoning_effort` outside those three is an error.
_TEMPLATE = """
{%- set effort = reasoning_effort if reasoning_effort is defined else 'no_think' %}
{%- if effort not in ['no_think', 'low', 'high'] %}
{{- raise_exception('reasoning_effort must be no_think, low or high, not ' ~ effort) }}
{%- endif %}
{%- set keep_thinking = preserved_thinking if preserved_thinking is defined else (tools is defined and tools) %}
{%- set training = is_training is defined and is_training %}
{%- macro text(content) %}
{%- if content is string %}{{- content }}
{%- elif content is iterable and content is not mapping %}
{%- for part in content %}
{%- if part is mapping and part.type == 'text' %}{{- part.text }}{%- elif part is string %}{{- part }}{%- endif %}
{%- endfor %}
{%- elif content is not none %}{{- content }}
{%- endif %}
{%- endmacro %}
{%- set state = namespace(system='', last_user=-1, in_tools=false, first_tool=true) %}
{%- for message in messages %}
{%- if message.role == 'system' %}{%- set state.system = state.system + text(message.content) %}{%- endif %}
{%- if message.role == 'user' %}{%- set state.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- set mode = '@MODE@reasoning_effort:' + effort %}
{{- bos_token + state.system }}
{%- if tools is defined and tools %}
{{- ('\n\n' if state.system else '') + '# Tools\n\nYou may call one or more functions to assist with the user query.' }}
{{- '\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n' }}
{%- for tool in tools %}{{- ('\n' if not loop.first else '') + tool | tojson }}{%- endfor %}
{{- '\n</tools>\n\nFor function call returns, you should first print @TCS@\n' }}
{{- 'For each function call, you should return object like:\n' }}
{{- '@TC@{function-name}@SEP@\n@AK@{arg-key-1}@/AK@\n@AV@{arg-value-1}@/AV@\n' }}
{{- '@AK@{arg-key-2}@/AK@\n@AV@{arg-value-2}@/AV@\n...\n@/TC@\n' }}
{{- 'At the end of function call returns, you should print @/TCS@' + mode }}
{%- else %}
{{- mode }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- ('@/TRS@' if state.in_tools else '') + '@USER@' + text(message.content) }}
{%- set state.in_tools = false %}
{%- elif message.role == 'assistant' %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else (message.reasoning if message.reasoning is string else '') %}
{%- if not (training or keep_thinking or loop.index0 > state.last_user) %}{%- set reasoning = '' %}{%- endif %}
{%- set body = '@THINK@' + reasoning + '@/THINK@' + text(message.content) %}
{{- ('@/TRS@' if state.in_tools else '') + '@ASSISTANT@' }}
{%- if message.tool_calls %}
{%- set state.first_tool = true %}
{{- body + '@TCS@\n' }}
{%- for call in message.tool_calls %}
{{- '@TC@' + call.function.name + '@SEP@\n' }}
{%- for key, value in call.function.arguments.items() %}
{{- '@AK@' + key + '@/AK@\n@AV@' + (value if value is string else value | tojson) + '@/AV@\n' }}
{%- endfor %}
{{- '@/TC@\n' }}
{%- endfor %}
{{- '@/TCS@' + eos_token }}
{%- elif not loop.last or training %}
{{- body + eos_token }}
{%- else %}
{{- body }}
{%- endif %}
{%- set state.in_tools = false %}
{%- elif message.role == 'tool' %}
{%- if state.first_tool %}{{- '@TRS@\n' }}{%- set state.first_tool = false %}{%- endif %}
{{- '@TR@\n' + text(message.content) + '\n@/TR@\n' }}
{%- set state.in_tools = true %}
{%- elif message.role != 'system' %}
{{- raise_exception('unknown role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{{- '@/TRS@' if state.in_tools else '' }}
{%- if add_generation_prompt and not (messages and messages[-1].role == 'assistant') %}
{{- '@ASSISTANT@@THINK@' + ('' if effort in ['low', 'high'] else '@/THINK@') }}
{%- endif %}
"""
_TAGS = {  # the template's @SHORT@ / @/SHORT@ placeholders of the markup tags
    "THINK": "think",
    "TCS": "tool_calls",
    "TC": "tool_call",
    "SEP": "tool_sep",
    "AK": "arg_key",
    "AV": "arg_value",
    "TRS": "tool_responses",
    "TR": "tool_response",
}
_MARKS = {"@MODE@": REASONING_MODE, "@USER@": USER, "@ASSISTANT@": ASSISTANT}
for _short, _name in _TAGS.items():
    _MARKS[f"@{_short}@"] = markup_token(_name)
    _MARKS[f"@/{_short}@"] = markup_token(_name, closing=True)
CHAT_TEMPLATE = _TEMPLATE.strip()
for _mark, _token in _MARKS.items():
    CHAT_TEMPLATE = CHAT_TEMPLATE.replace(_mark, _token)


def train_tiny_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Byte-level BPE with the Hy3 special and markup tokens at ids 0, 1, …; at most `vocab_size` entries."""
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
    # the markup tokens take their ids among the special ones but are not special: decoded text keeps
    # them (as the released tokenizer's "user-defined" tokens), for the reasoning and tool-call parsers
    spec = json.loads(tok.to_str())
    for entry in spec["added_tokens"]:
        if entry["content"] in MARKUP_TOKENS:
            entry["special"] = False
    return Tokenizer.from_str(json.dumps(spec))


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
                "special": t not in MARKUP_TOKENS,
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

"""The fixtures' tokenizer: a tiny byte-level BPE with Qwen's special tokens, pre-tokenizer
split and a Qwen3-style ChatML chat template (tools, <think>), saved as HF tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Not special in Qwen3 either: they must survive skip_special_tokens=True so the
# reasoning / tool-call parsers can see them in decoded text.
ADDED_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Qwen2/3 pre-tokenizer split: contractions, letter runs, single digits,
# punctuation runs, newlines, whitespace.
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A hand-picked merge list (byte-level symbols, "Ġ" is a space) so the BPE is
# fully deterministic without training. Each merge only uses symbols that exist
# by the time it is applied.
# fmt: off
_MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġ", "a"), ("i", "n"), ("Ġt", "he"), ("e", "r"),
    ("o", "n"), ("r", "e"), ("a", "t"), ("e", "n"), ("o", "r"), ("e", "s"),
    ("Ġ", "s"), ("Ġ", "w"), ("i", "s"), ("Ġ", "o"), ("Ġ", "c"), ("a", "n"),
    ("Ġ", "b"), ("Ġ", "f"), ("Ġ", "i"), ("Ġ", "p"), ("e", "d"), ("in", "g"),
    ("Ġ", "m"), ("Ġ", "d"), ("o", "u"), ("l", "l"), ("Ġt", "o"), ("Ġa", "n"),
    ("Ġo", "f"), ("Ġan", "d"), ("Ġ", "h"), ("i", "t"), ("a", "r"), ("Ġi", "s"),
    ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("Ċ", "Ċ"), ("Ġ", "{"),
]
# fmt: on


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _bytes_to_unicode() -> Dict[int, str]:
    # GPT-2's reversible byte -> printable-unicode map used by ByteLevel BPE.
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


# A Qwen3-style ChatML template: tools rendered as JSON schemas inside <tools>,
# assistant tool calls as JSON inside <tool_call>, tool results grouped into one
# user turn inside <tool_response>, reasoning kept only after the last real user
# query, and enable_thinking=false pre-filling an empty think block.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def _build_tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    byte_symbols = list(_bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(byte_symbols)}
    for a, b in _MERGES:
        assert a in vocab and b in vocab, (a, b)
        vocab[a + b] = len(vocab)

    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=list(_MERGES),
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    # No NFC normalizer (Qwen has one): fixtures promise exact byte round-trips.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Order matters: ids are assigned in the order the tokens are added.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tok


def write_tokenizer(path) -> Path:
    """Write a ~300-token byte-level BPE tokenizer with Qwen3's specials and chat
    template (tokenizer.json, tokenizer_config.json, special_tokens_map.json)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_tokenizer(_build_tokenizer(), path)
    return path


def save_tokenizer(tok, path: Path) -> None:
    """Save a `tokenizers.Tokenizer` that has Qwen3's special and added tokens as an
    offline-loadable HF tokenizer folder with the ChatML chat template (also used by
    scripts/train_demo_model.py for its trained tokenizer)."""
    tok.save(str(path / "tokenizer.json"))
    added = {}
    for t in SPECIAL_TOKENS + ADDED_TOKENS:
        added[str(tok.token_to_id(t))] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
    # PreTrainedTokenizerFast (not Qwen2Tokenizer): transformers 5 rebuilds a
    # Qwen2Tokenizer's pipeline itself, this class uses tokenizer.json as written.
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    _write_json(path / "tokenizer_config.json", config)
    _write_json(
        path / "special_tokens_map.json",
        {
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
        },
    )


def tokenizer_size() -> int:
    """Number of tokens (base vocab + added), without writing anything."""
    return 256 + len(_MERGES) + len(SPECIAL_TOKENS) + len(ADDED_TOKENS)


def token_id(token: str) -> int:
    """Id of a special / added token in the fixture tokenizer."""
    extra = SPECIAL_TOKENS + ADDED_TOKENS
    return 256 + len(_MERGES) + extra.index(token)

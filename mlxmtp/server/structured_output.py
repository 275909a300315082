"""Structured output: an answer held to a JSON schema (OpenAI `response_format`, the
Responses API's `text.format`, Anthropic's `output_config.format`).

llguidance (the grammar engine vLLM, SGLang and llama.cpp use) compiles the schema and
tells, token by token, which tokens keep the output valid. It becomes a logits processor
of mlx-lm's signature (grammar_mask.py): the tokens the grammar refuses get -inf before sampling.
The engine applies a request's processors to every distribution it samples from or
verifies against (each MTP draft and each verified position, with its own context), so
MTP decodes exactly what the model decodes under the same constraint, greedy or sampled,
and its drafts obey the grammar too. Written by hand: mlx-lm has no structured output;
this file only bridges llguidance's matcher to those calls.

When the prompt leaves `<think>` open the reasoning is free, and the schema holds from the
token after `</think>`.

Tool calls (tool_grammar.py) are held the same way: a forced call from the token after the
opening the prompt ends with; a call the model opens itself (`serve --constrain-tool-calls`,
or OpenAI's `strict: true` on a function) from the token after its own `<tool_call>` to its
`</tool_call>`, text around calls left free (call_hold.py). Which of these a request gets:
answer_hold.py.
"""

from __future__ import annotations

import copy
import json
from typing import List, Optional, Tuple

import numpy as np

from . import schema_limits, tool_grammar
from .errors import APIError
from .grammar_mask import GrammarProcessor, allowed_tokens

# The model served in this process (one per process): its tokenizer and vocabulary, for
# the matchers of every rank of a distributed server (see `serve_tokenizer`).
SERVED_MODEL: dict = {}


def serve_tokenizer(tok, vocab_size: int) -> None:
    """Name the tokenizer the grammars of this process are compiled for (the server and
    every rank following it call this at start-up)."""
    SERVED_MODEL.clear()
    SERVED_MODEL.update(tok=tok, vocab_size=vocab_size)


def _ll_tokenizer(keep: Tuple[str, ...] = ()):
    """llguidance's view of the served tokenizer, made on first use (~1 s for 250K tokens).

    Built from the tokenizer's JSON as llguidance.hf.from_tokenizer builds it, less the
    added tokens that are not special (Qwen's <think>, <tool_call>, ...) other than those in
    `keep`: llguidance takes every added token as a special one, which its mask may offer
    where a schema's text spells the tag and its matcher then refuses, leaving the rest
    unheld. Without them held text spells such a tag byte by byte, and the model never
    writes the token itself there. A forced tool call keeps `</tool_call>`, which its
    grammar names as the token the model ends a call with (tool_grammar.py)."""
    from llguidance import LLTokenizer  # on use: only requests with a format need it

    if ("compiled", keep) not in SERVED_MODEL:
        tok = SERVED_MODEL["tok"]
        backend = copy.copy(tok._tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        spec = json.loads(backend.to_str())
        spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t.get("special") or t["content"] in keep]
        SERVED_MODEL["compiled", keep] = LLTokenizer(json.dumps(spec), n_vocab=SERVED_MODEL["vocab_size"],
                                               eos_token=sorted(tok.eos_token_ids))
    return SERVED_MODEL["compiled", keep]


def added_token(text: str) -> Optional[int]:
    """The id of the served tokenizer's added token `text` (Qwen's `</tool_call>`), if any."""
    return next((i for i, t in SERVED_MODEL["tok"]._tokenizer.added_tokens_decoder.items() if t.content == text), None)


def requested_schema(fmt, where: str) -> Optional[dict]:
    """A format field, in any of the APIs' shapes -> the JSON schema the answer must follow,
    or None for free text. A shape it does not know is a 400 naming `where`."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, f"'{where}' must be an object", param=where)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise APIError(400, f"'{where}.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                       param=f"{where}.type")
    if where == "response_format":  # chat completions nests it, its schema optional (any object)
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict):
            raise APIError(400, f"'{where}.json_schema' must be an object", param=f"{where}.json_schema")
        where, schema = f"{where}.json_schema", inner.get("schema", {"type": "object"})
    else:  # Responses and Anthropic: flat, schema required
        schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise APIError(400, f"'{where}.schema' must be a JSON schema object", param=f"{where}.schema")
    return schema


# JSON's whitespace between tokens is bounded: pretty-printed output fits (a newline and the
# indentation of deep nesting), while a weak or small model cannot loop on whitespace forever.
# Lenient: keywords llguidance does not know (a `format` of a client's own) are not enforced
# rather than failing the request; what it cannot compile at all is still a 400.
_OPTIONS = {"whitespace_pattern": r"[ \t\n\r]{0,64}", "lenient": True}


_UNIMPLEMENTED = "Unimplemented keys: "  # llguidance's warning, then a JSON list of the keywords


def without_no_ops(schema):
    """The schema less keywords that constrain nothing, which llguidance would still report
    as not enforced: `uniqueItems: false`, a `propertyNames` every key satisfies (JSON keys
    are strings; zod writes one for records). Only schema positions are read: a property
    *named* uniqueItems stays."""
    if not isinstance(schema, dict):
        return schema
    kept = {key: value for key, value in schema.items() if not (
        (key, value) == ("uniqueItems", False) or (key == "propertyNames" and value in ({}, True, {"type": "string"})))}
    return schema_limits.map_subschemas(kept, without_no_ops)


def grammar_for(schema: dict, where: str) -> str:
    """The llguidance grammar of a JSON schema (see `compile_schema`)."""
    return compile_schema(schema, where)[0]


def compile_schema(schema: dict, where: str):
    """(the llguidance grammar of a JSON schema, a matcher compiled from it). A 400 naming
    `where`: a schema past schema_limits' bounds, one llguidance cannot compile, one with
    keywords it knows but cannot enforce (`not`, `if`, `uniqueItems`...: left out, the
    answer could break them), a pattern its lexer gives up on, and one no JSON value
    satisfies (a `$ref` to itself). Compiled on a large stack (schema_limits)."""
    import llguidance  # on use, as above

    regexes = schema_limits.check_bounds(schema, where)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(without_no_ops(schema), defaults=_OPTIONS)
        matcher = new_matcher(grammar)
        error, warnings = (matcher.get_error() if matcher.is_error() else ""), matcher.get_grammar_warnings()
    except Exception as e:  # noqa: BLE001 - llguidance reports some bad schemas by raising
        error, warnings = str(e) or type(e).__name__, []
    unenforced = sorted({key for w in warnings if w.startswith(_UNIMPLEMENTED)
                         for key in json.loads(w[len(_UNIMPLEMENTED):])})
    if not error and unenforced:
        error = "JSON Schema keywords this server cannot enforce: " + ", ".join(unenforced)
    if not error:
        error = next(filter(None, map(pattern_error, regexes)), "")
    if not error:
        error = first_steps_error(matcher, nothing="no JSON value satisfies this schema")
    if error:
        raise APIError(400, f"'{where}' cannot be enforced: {error}", param=where)
    return grammar, matcher


def new_matcher(grammar: str, keep: Tuple[str, ...] = (), limits=None):
    """A matcher of `grammar` for the served tokenizer (see _ll_tokenizer), compiled on a
    large stack; `limits`: llguidance's LLParserLimits, or its defaults."""
    import llguidance  # on use, as above

    tokenizer = _ll_tokenizer(tuple(keep))
    return schema_limits.on_large_stack(lambda: llguidance.LLMatcher(tokenizer, grammar, limits=limits))


def pattern_error(regex: str) -> str:
    """Why llguidance's lexer cannot hold JSON strings to `regex` ("" if it can). Its lexer
    builds a pattern's states when a string opens, not when the schema compiles: a pattern
    such as ^(x{1000}){1000}$ compiles, then fails at the first quote and would leave the
    rest of the answer free. So each pattern is tried once, up to its opening quote, with a
    fifth of the lexer's default fuel for building it: that one took 1.8 s and ~150 MB
    before giving up with the defaults, 0.2 s and a few MB so; what passes here passes
    under the defaults the answer is held with."""
    import llguidance  # on use, as above

    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "pattern": regex})
    matcher = new_matcher(grammar, limits=llguidance.LLParserLimits(initial_lexer_fuel=200_000))
    quote = SERVED_MODEL["tok"].encode('"', add_special_tokens=False)
    allowed_tokens(matcher, SERVED_MODEL["vocab_size"])  # where the lexer starts its work
    matcher.try_consume_tokens(quote)
    allowed_tokens(matcher, SERVED_MODEL["vocab_size"])
    return f"pattern {regex[:80]!r}: {matcher.get_error().splitlines()[0]}" if matcher.is_error() else ""


def first_steps_error(matcher, steps: int = 8, nothing: str = "") -> str:
    """Why the grammar stops holding within its first `steps` tokens ("" if it holds; `nothing`
    where its first step allows no token but the end of text), walked on a copy along the first
    allowed token that is more than whitespace. llguidance bounds the work of a step (the items
    of an Earley row, the tokens a step forces), and a wide or endless schema meets those bounds
    at once: an object of 500 optional properties after its `{`, a forced call whose required
    property holds its own object. Found here, that is a 400 naming the field; met further into
    the answer, the request fails (grammar_mask.GrammarError, a 400 too)."""
    walk, tok = matcher.deep_copy(), SERVED_MODEL["tok"]
    for step in range(steps):
        allowed = np.flatnonzero(allowed_tokens(walk, SERVED_MODEL["vocab_size"])).tolist()
        allowed = [t for t in allowed if t not in tok.eos_token_ids]
        if step == 0 and not allowed and nothing:
            return nothing
        if walk.is_error() or not allowed:
            break
        walk.consume_token(next((t for t in allowed if tok.decode([t]).strip()), allowed[0]))
    return walk.get_error().splitlines()[0] if walk.is_error() else ""


def hold_to_schema(req, tok, schema: dict, where: str, in_think: bool) -> None:
    """Hold the engine request's answer to a JSON schema (from `requested_schema`; a 400
    naming `where` where it cannot be enforced), from `</think>` on when the turn starts
    inside <think>."""
    opens_after = tok.encode("</think>", add_special_tokens=False) if in_think else None
    grammar, matcher = compile_schema(schema, where)
    req.params.logits_processors.append(_processor(grammar, matcher, len(req.prompt), opens_after, where=where))


def hold_forced_call(req, tok, prompt) -> None:
    """Hold a forced tool call to its grammar (tool_grammar.py) from the token after the
    call's opening, which ends the prompt. A 400 naming `tools` where a tool's schema cannot
    be enforced at all (past the bounds, not compiled, a pattern the lexer gives up on)."""
    import llguidance  # on use, as above

    end = added_token(tool_grammar.END)
    keep = (tool_grammar.END,) if end is not None else ()
    text, regexes = tool_grammar.call_grammar(prompt.tools, prompt.forced, tool_grammar.is_xml(tok), end)
    grammar = llguidance.LLMatcher.grammar_from_lark(text)
    matcher = new_matcher(grammar, keep)
    error = matcher.get_error() if matcher.is_error() else next(filter(None, map(pattern_error, regexes)), "")
    error = error or first_steps_error(matcher)
    if error:
        raise APIError(400, f"'tools': the forced call cannot be held to the tools' schemas: {error}", param="tools")
    req.params.logits_processors.append(_processor(grammar, matcher, len(req.prompt), None, keep, "tools"))


def grammar_processor(grammar: str, prompt_len: int, opens_after: Optional[List[int]] = None,
                      keep: Tuple[str, ...] = ()) -> GrammarProcessor:
    """The processor of a grammar compiled here (how another rank rebuilds it); `keep`:
    see _ll_tokenizer."""
    return _processor(grammar, new_matcher(grammar, keep), prompt_len, opens_after, keep)


def _processor(grammar: str, matcher, prompt_len: int, opens_after: Optional[List[int]],
               keep: Tuple[str, ...] = (), where: Optional[str] = None) -> GrammarProcessor:
    proc = GrammarProcessor(matcher, prompt_len, opens_after, where)
    # How another rank of a distributed server rebuilds it (distributed/wire.py).
    proc.recipe = ("mlxmtp.server.structured_output:grammar_processor", [grammar, prompt_len, opens_after, list(keep)])
    return proc

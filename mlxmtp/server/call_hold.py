"""Tool calls the model opens itself, held to their grammar: OpenAI's `strict: true` on a
function, and every call with `serve --constrain-tool-calls`.

The text around calls stays free; from the model's own `<tool_call>` token to its
`</tool_call>` the call is held to the grammar a forced call gets (tool_grammar.call_grammar,
lazy), through the same llguidance matchers and processors as response formats
(structured_output.py).
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from ..engine.sampling.row import CYCLE_REACH
from . import tool_grammar
from .errors import APIError
from .grammar_mask import GrammarProcessor
from .structured_output import (
    SERVED_MODEL,
    added_token,
    compile_schema,
    new_matcher,
    pattern_error,
)
from .thinking_budget import think_token_ids
from .tool_parsers import TOOL_CALL_START


def check_strict(tools: List[dict], strict: Dict[str, str]) -> None:
    """A 400 naming where a `strict: true` tool's parameters are when llguidance cannot hold
    them (compile_schema's reasons), as OpenAI refuses a strict schema it cannot enforce.
    What is asked of a strict schema beyond that (additionalProperties false, every
    property required) is the client's to write, as with OpenAI. Outcomes are kept per
    schema: an agent sends the same tools with every request."""
    checked = SERVED_MODEL.setdefault("strict_checked", {})
    for name, params in tool_grammar.functions(tools):
        if name not in strict:
            continue
        key = (strict[name], json.dumps(params, sort_keys=True))
        if key not in checked:
            if len(checked) >= 1024:
                checked.clear()
            try:
                compile_schema(params, strict[name])
                checked[key] = None
            except APIError as e:
                checked[key] = e
        if checked[key] is not None:
            raise APIError(400, checked[key].message, param=checked[key].param)


def hold_calls(req, tok, prompt, tools: List[dict], strict: Dict[str, str], constrain: bool) -> None:
    """Hold the calls the model opens to the call grammar (tool_grammar.call_grammar, lazy):
    the tools in `strict` to their schemas, and with `constrain` every other tool too
    (without it their arguments are any object: only strict tools are held to their
    schemas, as OpenAI does). A tool held only for `constrain` whose schema llguidance
    cannot hold is left free rather than failing the request (the client did not ask for
    it); a strict one was checked before (check_strict). A tokenizer without single
    `<tool_call>` / `</tool_call>` tokens (every Qwen3 one has them) holds no call.

    An agent sends the same tools with every request: the grammar compiled for them (30 ms
    for 30 tools) is kept, and each request holds its calls with a copy of its matcher."""
    trigger, end = added_token(TOOL_CALL_START), added_token(tool_grammar.END)
    if trigger is None or end is None:
        return
    xml, keep = tool_grammar.is_xml(tok), (tool_grammar.END,)
    compiled = SERVED_MODEL.setdefault("call_grammars", {})
    key = json.dumps([tools, sorted(strict), constrain, xml], sort_keys=True)
    if key not in compiled:
        if len(compiled) >= 16:
            compiled.clear()
        compiled[key] = _call_grammar(tools, strict, constrain, xml, end, keep)
    grammar, matcher = compiled[key]
    think = think_token_ids(tok)
    req.params.logits_processors.append(
        _call_processor(grammar, matcher.deep_copy(), len(req.prompt), [trigger, end, *(think or (None, None))],
                        prompt.in_think, keep))


def _call_grammar(tools: List[dict], strict: Dict[str, str], constrain: bool, xml: bool, end: int,
                  keep: Tuple[str, ...]):
    """(the lazy call grammar of hold_calls, an unused matcher of it)."""
    import llguidance  # on use, as above

    names = [name for name, _ in tool_grammar.functions(tools)]
    free = {name for name in names if name not in strict and not constrain}
    while True:
        try:
            text, regexes = tool_grammar.call_grammar(tools, "required", xml, end, lazy=True, free=free)
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
            matcher = new_matcher(grammar, keep)
            error = matcher.get_error() if matcher.is_error() else next(filter(None, map(pattern_error, regexes)), "")
        except APIError as e:  # a schema past the bounds
            error = e.message
        if not error:
            break
        unheld = _unholdable(tools, xml, end, set(names) - free - set(strict))
        if not unheld:
            raise APIError(400, f"'tools': the tool calls cannot be held to the tools' schemas: {error}",
                           param="tools")
        free |= unheld
    return grammar, matcher


def _unholdable(tools: List[dict], xml: bool, end: int, names: set) -> set:
    """Of the tools named, those whose schema alone cannot be held."""
    import llguidance  # on use, as above

    out = set()
    for t in tools:
        name = tool_grammar.functions([t])[0][0]
        if name not in names:
            continue
        try:
            text, regexes = tool_grammar.call_grammar([t], "required", xml, end, lazy=True)
            matcher = new_matcher(llguidance.LLMatcher.grammar_from_lark(text), (tool_grammar.END,))
            if matcher.is_error() or any(map(pattern_error, regexes)):
                out.add(name)
        except APIError:
            out.add(name)
    return out


def call_processor(grammar: str, prompt_len: int, ids: List[Optional[int]], in_think: bool,
                   keep: Tuple[str, ...] = ()) -> "CallProcessor":
    """The processor of a lazy call grammar compiled here (how another rank rebuilds it)."""
    return _call_processor(grammar, new_matcher(grammar, keep), prompt_len, ids, in_think, keep)


def _call_processor(grammar: str, matcher, prompt_len: int, ids: List[Optional[int]], in_think: bool,
                    keep: Tuple[str, ...]) -> "CallProcessor":
    proc = CallProcessor(matcher, prompt_len, *ids, in_think=in_think)
    proc.recipe = ("mlxmtp.server.call_hold:call_processor", [grammar, prompt_len, list(ids), in_think,
                                                                      list(keep)])
    return proc


# States of CallProcessor's reading of the output (a call's is where its tokens start, >= 0).
_TEXT, _THINK = -1, -2


class CallProcessor(GrammarProcessor):
    """A lazy call grammar: the output is free until the model writes the `<tool_call>`
    token itself, the call grammar (tool_grammar.call_grammar, lazy) holds from the next
    token to the call's `</tool_call>` token, and the text after it is free again, where the
    model may open another call (the matcher is rolled back to the new call's start).
    Reasoning is free as the answer's parser reads it (reasoning.OutputSplitter): a
    `<tool_call>` inside the think block (the prompt's open one, or the model's own
    `<think>` as its first token) opens nothing.

    Why a wrapper and not one lazy llguidance grammar (its struct tags: free text as a
    lexeme, the trigger a special token): such a grammar runs llguidance's mask over every
    free token, and its free text can hold no special token but the trigger - a think
    block's `</think>`, the tokens our llguidance tokenizer leaves out (_ll_tokenizer) -
    while here text outside a call gets the model's logits untouched (the same greedy
    output as without the grammar, and no mask to compute), and a call gets the very
    grammar a forced call gets. The engine applies it to every draft and verified position
    with its own context, as any processor, so MTP decodes exactly what the model decodes
    under the same constraint.

    The output read so far and the state after each token are kept, so a context costs its
    last tokens, not its length: a context differs from the one before only within the
    engine's cycle reach (drafts, a cycle not read yet)."""

    def __init__(self, matcher, prompt_len: int, trigger: int, end: int, think_start: Optional[int] = None,
                 think_end: Optional[int] = None, in_think: bool = False):
        super().__init__(matcher, prompt_len, where="tools")  # the schemas a call is held to
        self.trigger, self.end = trigger, end
        self.think_start, self.think_end = think_start, think_end
        self.first = _THINK if in_think and think_end is not None else _TEXT
        self.read: List[int] = []  # the output read so far
        self.states: List[int] = []  # the state after each of its tokens

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        start = self._state(context)
        if start < 0:
            return logits
        return self._mask(self.read[start:], logits)

    def _state(self, context: mx.array) -> int:
        n = int(context.shape[0]) - self.prompt_len
        start = max(0, min(len(self.read), n) - 4 * CYCLE_REACH)  # before it the output cannot have changed
        tail = context[self.prompt_len + start :].tolist()
        same = 0
        while start + same < min(len(self.read), n) and tail[same] == self.read[start + same]:
            same += 1
        del self.read[start + same :], self.states[start + same :]
        state = self.states[-1] if self.states else self.first
        for t in tail[same:]:
            state = self._next(state, len(self.read), t)
            self.read.append(t)
            self.states.append(state)
        return state

    def _next(self, state: int, i: int, t: int) -> int:
        """The state after the output's token `t`, its `i`-th."""
        if state == _THINK:
            return _TEXT if t == self.think_end else _THINK
        if state == _TEXT:
            if t == self.trigger:
                return i + 1
            return _THINK if i == 0 and t == self.think_start and self.think_end is not None else _TEXT
        return _TEXT if t == self.end else state

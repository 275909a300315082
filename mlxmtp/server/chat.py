"""Request messages -> the chat template's messages -> prompt token ids.

Every API is converted to the OpenAI-style message list Qwen templates expect:
`system` / `user` / `assistant` (with `reasoning_content` and `tool_calls` whose
arguments are dicts: Qwen3.5's template iterates `arguments|items`) and `tool`; OpenAI
chat messages in openai_input.py, Anthropic's in anthropic_input.py, Responses items in
responses_input.py, with the helpers here that all three share.
System messages go where the template takes them (`place_system`), and `build_prompt`
adds what the request asks of the turn's start (a forced tool call).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from . import tool_grammar
from .errors import APIError
from .reasoning import THINK_END, OutputSplitter, starts_in_thinking
from .shared_prefix import shared_prefix
from .tool_parsers import TOOL_CALL_START

Message = Dict[str, Any]


# ------------------------------------------------------------------ shared by every API's input
def left_out(kind: str) -> str:
    """What the model reads in place of a picture, audio or a file (every API): the models
    served read text only, and a conversation an agent resends every turn must still run."""
    return f"[{kind} omitted: this server reads text only]"


def tool_arguments(args: Any) -> Any:
    """A tool call's arguments as the templates want them: a JSON object string parsed to
    a dict; anything else unparseable kept as sent."""
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except ValueError:
            return args
        return parsed if isinstance(parsed, dict) else args
    return args if args is not None else {}


def check_schema(schema: Any, where: str, param: Optional[str] = None) -> None:
    """A tool's parameter schema: absent, or a JSON object whose `properties` (if any) is an
    object (the template renders it and the tool-call parser reads each parameter's type)."""
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise APIError(400, f"'{where}' must be a JSON schema object", param=param)
    if not isinstance(schema.get("properties", {}), dict):
        raise APIError(400, f"'{where}.properties' must be an object", param=param)


# ------------------------------------------------------------------ rendering
_PROBE = "mlxmtp-probe-7f3a"
_LATER_SYSTEM: Dict[str, bool] = {}  # chat template -> does it render a system turn after the first turn?
SYSTEM_MARKER = "[System]\n"


def _renders_later_system(tok) -> bool:
    """Qwen3 templates render a later system message as a system turn; Qwen3.5/3.6 ones
    raise ("System message must be at the beginning"). Probed once per template."""
    template = str(tok.chat_template)
    if template not in _LATER_SYSTEM:
        probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
                 {"role": "system", "content": _PROBE}, {"role": "user", "content": "v"}]
        try:
            text = tok.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
            _LATER_SYSTEM[template] = _PROBE in text
        except Exception:  # noqa: BLE001 - raise_exception in the template: it does not
            _LATER_SYSTEM[template] = False
    return _LATER_SYSTEM[template]


def _marked(notes: List[str], content: str) -> str:
    text = "\n\n".join(SYSTEM_MARKER + n for n in notes)
    return f"{text}\n\n{content}" if content else text


def place_system(tok, messages: List[Message]) -> List[Message]:
    """System messages where the template accepts them: the leading ones merged into one
    system prompt; a later one kept as a system turn where the template renders one, else
    folded into the next user turn behind a "[System]" marker (a user turn of its own
    when an assistant turn or the end comes first)."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    out: List[Message] = []
    if lead:
        out.append({"role": "system", "content": "\n\n".join(m["content"] for m in messages[:lead])})
    rest = messages[lead:]
    if not any(m["role"] == "system" for m in rest) or _renders_later_system(tok):
        return out + rest
    pending: List[str] = []
    for m in rest:
        if m["role"] == "system":
            pending.append(m["content"])
            continue
        if pending and m["role"] == "user":
            m = dict(m, content=_marked(pending, m["content"]))
            pending = []
        elif pending and m["role"] == "assistant":
            out.append({"role": "user", "content": _marked(pending, "")})
            pending = []
        out.append(m)
    if pending:
        out.append({"role": "user", "content": _marked(pending, "")})
    return out


# apply_chat_template's own arguments: a request (or `serve --chat-template-args`) may set
# the template's variables, never the template itself (a client's Jinja would run on the
# thread that renders every request's prompt, with no bound on its loops) nor how the
# server renders and tokenizes.
RENDERING_ARGUMENTS = frozenset({
    "chat_template", "conversation", "messages", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})

# The functions a chat template calls (Jinja's own and transformers'): a variable of that name
# would replace the function, and the template fail on a call it cannot make.
TEMPLATE_FUNCTIONS = frozenset({"cycler", "dict", "joiner", "lipsum", "namespace", "range", "raise_exception",
                                "strftime_now"})


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def effort_thinking(tok, effort: Optional[str], label: str) -> Optional[bool]:
    """OpenAI's reasoning effort (`reasoning_effort`, Responses' `reasoning.effort`) as the
    template's enable_thinking: 'none' / 'minimal' off, the others on; None where no effort
    is given or the template has no such switch (then the server's default holds)."""
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise APIError(400, f"'{label}' must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}", param=label)
    if "enable_thinking" not in str(getattr(tok, "chat_template", None) or ""):
        return None
    return effort not in ("none", "minimal")


def render(tok, messages: List[Message], tools: Optional[List[dict]] = None,
           enable_thinking: Optional[bool] = None, template_kwargs: Optional[dict] = None,
           continue_final: bool = False, param: str = "messages") -> Tuple[List[int], str, bool]:
    """-> (prompt ids, prompt text, whether generation starts inside <think>). With
    `continue_final` the last (assistant) message is left open, so generation continues it
    (a prefilled answer) instead of starting a new turn. `param`: the field a template's
    refusal names (the Responses API's conversation is `input`)."""
    if getattr(tok, "chat_template", None) is None:
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions")
    kwargs = dict(template_kwargs or {})
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    if continue_final:  # transformers renders the turn and cuts it after the message's content
        kwargs.update(add_generation_prompt=False, continue_final_message=True)
    else:
        kwargs["add_generation_prompt"] = True
    messages = place_system(tok, messages)
    try:
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja raise_exception etc. mean a bad conversation
        raise APIError(400, f"the chat template rejected these messages: {e}", param=param) from e
    ids = tok.encode(text, add_special_tokens=False)
    return ids, text, starts_in_thinking(text)


def tool_call_opening(tok, name: Optional[str] = None) -> str:
    """The start of a tool call in the model's own format: Qwen3-Coder XML where the
    template writes calls as `<function=NAME>`, else Hermes JSON; with the name when one
    tool is forced. Ends where the model's own next token would start (after `":` / `>\n`)."""
    if tool_grammar.is_xml(tok):
        return TOOL_CALL_START + "\n<function=" + (f"{name}>\n" if name else "")
    return TOOL_CALL_START + "\n" + (f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments":' if name else "")


@dataclass
class Prompt:
    ids: List[int]
    text: str
    in_think: bool  # generation starts inside <think>
    opening: str = ""  # a forced tool-call opening at the end of the prompt, as if the model had written it
    continues: bool = False  # the prompt ends inside a prefilled answer (render's continue_final)
    shared: int = 0  # leading tokens other conversations share (shared_prefix.py)
    tools: Optional[List[dict]] = None  # the tools listed, where a call is forced
    forced: Optional[str] = None  # with `opening`: "required" or the forced tool's name

    def splitter(self, tools: Optional[List[dict]]) -> OutputSplitter:
        return OutputSplitter(in_thinking=self.in_think, parse_tools=bool(tools), tools=tools, emitted=self.opening)


def build_prompt(tok, messages: List[Message], tools: Optional[List[dict]] = None,
                 enable_thinking: Optional[bool] = None, template_kwargs: Optional[dict] = None,
                 tool_choice: Optional[str] = None, continue_final: bool = False, param: str = "messages") -> Prompt:
    """The prompt a request prefills. tool_choice 'required' or a tool's name (with tools)
    forces a call: the turn starts with the tool-call opening, after an empty think block
    where the template would open one (a forced call is the whole turn). `continue_final`:
    see `render`."""
    ids, text, in_think = render(tok, messages, tools, enable_thinking, template_kwargs, continue_final, param)
    shared = shared_prefix(tok, place_system(tok, messages), tools, dict(template_kwargs or {}), ids)
    if not tools or tool_choice in (None, "auto", "none"):
        return Prompt(ids, text, in_think, continues=continue_final, shared=shared)
    if continue_final:
        raise APIError(400, "a forced tool call starts a new turn: it cannot continue a prefilled "
                            "assistant message", param="tool_choice")
    if in_think:
        _, text, in_think = render(tok, messages, tools, False, template_kwargs, param=param)
        if in_think:  # no enable_thinking switch in this template: close the block ourselves
            text += "\n" + THINK_END + "\n\n"
    opening = tool_call_opening(tok, None if tool_choice == "required" else tool_choice)
    text += opening
    ids = tok.encode(text, add_special_tokens=False)
    return Prompt(ids, text, False, opening, shared=min(shared, len(ids)), tools=tools, forced=tool_choice)


def encode_prompt(tok, prompt: Any) -> List[int]:
    """/v1/completions prompt: a string, a one-string array, or token ids (not checked
    against the vocabulary here: validation.token_ids does that)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "'prompt' must not be empty", param="prompt")
        return tok.encode(prompt, add_special_tokens=False)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and not prompt:
        raise APIError(400, "'prompt' must not be empty", param="prompt")
    raise APIError(400, "'prompt' must be a string, an array with one string, or an array of token ids",
                   param="prompt")

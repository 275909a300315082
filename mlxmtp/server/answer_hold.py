"""What a request's answer is held to, for every API alike: its format field (a JSON schema,
structured_output.py), a tool call the server forces (structured_output.py), or the calls
the model opens itself (call_hold.py)."""

from __future__ import annotations

from typing import Dict, List, Optional

from . import call_hold, structured_output
from .errors import APIError


def hold_to_format(req, tok, fmt, where: str, prompt, tools: Optional[List[dict]] = None,
                   strict: Optional[Dict[str, str]] = None, constrain: bool = False) -> None:
    """Hold the engine request's answer to the format field `fmt` (named `where`), if it
    asks for one, and a forced tool call to the call's grammar. `prompt` (chat.Prompt): a
    turn that starts inside <think> is held from `</think>` on; a turn the server forces to
    call a tool cannot also be held to a format.

    `tools`: the function tools the model may call (chat completions' shape); `strict`: the
    names of those marked `strict: true` -> where their parameters are in the request (a
    schema llguidance cannot hold is a 400 naming it); `constrain`: hold every call the
    model opens (serve --constrain-tool-calls). With either, a call the model opens in an
    unforced turn is held to its grammar (call_hold.hold_calls)."""
    call_hold.check_strict(tools or [], strict or {})
    schema = structured_output.requested_schema(fmt, where)
    if prompt.opening and schema is not None:
        raise APIError(400, f"'{where}': a turn forced to call a tool (tool_choice) cannot also be held to "
                            "a format", param=where)
    if prompt.opening:
        structured_output.hold_forced_call(req, tok, prompt)
    elif schema is None and tools and (constrain or strict):
        # (An answer held to a format never opens a call: its grammar has no <tool_call>.)
        call_hold.hold_calls(req, tok, prompt, tools, strict or {}, constrain)
    if schema is not None:
        structured_output.hold_to_schema(req, tok, schema, where, prompt.in_think)

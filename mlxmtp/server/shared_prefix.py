"""How much of a chat prompt every conversation with its system prompt and tools starts with.

That length is the request's `shared_prefix` (engine/request.py): prefill stops there to
store the state (engine/prefill.py), so the next conversation on the same system prompt and
tools, a coding agent's next session or a sub-agent, starts from it instead of prefilling
tens of thousands of tokens again. Without it the prefix cache only finds that point once
two conversations have branched there, so the second one still prefills everything.

It is found by rendering the same leading system messages and tools with another user
message and counting the tokens the two prompts share. That render's tokens are kept per
(template, system messages, tools, template options), so later turns and other
conversations do not tokenize a long system prompt again.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import List, Optional

# The comparison's user message: one no client sends (U+2063, INVISIBLE SEPARATOR).
PROBE = "\u2063"
KEPT_RENDERS = 32  # system prompt and tool sets whose comparison render is kept

_renders: "OrderedDict[str, List[int]]" = OrderedDict()
_lock = threading.Lock()  # requests are rendered on more than one thread


def shared_prefix(tok, messages: List[dict], tools: Optional[List[dict]], template_kwargs: dict,
                  ids: List[int]) -> int:
    """How many leading tokens of `ids` (the prompt of `messages`, system messages already
    placed as the template takes them) any conversation with the same leading system
    messages and `tools` starts with; 0 without either."""
    lead = []
    for m in messages:
        if m["role"] != "system":
            break
        lead.append(m)
    if not lead and not tools:
        return 0
    other = _comparison_render(tok, lead, tools, template_kwargs)
    n, limit = 0, min(len(ids), len(other))
    while n < limit and ids[n] == other[n]:
        n += 1
    return n


def _comparison_render(tok, lead: List[dict], tools: Optional[List[dict]], template_kwargs: dict) -> List[int]:
    key = hashlib.sha256(json.dumps([str(tok.chat_template), lead, tools, template_kwargs], sort_keys=True,
                                    default=str).encode()).hexdigest()
    with _lock:
        if key in _renders:
            _renders.move_to_end(key)
            return _renders[key]
    try:
        text = tok.apply_chat_template(lead + [{"role": "user", "content": PROBE}], tools=tools, tokenize=False,
                                       **{**template_kwargs, "add_generation_prompt": True})
        ids = tok.encode(text, add_special_tokens=False)
    except Exception:  # noqa: BLE001 - the hint only saves work; the request itself rendered
        ids = []
    with _lock:
        _renders[key] = ids
        while len(_renders) > KEPT_RENDERS:
            _renders.popitem(last=False)
    return ids

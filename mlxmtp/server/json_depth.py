"""How deeply JSON may nest in what the server reads and writes.

Python's json and Starlette's responses recurse once per level, so a value nested about a
thousand levels deep raises RecursionError where it is parsed or written: a request body
(refused when read, validation.py) or a tool call the model wrote (left as text,
tool_parsers.py). 128 levels is far beyond any tool schema or argument an agent sends.
"""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 128


def depth(value: Any) -> int:
    """Levels of arrays and objects in `value` (0 for a scalar), counted without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, level = stack.pop()
        if isinstance(v, (dict, list)):
            level += 1
            deepest = max(deepest, level)
            stack.extend((item, level) for item in (v.values() if isinstance(v, dict) else v))
    return deepest

"""Bounds a JSON schema keeps before llguidance compiles it, and the thread it compiles on.

llguidance (structured_output.py) compiles a schema recursively in native code: a chain of
`$ref`s a few thousand hops long (a 100 KB body) overflows the stack of the thread that
compiles it, and a segfault takes the whole server with every request in flight. Its own
`LLParserLimits` bound the grammar's size and the lexer's work, not that recursion, so the
schema is measured here first, without recursion, and refused with a 400 naming the field
and the bound it exceeds:

- nesting, counting each `$ref` hop as a level (a recursive schema's cycle counts once:
  llguidance compiles it lazily);
- how many subschemas it holds, how many `enum` values, how long a `pattern` is.

The compile itself then runs on a thread of its own with a large stack (`on_large_stack`),
so a schema within these bounds has ample room whatever llguidance does inside.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, List, Optional, TypeVar

from .errors import APIError

MAX_NESTING = 256  # levels of subschemas, $ref hops included; real tool schemas use < 20
MAX_SUBSCHEMAS = 10_000
MAX_ENUM_VALUES = 10_000  # all `enum` lists together
MAX_PATTERN_CHARS = 4_096  # one `pattern` or `patternProperties` key
COMPILE_STACK_BYTES = 256 << 20  # reserved address space, touched only as deep as used

# Where a JSON schema holds schemas: one, a list of them, a map of names to them.
ONE = ("additionalProperties", "additionalItems", "items", "not", "if", "then", "else", "contains",
       "propertyNames", "unevaluatedItems", "unevaluatedProperties")
LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def subschemas(schema: dict) -> Iterator[dict]:
    """The schemas `schema` holds directly (not through `$ref`)."""
    for key, value in schema.items():
        if key in ONE and isinstance(value, dict):
            yield value
        elif key in LISTS and isinstance(value, list):
            yield from (v for v in value if isinstance(v, dict))
        elif key in MAPS and isinstance(value, dict):
            yield from (v for v in value.values() if isinstance(v, dict))


def map_subschemas(schema: dict, fn: Callable) -> dict:
    """A copy of `schema` with `fn` applied to each schema it holds directly."""
    out = {}
    for key, value in schema.items():
        if key in LISTS and isinstance(value, list):
            value = [fn(v) for v in value]
        elif key in MAPS and isinstance(value, dict):
            value = {name: fn(v) for name, v in value.items()}
        elif key in ONE:
            value = fn(value)
        out[key] = value
    return out


def patterns(schema: dict) -> List[str]:
    """The regular expressions `schema` itself holds (its own `pattern`, its
    `patternProperties` keys)."""
    found = [schema["pattern"]] if isinstance(schema.get("pattern"), str) else []
    if isinstance(schema.get("patternProperties"), dict):
        found += list(schema["patternProperties"])
    return found


def _resolve(root: dict, ref) -> Optional[dict]:
    """The schema a local `$ref` ("#/$defs/x") names in `root`; None for any other (left
    to llguidance, which reports what it cannot resolve)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict) else None


def _edges(root: dict, schema: dict) -> List[dict]:
    target = _resolve(root, schema.get("$ref"))
    return [*subschemas(schema), *([target] if target is not None else [])]


def _nesting(root: dict) -> tuple:
    """(levels of the deepest path through subschemas and `$ref` hops, schemas seen): a
    depth-first walk with its own stack; a hop back onto the path (recursion) ends it."""
    height, best, on_path = {}, {id(root): 0}, {id(root)}
    stack = [(root, iter(_edges(root, root)))]
    while stack:
        node, children = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            on_path.discard(id(node))
            height[id(node)] = best.pop(id(node)) + 1
            if stack:
                parent = id(stack[-1][0])
                best[parent] = max(best[parent], height[id(node)])
        elif id(child) in height:
            best[id(node)] = max(best[id(node)], height[id(child)])
        elif id(child) not in on_path:
            on_path.add(id(child))
            best[id(child)] = 0
            stack.append((child, iter(_edges(root, child))))
            if len(height) + len(stack) > MAX_SUBSCHEMAS:
                break
    return height.get(id(root), len(stack)), len(height) + len(stack)


def check_bounds(schema: dict, where: str) -> List[str]:
    """Refuse (a 400 naming `where` and the bound) a schema past any bound above; else the
    distinct regular expressions it holds."""
    levels, count = _nesting(schema)
    if count > MAX_SUBSCHEMAS:
        _refuse(where, f"more than {MAX_SUBSCHEMAS} subschemas")
    if levels > MAX_NESTING:
        _refuse(where, f"subschemas nested {levels} levels deep, counting $ref hops (at most {MAX_NESTING})")
    enums, regexes = 0, set()
    stack = [schema]
    seen = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        enums += len(node["enum"]) if isinstance(node.get("enum"), list) else 0
        regexes.update(patterns(node))
        stack.extend(subschemas(node))
    if enums > MAX_ENUM_VALUES:
        _refuse(where, f"{enums} enum values (at most {MAX_ENUM_VALUES})")
    longest = max(map(len, regexes), default=0)
    if longest > MAX_PATTERN_CHARS:
        _refuse(where, f"a pattern of {longest} characters (at most {MAX_PATTERN_CHARS})")
    return sorted(regexes)


def _refuse(where: str, what: str) -> None:
    raise APIError(400, f"'{where}' is too large to enforce: {what}", param=where)


T = TypeVar("T")
_STACK_SIZE_LOCK = threading.Lock()
_COMPILER: Optional[ThreadPoolExecutor] = None


def on_large_stack(fn: Callable[[], T]) -> T:
    """fn() on the compile thread, whose stack is COMPILE_STACK_BYTES; its result, or its
    exception raised here. One long-lived thread: a thread per compile would get an
    allocator arena of its own each time, and the memory a large compile freed there would
    stay with the process (the load bench's RSS grew 25% over a round of hostile schemas).
    threading.stack_size applies to threads started while it is set, so it is set and put
    back around that thread's start alone."""
    global _COMPILER
    with _STACK_SIZE_LOCK:
        if _COMPILER is None:
            before = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                _COMPILER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
                _COMPILER.submit(lambda: None).result()  # its one thread starts now, with that stack
            finally:
                threading.stack_size(before)
    return _COMPILER.submit(fn).result()

"""Reading the fields of a /v1/responses body, for its input (responses_input.py) and its
tools (responses_tools.py) alike: the 400 that names the field at fault, and a string field."""

from __future__ import annotations

from typing import Optional

from .errors import APIError


def bad(message: str, param: str) -> APIError:
    """A 400 that names the field at fault (what the Responses API's clients show)."""
    return APIError(400, message, param=param)


def string_field(obj: dict, key: str, where: str, *, required: bool = True) -> Optional[str]:
    """`obj[key]`, a non-empty string (None when absent and not `required`); else a 400
    naming `where.key`."""
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value):
        raise bad(f"'{where}.{key}' must be a non-empty string", f"{where}.{key}")
    return value

"""Size rules of the package, read from the source with ast (nothing is imported or run):
every function short, every module small (the import rules are in test_layers.py).
One case per file, so that a known exception can be marked on its own."""

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mlxmtp"
MAX_FUNCTION_LINES = 50
MAX_FILE_LINES = 300

# Every module of the package, mlxmtp/testing included: test support is read and changed
# like the rest (fixtures, benches and scripts import it), and none of it needs more room.
SOURCES = sorted(PACKAGE.rglob("*.py"))

# The modules allowed past MAX_FILE_LINES: path -> the reason, e.g.
#     "mlxmtp/server/app.py": "being split into mlxmtp/commands/ (issue 41)",
# An entry goes when its file is split: test_the_allow_list_is_current fails once a file
# named here fits or is gone. Empty: every module fits (issue 41 split the last ones).
OVERSIZE: dict = {}


def _id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@pytest.mark.parametrize("path", SOURCES, ids=_id)
def test_functions_are_short(path):
    long = [f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(_tree(path))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines in {_id(path)}: {long}"


@pytest.mark.parametrize("path", [p for p in SOURCES if _id(p) not in OVERSIZE], ids=_id)
def test_modules_are_small(path):
    lines = _lines(path)
    assert lines <= MAX_FILE_LINES, f"{_id(path)}: {lines} lines (split it by job; OVERSIZE is for a recorded reason)"


def _stale(name: str, why: str):
    """Why an OVERSIZE entry should go or be completed, or None while it holds."""
    path = ROOT / name
    if not path.is_file():
        return "no longer exists"
    if _lines(path) <= MAX_FILE_LINES:
        return f"fits in {MAX_FILE_LINES} lines now"
    return None if why.strip() else "has no reason"


def test_the_allow_list_is_current():
    stale = {name: _stale(name, why) for name, why in OVERSIZE.items() if _stale(name, why)}
    assert not stale, f"remove or explain these OVERSIZE entries: {stale}"


def test_the_rules_see_the_package():
    # Guards against a path change that would leave the checks above with nothing to read.
    names = {_id(p) for p in SOURCES}
    assert {"mlxmtp/engine/policy/adaptive.py", "mlxmtp/server/chat.py", "mlxmtp/models/load.py",
            "mlxmtp/testing/fixtures.py"} <= names

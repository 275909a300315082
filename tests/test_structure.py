"""Size rules of the package, read from the source with ast (nothing is imported or run):
every function short, every engine module small (the import rules are in test_layers.py).
One case per file, so that a known exception can be marked on its own."""

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mlxmtp"
MAX_FUNCTION_LINES = 50
MAX_ENGINE_FILE_LINES = 300

SOURCES = sorted(PACKAGE.rglob("*.py"))
ENGINE = sorted((PACKAGE / "engine").rglob("*.py"))


def _id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


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


@pytest.mark.parametrize("path", ENGINE, ids=_id)
def test_engine_modules_are_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_ENGINE_FILE_LINES, f"{_id(path)}: {lines} lines"


def test_the_rules_see_the_package():
    # Guards against a path change that would leave the checks above with nothing to read.
    assert PACKAGE / "engine" / "adaptive.py" in ENGINE and len(SOURCES) > len(ENGINE)

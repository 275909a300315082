"""Size and layering rules of the package, read from the source with ast (nothing is
imported or run): every function short, every engine module small, and product code
independent of the test-support package mlxmtp.testing. One case per file, so that a
known exception can be marked on its own."""

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
PRODUCT = [p for p in SOURCES if (PACKAGE / "testing") not in p.parents]


def _id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path):
    """Every module an import statement of `path` names, relative imports resolved
    (`from . import x` names both the package and package.x)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


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


@pytest.mark.parametrize("path", PRODUCT, ids=_id)
def test_product_code_does_not_import_test_support(path):
    bad = sorted({m for m in _imported_modules(path) if m == "mlxmtp.testing" or m.startswith("mlxmtp.testing.")})
    assert not bad, f"{_id(path)} imports {bad}"


def test_the_rules_see_the_package():
    # Guards against a path change that would leave the checks above with nothing to read.
    assert PACKAGE / "engine" / "adaptive.py" in ENGINE and PACKAGE / "testing" / "fixtures.py" not in PRODUCT
    # ... and that relative imports are resolved: bench_cli names the demo prompts as `.models...`.
    assert "mlxmtp.models.demo_prompts" in set(_imported_modules(PACKAGE / "bench_cli.py"))

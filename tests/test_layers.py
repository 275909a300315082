"""Imports go down the layers only: checkpoint, mlxlm <- models <- engine <- distributed <-
server <- commands (the click command line), models <- convert; mlx-lm is imported by
mlxmtp/mlxlm alone; product code never imports test support. Read from the source with
`ast`; nothing is imported or run."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mlxmtp"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """(imported module, line, whether the import sits inside a function body) for every
    import of `path`, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    in_function = {id(n) for f in functions for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            yield name, node.lineno, id(node) in in_function


def _modules(sub: str):
    return sorted((PACKAGE / sub).rglob("*.py"))


def _reaches(name: str, target: str) -> bool:
    return name == target or name.startswith(target + ".")


def test_the_walker_resolves_relative_imports():
    # Sanity check of the walker itself on this repository's own layout.
    found = {name for name, _, _ in _imports(PACKAGE / "models" / "head_build.py")}
    assert "mlxmtp.checkpoint.hf_head" in found and "mlxmtp.mlxlm.family" in found


def _product_modules():
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.parent.name != "testing"]


@pytest.mark.parametrize("path", _modules("models"), ids=lambda p: p.name)
def test_models_never_import_convert(path):
    bad = [(n, line) for n, line, _ in _imports(path) if _reaches(n, "mlxmtp.convert")]
    assert not bad, f"{path.name} imports the converter: {bad}"


@pytest.mark.parametrize("path", _modules("checkpoint") + _modules("mlxlm"),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_lowest_layers_import_no_other_layer(path):
    """The checkpoint formats and the mlx-lm boundary import nothing else of mlxmtp."""
    own = f"mlxmtp.{path.relative_to(PACKAGE).parts[0]}"
    bad = [(n, line) for n, line, _ in _imports(path) if _reaches(n, "mlxmtp") and not _reaches(n, own)]
    assert not bad, f"{path.name} imports above its layer: {bad}"


@pytest.mark.parametrize("path", _product_modules(),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_imports_in_function_bodies_say_why(path):
    """An import inside a function (kept for CLI start-up or a heavy dependency) has a
    comment on its line or on the line above its block of imports."""
    lines = path.read_text().splitlines()
    unexplained = []
    for _, line, in_function in _imports(path):
        if not in_function:
            continue
        i = line - 1
        while i > 0 and lines[i - 1].strip().startswith(("import ", "from ")):
            i -= 1  # the first import of a consecutive block
        if "#" not in lines[line - 1] and not lines[i - 1].strip().startswith("#"):
            unexplained.append(line)
    assert not unexplained, f"{path.name}: imports inside functions without a reason, lines {sorted(set(unexplained))}"


@pytest.mark.parametrize("path", _product_modules(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_only_the_mlxlm_package_imports_mlx_lm(path):
    if path.parent.name == "mlxlm":
        return
    bad = [(n, line) for n, line, _ in _imports(path) if _reaches(n, "mlx_lm")]
    assert not bad, f"{path.name} imports mlx-lm directly: {bad}"


@pytest.mark.parametrize("path", _product_modules(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_product_code_does_not_import_test_support(path):
    bad = [(n, line) for n, line, _ in _imports(path) if _reaches(n, "mlxmtp.testing")]
    assert not bad, f"{path.name} imports the test-support package: {bad}"


LAYERS = {"checkpoint": 0, "mlxlm": 0, "models": 1, "convert": 2, "engine": 2, "distributed": 3, "server": 4,
          "commands": 5}


@pytest.mark.parametrize("path", [p for layer in LAYERS for p in _modules(layer)],
                         ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_imports_go_down_the_layers(path):
    own = path.relative_to(PACKAGE).parts[0]  # a sub-package (engine/proposers/) is its package's
    mine = LAYERS[own]
    bad = [(n, line) for n, line, _ in _imports(path) for layer, rank in LAYERS.items()
           if _reaches(n, f"mlxmtp.{layer}") and layer != own and rank >= mine]
    assert not bad, f"{path.name} imports its own level or above: {bad}"


def _import_graph():
    """mlxmtp module -> the mlxmtp modules it imports anywhere in it (at the top, in a
    function, under TYPE_CHECKING), as `_imports` reads them."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def module_of(name: str) -> str:  # `from a.b import name` -> a.b; `from a import b` -> a.b
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name

    return {m: {t for n, _, _ in _imports(p) if (t := module_of(n)) and t != m} for m, p in paths.items()}


def test_no_modules_import_each_other():
    """No circle in the import graph, of two modules or more: a type-only or on-use import
    counts too (a reader follows the arrow all the same). Share what both sides need from a
    module of its own instead."""
    graph, done, path = _import_graph(), set(), []

    def circle_from(m):
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        path.append(m)
        found = next(filter(None, map(circle_from, sorted(graph[m]))), None)
        path.pop()
        done.add(m)
        return found

    circle = next(filter(None, map(circle_from, sorted(graph))), None)
    assert circle is None, "modules that import each other: " + " -> ".join(circle)

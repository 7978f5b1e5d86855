"""The layout the engine's contract lives in (docs/engine.md): no import cycle between
layershard's modules, and no source file too long to read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 600  # a module a reader can hold in their head (issue 31 lowered it from 650)


def _modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        parts = p.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The layershard modules ``path`` imports at any depth: module level, inside functions and
    under ``if TYPE_CHECKING:``. A cycle hidden in a function-level or type-checking import is
    still two modules that each need the other; hiding the import only moves the failure to run
    time (or to the type checker).

    Not read: a package's module-level ``__getattr__`` (PEP 562), the lazy exports of a façade
    such as ``ls.hf`` and ``ls.save_checkpoint``, which run only when a user asks for the
    attribute (the modules behind them use the package's public names, ``ls.shard``); and a
    module-level ``if __name__ == "__main__":`` block, which runs as ``__main__``, a module
    nothing imports (``python -m layershard.train.loop.rank`` imports its own module there)."""
    tree = ast.parse(path.read_text())
    skipped = [
        node
        for node in tree.body
        if (
            path.name == "__init__.py"
            and isinstance(node, ast.FunctionDef)
            and node.name == "__getattr__"
        )
        or (isinstance(node, ast.If) and ast.unparse(node.test) in _MAIN_GUARDS)
    ]
    found = set()
    nodes: list[ast.AST] = [n for n in tree.body if n not in skipped]
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("layershard"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("layershard")}
        nodes.extend(ast.iter_child_nodes(node))
    return found & set(modules)


_MAIN_GUARDS = {"__name__ == '__main__'", "'__main__' == __name__"}


def test_no_import_cycle():
    modules = _modules()
    graph = {m: _imports(p, modules) for m, p in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in graph[u]:
            if state.get(v) == 1:
                cycles.append(" -> ".join(stack[stack.index(v) :] + [v]))
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in graph:
        if m not in state:
            visit(m)
    assert not cycles, cycles
    assert graph["layershard.engine.buffers"] <= {"layershard.engine.collectives"}


def test_no_source_file_too_long():
    long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_every_layershard_import_names_a_module_that_exists():
    """Each ``from layershard.x import y`` and ``import layershard.x`` in the sources, at any
    depth (function-level imports included), names a module of the package. mypy does not see a
    stale path once the import is ignored as missing, and the lazily imported ``ls.hf`` hid one
    until its tests ran."""
    modules = _modules()
    stale = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("layershard"):
                if node.module not in modules:
                    stale.append(f"{name}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("layershard") and a.name not in modules:
                        stale.append(f"{name}: import {a.name}")
    assert not stale, stale

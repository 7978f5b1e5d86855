"""The layout the engine's contract lives in (docs/engine.md): no import cycle between
layershard's modules, each package imports only from the layers below it (``LAYERS``), no
private name is imported across packages, every process group is made in ``groups.py``, and no
source file is too long to read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 600  # a module a reader can hold in their head

# Who may import whom: a module imports from its own layer and the layers below, never above.
# Names are top-level packages or modules of ``layershard`` ("" is the package itself, whose
# ``__init__`` re-exports the façade and ``ls.parallelize``).
LAYERS = [
    {"distributed", "groups", "meshes", "validation"},  # process groups, meshes, input schemas
    {"engine"},  # the engine: units, flat storage, gathers, reductions
    {"parallel"},  # parallelism the models compute with (expert parallelism's all-to-all)
    {"sharded", "full_state", "loss"},  # the façade: ls.shard, ShardedModule, the chunked loss
    {"", "models", "parallelize"},  # reference models and their TP plans; ls.parallelize
    {"checkpoint", "optim", "hf", "ft"},  # what users call on a sharded model
    {"train", "bench", "plan", "testbed", "cli", "__main__"},  # the commands, the testbed
]
# The only module that makes process groups and meshes (groups.py's docstring says who owns each).
GROUP_MAKERS = {"new_group", "new_subgroups", "new_subgroups_by_enumeration", "init_device_mesh"}


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


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    (i,) = [i for i, names in enumerate(LAYERS) if top in names]
    return i


def test_layers_import_downward_only():
    """Every layershard module sits in one layer of ``LAYERS`` and imports nothing from a layer
    above its own (a new package must be placed first)."""
    modules = _modules()
    upward = []
    for name, path in modules.items():
        for dep in _imports(path, modules):
            if _layer(dep) > _layer(name):
                upward.append(f"{name} -> {dep}")
    assert not upward, upward


def test_no_private_name_across_packages():
    """``from layershard.a.b import _x`` only from within package ``a``: a private name is the
    business of its own package (make it public, with a docstring, where another needs it)."""
    modules = _modules()
    leaks = []
    for name, path in modules.items():
        home = name.split(".")[1] if "." in name else ""
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("layershard."):
                if node.module.split(".")[1] != home:
                    leaks += [f"{name}: {node.module}.{a.name}" for a in node.names
                              if a.name.startswith("_")]  # fmt: skip
    assert not leaks, leaks


def test_process_groups_made_in_groups_only():
    """No ``new_group``/``init_device_mesh`` outside ``groups.py``: every group and mesh has the
    owner and the end its docstring gives it."""
    makers = []
    for name, path in _modules().items():
        if name == "layershard.groups":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if called in GROUP_MAKERS:
                    makers.append(f"{name}:{node.lineno} {called}")
    assert not makers, makers


def test_engine_docstring_lists_every_module():
    """``engine/__init__.py`` is the engine's table of contents: it names every module."""
    engine = SRC / "layershard" / "engine"
    doc = ast.get_docstring(ast.parse((engine / "__init__.py").read_text())) or ""
    missing = [p.stem for p in engine.glob("*.py") if p.stem != "__init__"]
    missing = [m for m in missing if f"``{m}``" not in doc]
    assert not missing, missing


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

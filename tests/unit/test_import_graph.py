"""The import graph of aioreduce: no cycle, and the runtime never imports the tools.

Read from the source (``ast``), so every import counts, also those inside functions (a lazy
import still makes a cycle: it only moves the failure to the first call). Imports under
``if TYPE_CHECKING:`` never run and are left out. Importing ``a.b.c`` runs the ``__init__`` of
``a.b`` first, so it counts as importing that package too (but not a package the importer
itself is inside: Python has that one already)."""

from __future__ import annotations

import ast
from pathlib import Path

import aioreduce

ROOT = Path(aioreduce.__file__).parent
TOOLS = ("aioreduce.bench", "aioreduce.sim")


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _type_only(tree: ast.Module) -> set[int]:
    """ids of import nodes inside ``if TYPE_CHECKING:`` blocks."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def _targets(mod: str, is_pkg: bool, node: ast.Import | ast.ImportFrom,
             mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        if node.level:
            base = base[:len(base) - (node.level - 1)]
            prefix = ".".join([*base, *([node.module] if node.module else [])])
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in mods else prefix
                 for a in node.names]
    out = []
    for name in names:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in mods and name.startswith("aioreduce"):
            # The packages it runs on the way (not the importer's own ancestors).
            parts = name.split(".")
            out.extend(".".join(parts[:i]) for i in range(2, len(parts) + 1)
                       if not mod.startswith(".".join(parts[:i]) + ".")
                       and ".".join(parts[:i]) != mod)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_only(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in skip:
                graph[mod].update(_targets(mod, path.name == "__init__.py", node, mods))
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_graph_sees_lazy_imports_and_package_inits() -> None:
    graph = _graph()
    assert "aioreduce.tensors" in graph["aioreduce.inputs"]  # imported inside functions
    # importing aioreduce.costmodel.config from the bench runs aioreduce.costmodel's __init__
    bench = graph["aioreduce.bench.allreduce"]
    assert {"aioreduce.costmodel", "aioreduce.costmodel.config"} <= bench


def test_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_a_cycle_is_found_where_there_is_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_the_runtime_never_imports_the_tools() -> None:
    graph = _graph()
    found = {(mod, dep) for mod, deps in graph.items() for dep in deps
             if not mod.startswith(TOOLS) and dep.startswith(TOOLS)}
    assert found == set()


def test_no_scheme_imports_the_transport() -> None:
    """Schemes reach the lanes through the comm's typed capability (Comm.bulk_links)."""
    graph = _graph()
    found = {(mod, dep) for mod, deps in graph.items() for dep in deps
             if mod.startswith("aioreduce.schemes") and dep.startswith("aioreduce.transport")}
    assert found == set()

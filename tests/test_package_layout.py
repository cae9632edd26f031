"""The package's shape, read from its source with ``ast`` (nothing is imported or executed):
no import cycle (imports inside functions included), the library never imports the tools,
and no function grows past what one reader can hold.  Classes are not cut to a line count:
splitting one idea into mixins to stay under a cap made the runtime harder to read, not
easier.  A class over ``MAX_CLASS_LINES`` needs an entry in ``LONG_CLASSES`` that says why
it is one idea, and stays under ``MAX_LONG_CLASS_LINES``."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fx_offload"
TOOLS = "fx_offload.tools"
BENCHMARKS = "fx_offload.benchmarks"
MAX_CLASS_LINES = 200
MAX_LONG_CLASS_LINES = 400
MAX_FUNCTION_LINES = 120
# class -> why it is one idea however long
LONG_CLASSES = {
    "fx_offload.kv.runtime.HostKV": "one host KV cache's slots, streams and per-step copies: "
                                    "every method orders the same three streams",
    "fx_offload.runtime.experts.host_experts.HostExperts":
        "one model's host_experts ops: each call's plan, where each layer ran, its queued jobs "
        "and what they read",
    "fx_offload.runtime.memory.slots.SlotBuffers":
        "one model's host blocks and device slots: laid out together, filled and copied by "
        "the same chunks",
    "fx_offload.runtime.state.OffloadState": "one model's run-time state: its life "
                                             "(materialize, restore, detach) and a call's "
                                             "steps in their one order, over its parts",
}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package modules it imports, at any depth of its code.  ``from P import
    x`` counts as importing ``P.x`` where that is a module, else ``P``."""
    known = modules(root)
    top = root.name
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.name == "__init__.py", node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in known and t != name and
                      (t == top or t.startswith(top + "."))}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def depth(graph: dict[str, set[str]], ignore: set[str] = frozenset()) -> int:
    """Modules on the longest import chain (an acyclic graph)."""
    memo: dict[str, int] = {}

    def longest(node):
        if node not in memo:
            memo[node] = 1 + max((longest(n) for n in graph[node] if n not in ignore),
                                 default=0)
        return memo[node]
    return max(longest(n) for n in graph if n not in ignore)


def is_tool(name: str) -> bool:
    """The command line, its tools and the benchmarks: around the library, never in it."""
    return any(name == p or name.startswith(p + ".") for p in (TOOLS, BENCHMARKS)) \
        or name == "fx_offload.__main__"


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_library_never_imports_the_tools():
    bad = sorted((a, b) for a, edges in import_graph().items() if not is_tool(a)
                 for b in edges if is_tool(b))
    assert bad == [], bad


def runtime_imports(graph: dict) -> list:
    """(module, runtime module) for each import of ``fx_offload.runtime`` by a module of
    ``selection/`` or ``passes/``, or by ``layout`` (the byte layout the pass arranges and
    the runtime follows)."""
    early = ("fx_offload.selection", "fx_offload.passes", "fx_offload.layout")
    return sorted((a, b) for a, edges in graph.items()
                  if a in early or a.startswith(tuple(e + "." for e in early))
                  for b in edges
                  if b == "fx_offload.runtime" or b.startswith("fx_offload.runtime."))


def test_selection_and_the_pass_never_import_the_runtime():
    """The phases run one way, selection -> pass -> runtime: what the planner must know of
    the runtime's rules lives in a leaf both import (``fx_offload.copy_rules``), the
    codecs in ``fx_offload.codecs``."""
    assert runtime_imports(import_graph()) == []


def test_classes_and_functions_stay_small():
    too_long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            long_class = f"{name}.{getattr(node, 'name', '')}" in LONG_CLASSES
            limit = ((MAX_LONG_CLASS_LINES if long_class else MAX_CLASS_LINES)
                     if isinstance(node, ast.ClassDef) else
                     MAX_FUNCTION_LINES if isinstance(node, (ast.FunctionDef,
                                                             ast.AsyncFunctionDef)) else None)
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                too_long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert too_long == [], too_long


def test_the_checks_can_fail(tmp_path):
    """A planted cycle (through an import inside a function) and a planted tool import are
    found, so the checks above are not vacuous."""
    pkg = tmp_path / "fx_offload"
    (pkg / "tools").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "tools" / "__init__.py").write_text("")
    (pkg / "tools" / "demo.py").write_text("from .. import a\n")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n    from .tools import demo\n")
    graph = import_graph(pkg)
    assert find_cycle(graph) == ["fx_offload.a", "fx_offload.b", "fx_offload.a"]
    assert "fx_offload.tools.demo" in graph["fx_offload.b"]
    (pkg / "selection").mkdir()
    (pkg / "runtime").mkdir()
    for f in ("selection/__init__.py", "runtime/__init__.py", "runtime/slots.py"):
        (pkg / f).write_text("")
    (pkg / "selection" / "budget.py").write_text("def f():\n    from ..runtime import slots\n")
    assert runtime_imports(import_graph(pkg)) == [("fx_offload.selection.budget",
                                                   "fx_offload.runtime.slots")]
    with pytest.raises(RecursionError):
        depth(graph)


def test_import_depth_is_reported():
    """The longest chain of library imports; printed with -s for the record."""
    graph = import_graph()
    library = depth(graph, ignore={n for n in graph if is_tool(n)} | {"fx_offload"})
    print(f"library import depth: {library} modules; modules: {len(graph)}")
    assert 1 < library < len(graph)

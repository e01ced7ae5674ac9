"""No import cycles among the modules of kjit/ and service/, and service is never imported by kjit.

Imports are read with ``ast`` from the source (module-level and function-level imports alike:
a lazy import inside a function is still a dependency), resolved to modules of the two
packages, and the graph is searched for cycles (Tarjan's strongly connected components).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kjit", "service")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules) -> str | None:
    """The longest known module that ``name`` is or lies in (``a.b.C`` -> ``a.b``)."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in modules:
            return cand
        parts.pop()
    return None


def _imports(mod: str, path: Path, modules) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    deps = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                r = _resolve(a.name, modules)
                if r:
                    deps.add(r)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                prefix = ".".join(anchor + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for a in node.names:
                r = _resolve(f"{prefix}.{a.name}", modules) or _resolve(prefix, modules)
                if r:
                    deps.add(r)
    # importing a.b.c also runs a and a.b, but those are packages' __init__ files; a module's
    # own package __init__ importing the module back is not a cycle we care about
    deps.discard(mod)
    return deps


def _graph():
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycles(graph) -> list[list[str]]:
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_package_parent(a: str, b: str) -> bool:
    return b.startswith(a + ".") or a.startswith(b + ".")


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_kjit_and_service_modules():
    graph = _graph()
    assert "kjit.operators" in graph and "service.store" in graph  # the scan sees the code
    # a package's __init__ re-exporting its submodules, which import siblings through the
    # package, is not a cycle between modules: drop edges from a package to its own children
    pruned = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    cycles = _cycles(pruned)
    assert cycles == [], f"import cycles: {cycles}"


def test_kjit_never_imports_service():
    graph = _graph()
    bad = {m: sorted(d for d in deps if d.split(".")[0] == "service")
           for m, deps in graph.items() if m.split(".")[0] == "kjit"}
    bad = {m: d for m, d in bad.items() if d}
    assert bad == {}, f"kjit modules importing service: {bad}"

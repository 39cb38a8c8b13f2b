"""The shape of the source: no import circles among the kernels and the runtime (a Triton module never
imports its dispatcher; what both need lives in ``kernels/common.py``), and no function of the executor longer
than a screen. Read from the source with ``ast``, so lazy imports inside functions count too."""

from __future__ import annotations

import ast
import os

import tidal

ROOT = os.path.dirname(os.path.abspath(tidal.__file__))
MAX_FUNCTION_LINES = 80


def modules(package_dir: str, package: str) -> dict[str, str]:
    """``{dotted name: path}`` of every module of the package in ``package_dir`` (its folders with an
    ``__init__.py``), named as ``package``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames[:] = [d for d in dirnames
                       if not d.startswith((".", "__")) and os.path.exists(os.path.join(dirpath, d, "__init__.py"))]
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), package_dir)[:-3].split(os.sep)
                out[".".join([package] + (rel[:-1] if rel[-1] == "__init__" else rel))] = os.path.join(dirpath, name)
    return out


def import_graph(mods: dict[str, str]) -> dict[str, set[str]]:
    """Which of ``mods`` each module imports, anywhere in its body."""
    graph = {}
    for name, path in mods.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    parts = parts[:len(parts) - node.level + 1]
                    target = ".".join(parts + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if sub in mods else target)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_circles_among_the_kernels_and_the_runtime():
    mods = modules(ROOT, "tidal")
    assert any(m.startswith("tidal.kernels.") for m in mods) and any(m.startswith("tidal.runtime.") for m in mods)
    found = [c for c in circles(import_graph(mods))
             if any(m.startswith(("tidal.kernels.", "tidal.runtime.")) for m in c)]
    assert found == []


def test_a_circle_through_a_lazy_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ops.py").write_text("from .common import LIMIT\n\ndef op():\n    from .ops_triton import op_triton\n")
    (pkg / "ops_triton.py").write_text("from .ops import helper\n")
    (pkg / "common.py").write_text("LIMIT = 1\n")
    (pkg / "user.py").write_text("from . import ops\n")
    assert circles(import_graph(modules(str(pkg), "pkg"))) == [["pkg.ops", "pkg.ops_triton"]]


def long_functions(path: str) -> list[tuple[str, int]]:
    tree = ast.parse(open(path).read())
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_of_the_executor_is_longer_than_a_screen():
    mods = modules(ROOT, "tidal")
    paths = [p for m, p in mods.items() if m.startswith("tidal.executor.")]
    assert len(paths) > 10
    found = {os.path.relpath(p, ROOT): long for p in paths if (long := long_functions(p))}
    assert found == {}


def test_a_long_function_is_found(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def short():\n    pass\n\n\ndef long():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert long_functions(str(path)) == [("long", MAX_FUNCTION_LINES + 1)]

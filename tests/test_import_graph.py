"""The house rules of the package's import graph, read from the source (ast): no import cycle among
the modules (imports inside functions count), no module taking another module's underscored names,
and the model never importing the training side."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("qwen3vl_jax", "pallas_kernels")


def _modules() -> dict[str, str]:
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    found[module.removesuffix(".__init__")] = path
    return found


def _imports(module: str, path: str, modules: dict[str, str]):
    """(target module, imported names) for every import statement of `module`, at any depth."""
    is_package = path.endswith("__init__.py")
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: None if is_package else -1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [alias.name for alias in node.names]
            yield target, names
            for name in names:  # `from . import x` names a submodule
                if f"{target}.{name}" in modules:
                    yield f"{target}.{name}", []


def _graph():
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for module, path in modules.items():
        for target, names in _imports(module, path, modules):
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target not in modules or target == module:
                continue
            edges[module].add(target)
            private += [f"{module} takes {target}.{n}" for n in names
                        if n.startswith("_") and not n.startswith("__") and f"{target}.{n}" not in modules]
    return modules, edges, private


def _cycles(modules, edges) -> list[list[str]]:
    """Strongly connected components of more than one module; a package `__init__` that re-exports
    its submodules is the package's face, not a module of code, so edges through it are left out."""
    faces = {m for m, p in modules.items() if p.endswith("__init__.py")}
    graph = {m: edges[m] - faces for m in modules if m not in faces}
    order, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in order:
            visit(v)
    return found


def test_no_import_cycle():
    modules, edges, _ = _graph()
    assert len(modules) > 40 and sum(map(len, edges.values())) > 100  # the walk found the code
    assert _cycles(modules, edges) == []


def test_no_module_takes_another_modules_underscored_names():
    assert _graph()[2] == []


def test_the_model_does_not_import_the_training_side():
    _, edges, _ = _graph()
    assert not [t for t in edges["qwen3vl_jax.model"] if t.startswith("qwen3vl_jax.training")]


def test_the_checks_can_fail():
    """The same checks on a small graph with a cycle through a function-level import."""
    modules = {"p.a": "a.py", "p.b": "b.py", "p.c": "c.py"}
    edges = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}}
    assert _cycles(modules, edges) == [["p.a", "p.b", "p.c"]]
    edges["p.c"] = set()
    assert _cycles(modules, edges) == []

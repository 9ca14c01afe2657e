"""The package's layers, read from its imports: every arrow points down, and no module imports itself back.

Imports inside functions count too (a lazy import is still a dependency). `from pkg import mod`
is an arrow to `pkg.mod` only, so a package's `__init__` that re-exports its modules is no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import zerofit

ROOT = Path(zerofit.__file__).parent

# Lowest first. A module may import its own package and any lower layer, never a higher one.
LAYERS = [
    ("zerofit.errors", "zerofit.logging"),
    ("zerofit.config",),
    ("zerofit.distributed",),
    ("zerofit.engine",),
    ("zerofit.checkpoint", "zerofit.plan"),
    ("zerofit.frontend",),
    # the public spellings: zerofit.Accelerator, zerofit.utils.set_seed, zerofit.tracking.GeneralTracker
    ("zerofit.utils", "zerofit.tracking", "zerofit.local_sgd", "zerofit"),
    ("zerofit.integrations",),  # other libraries' training loops (transformers' Trainer, TRL) on the Accelerator
    ("zerofit.testing", "zerofit.bench"),
    ("zerofit.cli",),
    ("zerofit.demo",),  # a training script of the library's own, started by `zerofit demo` by module name
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    found.add(target if target in mods else source)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        edges[name] = {t for t in found if t in mods and t != name}
    return edges


def _layer(module: str) -> tuple[int, str]:
    best = None
    for i, owners in enumerate(LAYERS):
        for owner in owners:
            if (module == owner or module.startswith(owner + ".")) and (best is None or len(owner) > len(best[1])):
                best = (i, owner)
    assert best is not None, f"{module} belongs to no layer: add its package to LAYERS"
    return best


def test_every_import_points_down_the_layers():
    edges = _edges(_modules())
    upward = []
    for source, targets in edges.items():
        (ls, owner_s) = _layer(source)
        for target in targets:
            (lt, owner_t) = _layer(target)
            if owner_s != owner_t and lt >= ls:
                upward.append(f"{source} -> {target}")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    edges = _edges(_modules())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_nothing_below_the_front_end_is_handed_an_accelerator():
    """No function below `zerofit.frontend` takes a parameter named `accelerator` / `acc`: each layer gets
    the objects it needs (a config, the engine, a process group), not the facade."""
    handed = []
    for name, path in _modules().items():
        if _layer(name)[0] >= _layer("zerofit.frontend")[0]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                handed += [f"{name}.{node.name}({a.arg})" for a in args if a.arg in ("accelerator", "acc")]
    assert not handed, f"functions below the front end handed an Accelerator: {handed}"

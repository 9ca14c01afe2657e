"""The import graph of zerofit.cli: main imports the subcommands, nothing imports main, no cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import zerofit.cli

CLI = Path(zerofit.cli.__file__).parent


def cli_imports(path: Path) -> set[str]:
    """The zerofit.cli modules a module imports anywhere (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return {n.split(".")[2] for n in names if n.startswith("zerofit.cli.")} - {path.stem}


def test_cli_imports_point_from_main_to_the_subcommands_without_cycles():
    graph = {p.stem: cli_imports(p) for p in CLI.glob("*.py") if p.stem != "__init__"}
    assert not [m for m, deps in graph.items() if "main" in deps]
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module not in done:
            for dep in graph.get(module, ()):
                visit(dep, (*path, module))
            done.add(module)

    for module in graph:
        visit(module, ())

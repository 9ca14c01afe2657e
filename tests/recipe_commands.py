"""The command lines docs/recipes.md shows, read from the page, so the tests run what a reader types."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES_MD = ROOT / "docs" / "recipes.md"


def commands(heading: str) -> list[list[str]]:
    """Each command of the first ```bash block under `## heading`, split as the shell splits it
    (backslash-continued lines joined, comment lines dropped)."""
    text = RECIPES_MD.read_text(encoding="utf-8")
    section = text.split(f"\n## {heading}\n", 1)
    assert len(section) == 2, f"docs/recipes.md has no '## {heading}' section"
    block = re.search(r"^```bash\n(.*?)^```", section[1].split("\n## ", 1)[0], flags=re.S | re.M)
    assert block, f"docs/recipes.md: no ```bash block under '## {heading}'"
    joined = block.group(1).replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def script_args(heading: str, script: str) -> list[str]:
    """The arguments the command under `heading` that runs `examples/<script>` gives the script."""
    for argv in commands(heading):
        if f"examples/{script}" in argv:
            return argv[argv.index(f"examples/{script}") + 1:]
    raise AssertionError(f"docs/recipes.md: no command under '## {heading}' runs examples/{script}")

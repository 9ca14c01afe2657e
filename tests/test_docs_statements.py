"""What README.md and docs/ state about values the code decides is what the code decides.

- docs/configs.md's Accelerate YAML comments list the `offload_*_device` values and the stages each takes:
  exactly those load, every other value of the schema (and a stray one) is refused;
- every `pip install` of the docs names extras pyproject.toml declares;
- the README's Install line for the examples installs the `[examples]` extra, and that extra (with the core
  dependencies) brings every library examples/*.py imports;
- the Python and PyTorch versions the README's Install names are pyproject.toml's, its pinned torch run.sh's.

Everything here reads files and loads configs: no process starts.
"""

from __future__ import annotations

import ast
import re
import sys
import typing
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from zerofit.config import load_config
from zerofit.config.schema import OffloadDevice
from zerofit.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STAGES = (0, 1, 2, 3)


def _documented_devices(key: str) -> dict[str, set[int]]:
    """`key: cpu  # none, cpu (stages 1-3), nvme (stage 3) or auto` -> {value: the stages it is documented for}.

    A value without a note is documented for every stage."""
    text = (ROOT / "docs" / "configs.md").read_text(encoding="utf-8")
    comments = re.findall(rf"^\s+{key}: \S+\s+# (.*)$", text, flags=re.M)
    assert len(comments) == 1, f"docs/configs.md: one commented `{key}:` line expected, found {len(comments)}"
    documented = {}
    for value, note in re.findall(r"(\w+)(?: \(([^)]*)\))?(?:,| or|$)", comments[0]):
        if not note:
            documented[value] = set(STAGES)
        elif m := re.fullmatch(r"stages (\d)-(\d)", note):
            documented[value] = set(range(int(m[1]), int(m[2]) + 1))
        else:
            m = re.fullmatch(r"stage (\d)", note)
            assert m, f"docs/configs.md, `{key}`: the note ({note}) is neither 'stage N' nor 'stages A-B'"
            documented[value] = {int(m[1])}
    return documented


@pytest.mark.parametrize("kind", ["offload_optimizer", "offload_param"])
def test_the_documented_accelerate_offload_devices_are_what_the_reader_accepts(kind, tmp_path):
    documented = _documented_devices(f"{kind}_device")
    tried = {*typing.get_args(OffloadDevice), "auto", "gpu", *documented}
    accepted: dict[str, set[int]] = {value: set() for value in tried}
    for value in sorted(tried):
        for stage in STAGES:
            path = tmp_path / f"{value}{stage}.yaml"
            path.write_text(f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: {stage}\n"
                            f"  {kind}_device: {value}\n  {kind}_nvme_path: {tmp_path}\n", encoding="utf-8")
            try:
                load_config(path)
            except ConfigError:
                continue
            accepted[value].add(stage)
    assert {v: s for v, s in accepted.items() if s} == documented


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _extras_installed(line: str) -> list[list[str]]:
    return [m.split(",") for m in re.findall(r"pip install [^\n#]*?-e ['\"]?\.\[([\w,-]+)\]", line)]


def test_every_pip_install_names_extras_pyproject_declares():
    declared = set(_pyproject()["optional-dependencies"])
    named = [(page.name, extra) for page in [*PAGES, ROOT / "run.sh"]
             for extras in _extras_installed(page.read_text(encoding="utf-8")) for extra in extras]
    assert named, "no `pip install -e .[...]` found in the docs"
    assert [(page, extra) for page, extra in named if extra not in declared] == []


def _distribution(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _imported_libraries(path: Path) -> set[str]:
    local = {p.stem for p in path.parent.glob("*.py")} | {"zerofit"}
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return {name for name in found if name not in local and name not in sys.stdlib_module_names}


def test_the_readme_installs_the_examples_extra_and_it_brings_what_the_examples_import():
    install = (ROOT / "README.md").read_text(encoding="utf-8").split("## Install", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in install.splitlines() if "pip install" in line and "examples" in line.split("#", 1)[-1]]
    assert lines and all(["examples"] in _extras_installed(line) for line in lines), lines
    project = _pyproject()
    brought = {_distribution(r) for r in [*project["dependencies"], *project["optional-dependencies"]["examples"]]}
    dists = packages_distributions()
    missing = {}
    for script in sorted((ROOT / "examples").glob("*.py")):
        for library in _imported_libraries(script):
            provided_by = {d.lower().replace("_", "-") for d in dists.get(library, [library])}
            if not provided_by & brought:
                missing[f"{script.name}: {library}"] = sorted(provided_by)
    assert missing == {}, f"imported by examples/ but not in the examples extra of pyproject.toml: {missing}"


def test_the_readmes_versions_are_pyprojects_and_run_shs():
    """"Python 3.10 or newer and PyTorch 2.4 or newer", and the pinned CPU torch, as pyproject.toml and run.sh say."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    python, torch = re.search(r"needs Python ([\d.]+) or newer and PyTorch ([\d.]+) or newer", readme).groups()
    project = _pyproject()
    assert project["requires-python"] == f">={python}"
    assert f"torch>={torch}" in project["dependencies"]
    pinned = re.search(r"^TORCH_VERSION=([\d.]+)$", (ROOT / "run.sh").read_text(encoding="utf-8"), flags=re.M)[1]
    assert re.findall(r"torch==([\d.]+)", readme) == [pinned, pinned]  # the Install line and run.sh's description

"""The README's config examples load, and its test command is the one CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zerofit.config import load_config
from zerofit.config.schema import is_auto

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```(yaml|json)\n(.*?)```", README, flags=re.S)


def test_the_readme_has_config_examples_in_every_format():
    kinds = [kind for kind, _ in BLOCKS]
    assert kinds.count("yaml") >= 6 and kinds.count("json") >= 3
    assert any("distributed_type: DEEPSPEED" in text for _, text in BLOCKS)


@pytest.mark.parametrize(("kind", "text"), BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_every_config_example_in_the_readme_loads(kind, text, tmp_path):
    path = tmp_path / f"example.{kind}"
    path.write_text(text, encoding="utf-8")
    cfg = load_config(path)
    stage = re.search(r"(?:stage|zero_stage)\"?: \"?(\d|auto)", text)
    assert stage
    if stage.group(1) == "auto":
        assert is_auto(cfg.zero.stage) and is_auto(cfg.zero.offload_optimizer.device)
    else:
        assert cfg.zero.stage == int(stage.group(1))


def test_the_readme_commands_are_what_ci_runs():
    assert "./run.sh demo" in README and "./run.sh test" in README
    assert "./run.sh test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python -m pytest -x -q" in (ROOT / "run.sh").read_text(encoding="utf-8")

"""docs/recipes.md's offline walkthrough, as a reader types it in a fresh clone: build the tiny assets,
run the causal-LM no_trainer recipe and the Trainer example through the real `zerofit launch`, merge
the Trainer's output with `zerofit merge`, and load the merged weights with `from_pretrained`.

The commands are read from the page (tests/recipe_commands.py) and run from a folder whose `examples`
is the repository's, so `out/...` lands in the test's folder; the Hub is unreachable (HF_HUB_OFFLINE=1).
The other two no_trainer commands of the page run in tests/test_recipes.py, with the page's arguments.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from recipe_commands import ROOT, commands

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("accelerate")  # transformers' Trainer imports it

pytestmark = pytest.mark.slow

TINY, TRAINER = "Offline, on tiny assets", "A Trainer example"


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROFIT_CONFIG_FILE", "OMP_NUM_THREADS")}
    env.update(HF_HOME=str(cwd / "hf_home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    program = {"zerofit": [sys.executable, "-m", "zerofit.cli.main"], "python": [sys.executable]}[argv[0]]
    proc = subprocess.run([*program, *argv[1:]], capture_output=True, text=True, timeout=240, env=env, cwd=cwd)
    assert proc.returncode == 0, f"{' '.join(argv)}\n{proc.stderr[-6000:]}"
    return proc


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def test_the_offline_walkthrough_runs_as_written_and_the_merged_trainer_output_loads(tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    tiny = commands(TINY)
    build = tiny[0]
    assert build[:2] == ["python", "examples/make_tiny_assets.py"], build
    clm = next(c for c in tiny if "examples/run_clm_no_trainer.py" in c)
    trainer, merge = commands(TRAINER)
    assert "examples/run_clm_trainer.py" in trainer and merge[:2] == ["zerofit", "merge"], (trainer, merge)

    _run(build, tmp_path)
    assets = tmp_path / build[2]
    for task, files in {"clm": ("train.txt", "validation.txt"), "cls": ("train.json", "validation.json"),
                        "seq2seq": ("train.json", "validation.json")}.items():
        model = assets / task / "model"
        assert (model / "model.safetensors").is_file() and (model / "tokenizer.json").is_file(), task
        assert all((assets / task / f).stat().st_size > 0 for f in files), task
    # the two launches are independent: together they keep both cores busy through each one's start-up
    with ThreadPoolExecutor(max_workers=2) as pool:
        for future in [pool.submit(_run, clm, tmp_path), pool.submit(_run, trainer, tmp_path)]:
            future.result()
    merged = _run(merge, tmp_path)

    clm_out = tmp_path / clm[clm.index("--output_dir") + 1]
    results = json.loads((clm_out / "results.json").read_text())
    assert results["zero_stage"] == 2 and results["completed_steps"] == 12 and results["perplexity"] > 0
    assert (clm_out / "step_4").is_dir() and transformers.AutoModelForCausalLM.from_pretrained(clm_out)

    trainer_out = tmp_path / trainer[trainer.index("--output_dir") + 1]
    assert sorted(p.name for p in trainer_out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert all((trainer_out / c / "zerofit_state").is_dir() for c in ("checkpoint-2", "checkpoint-4"))
    metrics = json.loads((trainer_out / "all_results.json").read_text())
    assert metrics["perplexity"] > 0 and "train_loss" in metrics
    assert "merging" in merged.stderr and "checkpoint-4" in merged.stderr

    merged_out = tmp_path / merge[3]
    model = transformers.AutoModelForCausalLM.from_pretrained(merged_out)
    saved, start = _weights(trainer_out), _weights(assets / "clm" / "model")
    loaded = model.state_dict()
    for name, tensor in saved.items():  # the merged checkpoint-4 is the model save_model wrote at step 4
        assert loaded[name].equal(tensor), name
    assert any(not start[name].equal(tensor) for name, tensor in saved.items()), "training changed nothing"

"""The three recipes in examples/ through the real CLI: `zerofit launch --cpu --num_processes 2`.

Each recipe runs a few steps under DDP (zerofit YAML), ZeRO-2 (Accelerate YAML) and ZeRO-3 with CPU
offload of optimizer and parameters (DeepSpeed JSON; plain ZeRO-3 too for the causal LM), with the
arguments docs/recipes.md's offline commands give it, on the tiny models and data that
examples/make_tiny_assets.py builds (no downloads).
In fp32 the stages compute the same thing and differ only in the order of floating-point sums
(reduce-scatter vs all-reduce), so losses and metrics must agree to 1e-4 relative: that is the seed's
"no drop in accuracy", checked exactly rather than statistically.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from parallel_runs import two_at_a_time
from recipe_commands import script_args

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("tokenizers")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CONFIGS = EXAMPLES / "configs"
REL = 1e-4  # fp32 on CPU: only the summation order differs between stages

RESULT_FIELDS = {"task", "metric", "distributed_type", "zero_stage", "offload_optimizer", "offload_param",
                 "mixed_precision", "num_processes", "per_device_train_batch_size", "per_device_eval_batch_size",
                 "gradient_accumulation_steps", "total_train_batch_size", "epochs", "completed_steps",
                 "largest_batch", "train_time_per_epoch_s", "eval_time_per_epoch_s", "peak_gpu_memory_gib"}
EPOCH_FIELDS = {"epoch", "train_time_s", "eval_time_s", "train_loss"}


# --- tiny assets: the shipped builder, and the arguments docs/recipes.md gives each recipe -----------
def build_assets(root: Path) -> Path:
    """examples/make_tiny_assets.py's folders under root: what `python examples/make_tiny_assets.py root` writes."""
    spec = importlib.util.spec_from_file_location("make_tiny_assets", EXAMPLES / "make_tiny_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build(root)
    return root


def page_args(script: str) -> Callable[[Path], list[str]]:
    """The arguments docs/recipes.md's offline command gives `script`, its `out/tiny` read as the test's
    assets and its --output_dir left to `launch`."""
    args = script_args("Offline, on tiny assets", script)
    at = args.index("--output_dir")
    args = args[:at] + args[at + 2:]
    return lambda assets: [str(assets / a.removeprefix("out/tiny/")) if a.startswith("out/tiny/") else a
                           for a in args]


# --- running the recipes through the CLI -----------------------------------------------------
def _sharded(name: str):
    """The shipped DeepSpeed JSON `name`, with every unit sharded however small.

    Its default persistence threshold (1e5 elements) would keep these tiny models' units whole on
    every rank, which would not test stage 3 at all.
    """
    def write(tmp: Path) -> Path:
        config = json.loads((CONFIGS / "deepspeed" / f"{name}.json").read_text())
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        path = tmp / f"{name}_sharded.json"
        path.write_text(json.dumps(config))
        return path
    return write


# one config per format, so the three loaders are exercised end to end too
STAGES = {
    "ddp": lambda tmp: CONFIGS / "zerofit" / "ddp.yaml",
    "zero2": lambda tmp: CONFIGS / "accelerate" / "zero2.yaml",
    "zero3": _sharded("zero3"),
    "zero3_offload": _sharded("zero3_offload"),
}

COMMON = ["--seed", "0", "--num_train_epochs", "2", "--per_device_eval_batch_size", "4"]
# recipe -> (script, its arguments given the assets folder, the metrics it reports)
RECIPES = {recipe: (f"run_{recipe}_no_trainer.py", page_args(f"run_{recipe}_no_trainer.py"), metrics)
           for recipe, metrics in (("clm", ["perplexity", "eval_loss"]), ("cls", ["accuracy", "f1"]),
                                   ("seq2seq", ["bleu", "gen_len", "eval_samples"]))}


def launch(config: Path, script: str, out: Path, args: list, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROFIT_CONFIG_FILE", "OMP_NUM_THREADS")}
    # the datasets cache goes to the test's folder, and nothing may reach for the hub
    env.update(HF_HOME=str(cwd / "hf_home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    command = [sys.executable, "-m", "zerofit.cli.main", "launch", "--cpu", "--num_processes", "2",
               "--mixed_precision", "no", "--config_file", str(config), str(EXAMPLES / script),
               *[str(a) for a in args], "--output_dir", str(out), *COMMON]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return build_assets(tmp_path_factory.mktemp("assets"))


def _selected_runs(items) -> list[tuple[str, str]]:
    """The (recipe, stage) runs the selected tests of this module read, DDP references first."""
    wanted = set()
    for item in items:
        if item.path != Path(__file__).resolve():
            continue
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if item.name.startswith("test_recipe_"):
            wanted.add((params["recipe"], "ddp"))
        if "stage" in params:
            wanted.add((params["recipe"], params["stage"]))
        if item.name.startswith("test_clm_resumed"):
            wanted.add(("clm", "zero2"))
    return sorted(wanted, key=lambda run: (run[1] != "ddp", run))


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, assets):
    """Each (recipe, stage) launched once per module. The runs the selected tests need start together
    on first use, two launches at a time: a launch alone leaves a core idle much of the time (start-up,
    tokenizing, the launcher's own import), two keep both busy."""
    root = tmp_path_factory.mktemp("runs")

    def run(key: tuple[str, str]) -> tuple[dict, Path]:
        recipe, stage = key
        script, args, _ = RECIPES[recipe]
        out = root / f"{recipe}_{stage}"
        return launch(STAGES[stage](root), script, out, args(assets), root), out

    get = two_at_a_time(_selected_runs(request.session.items), run, kept=(AssertionError,))  # a failed launch
    return lambda recipe, stage: get((recipe, stage))  # fails only the tests that read it


def _close(got: float, want: float) -> bool:
    return got == pytest.approx(want, rel=REL, abs=1e-6)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_reports_every_field_and_saves_a_model_from_pretrained_loads(runs, recipe):
    results, out = runs(recipe, "ddp")
    assert RESULT_FIELDS <= results.keys()
    assert results["distributed_type"] == "MULTI_CPU" and results["zero_stage"] == 0
    assert results["num_processes"] == 2 and results["mixed_precision"] == "no"
    assert results["peak_gpu_memory_gib"] is None  # CPU run: no GPU to measure
    assert len(results["epochs"]) == 2 and results["completed_steps"] > 0
    metrics = RECIPES[recipe][2]
    for epoch in results["epochs"]:
        assert EPOCH_FIELDS | set(metrics) <= epoch.keys()
        assert epoch["train_time_s"] > 0 and epoch["eval_time_s"] > 0
    assert results["largest_batch"][0] == results["per_device_train_batch_size"]
    auto = {"clm": transformers.AutoModelForCausalLM, "cls": transformers.AutoModelForSequenceClassification,
            "seq2seq": transformers.AutoModelForSeq2SeqLM}[recipe]
    model = auto.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) > 0
    transformers.AutoTokenizer.from_pretrained(out)
    if recipe == "cls":
        assert model.config.num_labels == 2  # the 3-label head was replaced (--ignore_mismatched_sizes)
    if recipe == "seq2seq":
        assert results["eval_samples"] == 10  # gather_for_metrics dropped the padding samples


@pytest.mark.parametrize("recipe,stage", [
    ("clm", "zero2"), ("clm", "zero3"), ("clm", "zero3_offload"),
    ("cls", "zero2"),
    ("seq2seq", "zero2"), ("seq2seq", "zero3_offload")])
def test_recipe_under_zero_matches_ddp_losses_and_metrics(runs, recipe, stage):
    reference, _ = runs(recipe, "ddp")
    results, _ = runs(recipe, stage)
    assert results["distributed_type"] == "DEEPSPEED"
    assert results["zero_stage"] == {"zero2": 2, "zero3": 3, "zero3_offload": 3}[stage]
    assert results["completed_steps"] == reference["completed_steps"]
    for got, want in zip(results["epochs"], reference["epochs"], strict=True):
        assert _close(got["train_loss"], want["train_loss"]), (got, want)
        for key in RECIPES[recipe][2]:
            assert _close(got[key], want[key]), (key, got, want)


def test_clm_resumed_from_a_step_checkpoint_ends_where_the_uninterrupted_run_ends(runs, assets, tmp_path):
    reference, out = runs("clm", "zero2")
    script, args, _ = RECIPES["clm"]
    resumed = launch(STAGES["zero2"](tmp_path), script, tmp_path / "resumed",
                     [*args(assets), "--resume_from_checkpoint", out / "step_4", "--with_tracking",
                      "--report_to", "jsonl"], tmp_path)
    assert resumed["completed_steps"] == reference["completed_steps"]
    assert _close(resumed["perplexity"], reference["perplexity"])
    assert _close(resumed["epochs"][-1]["train_loss"], reference["epochs"][-1]["train_loss"])
    assert (tmp_path / "resumed" / "clm_no_trainer" / "metrics.jsonl").exists()

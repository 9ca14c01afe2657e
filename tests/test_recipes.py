"""The three recipes in examples/ through the real CLI: `zerofit launch --cpu --num_processes 2`.

Each recipe runs a few steps under DDP (zerofit YAML), ZeRO-2 (Accelerate YAML) and ZeRO-3 with CPU
offload of optimizer and parameters (DeepSpeed JSON; plain ZeRO-3 too for the causal LM),
on the fixtures in tests/fixtures/data with tiny
models built here from configs and a word-level tokenizer trained on those fixtures (no downloads).
In fp32 the stages compute the same thing and differ only in the order of floating-point sums
(reduce-scatter vs all-reduce), so losses and metrics must agree to 1e-4 relative: that is the seed's
"no drop in accuracy", checked exactly rather than statistically.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CONFIGS = EXAMPLES / "configs"
DATA = ROOT / "tests" / "fixtures" / "data"
REL = 1e-4  # fp32 on CPU: only the summation order differs between stages

RESULT_FIELDS = {"task", "metric", "distributed_type", "zero_stage", "offload_optimizer", "offload_param",
                 "mixed_precision", "num_processes", "per_device_train_batch_size", "per_device_eval_batch_size",
                 "gradient_accumulation_steps", "total_train_batch_size", "epochs", "completed_steps",
                 "largest_batch", "train_time_per_epoch_s", "eval_time_per_epoch_s", "peak_gpu_memory_gib"}
EPOCH_FIELDS = {"epoch", "train_time_s", "eval_time_s", "train_loss"}


# --- tiny assets: tokenizer and models ----------------------------------------------------------
def _fixture_texts() -> list[str]:
    texts = [(DATA / name).read_text(encoding="utf-8") for name in ("text_train.txt", "text_validation.txt")]
    for name in ("mrpc_validation.json", "conversations_train.json", "conversations_validation.json"):
        for line in (DATA / name).read_text(encoding="utf-8").splitlines():
            texts.extend(str(v) for v in json.loads(line).values())
    texts.append((DATA / "mrpc_train.csv").read_text(encoding="utf-8"))
    return texts


def _tokenizer(special: list[str], template: tuple[str, str] | None, max_length: int):
    """A word-level tokenizer over the fixtures' words, optionally wrapping inputs in special tokens."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    tok.train_from_iterator(_fixture_texts(), trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", *special]))
    if template is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=template[0], pair=template[1], special_tokens=[(t, tok.token_to_id(t)) for t in special])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                                model_max_length=max_length)


def build_assets(root: Path) -> dict[str, Path]:
    """Save a tiny GPT-2 config, BERT classifier and BART chatbot (each with its tokenizer) under root."""
    import torch

    torch.manual_seed(0)
    out = {}
    gpt2_tok = _tokenizer(["<eos>"], None, 64)
    gpt2_tok.eos_token = "<eos>"
    out["gpt2"] = root / "gpt2"
    gpt2_tok.save_pretrained(out["gpt2"])
    transformers.GPT2Config(vocab_size=len(gpt2_tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                            eos_token_id=gpt2_tok.eos_token_id, bos_token_id=gpt2_tok.eos_token_id,
                            ).save_pretrained(out["gpt2"])

    bert_tok = _tokenizer(["[CLS]", "[SEP]"], ("[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1"), 128)
    bert_tok.cls_token, bert_tok.sep_token = "[CLS]", "[SEP]"
    # three labels, as an MNLI checkpoint has: the recipe's --ignore_mismatched_sizes swaps the head for two
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=len(bert_tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=128, num_labels=3, pad_token_id=bert_tok.pad_token_id))
    out["bert"] = root / "bert"
    bert.save_pretrained(out["bert"])
    bert_tok.save_pretrained(out["bert"])

    bart_tok = _tokenizer(["<s>", "</s>"], ("<s> $A </s>", "<s> $A </s> </s> $B </s>"), 64)
    bart_tok.bos_token, bart_tok.eos_token = "<s>", "</s>"
    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=len(bart_tok), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=bart_tok.pad_token_id, bos_token_id=bart_tok.bos_token_id, eos_token_id=bart_tok.eos_token_id,
        decoder_start_token_id=bart_tok.eos_token_id, forced_eos_token_id=bart_tok.eos_token_id))
    bart.generation_config.max_length = 64  # BART's default (20) would cut the recipe's beams short
    out["bart"] = root / "bart"
    bart.save_pretrained(out["bart"])
    bart_tok.save_pretrained(out["bart"])
    return out


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
RECIPES = {
    "clm": ("run_clm_no_trainer.py", lambda a: [
        "--config_name", a["gpt2"], "--tokenizer_name", a["gpt2"], "--train_file", DATA / "text_train.txt",
        "--validation_file", DATA / "text_validation.txt", "--block_size", "16", "--per_device_train_batch_size", "4",
        "--learning_rate", "3e-3", "--num_warmup_steps", "2", "--checkpointing_steps", "4"],
        ["perplexity", "eval_loss"]),
    "cls": ("run_cls_no_trainer.py", lambda a: [
        "--model_name_or_path", a["bert"], "--ignore_mismatched_sizes", "--train_file", DATA / "mrpc_train.json",
        "--validation_file", DATA / "mrpc_validation.json", "--max_length", "64", "--per_device_train_batch_size", "8",
        "--learning_rate", "3e-3", "--weight_decay", "0.01"], ["accuracy", "f1"]),
    "seq2seq": ("run_seq2seq_no_trainer.py", lambda a: [
        "--model_name_or_path", a["bart"], "--train_file", DATA / "conversations_train.json",
        "--validation_file", DATA / "conversations_validation.json", "--source_prefix", "chatbot: ",
        "--max_source_length", "32", "--max_target_length", "24", "--val_max_target_length", "16",
        "--val_min_target_length", "3", "--n_val", "10", "--num_beams", "3", "--per_device_train_batch_size", "8",
        "--learning_rate", "3e-3"], ["bleu", "gen_len", "eval_samples"]),
}


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
def assets(tmp_path_factory) -> dict[str, Path]:
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
    done: dict[tuple[str, str], tuple[dict, Path]] = {}

    def run(recipe: str, stage: str) -> tuple[dict, Path]:
        script, args, _ = RECIPES[recipe]
        out = root / f"{recipe}_{stage}"
        return launch(STAGES[stage](root), script, out, args(assets), root), out

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(run, *key) for key in _selected_runs(request.session.items)}
    for key, future in futures.items():
        try:
            done[key] = future.result()
        except AssertionError as e:  # a failed launch fails only the tests that read it
            done[key] = e

    def get(recipe: str, stage: str) -> tuple[dict, Path]:
        if (recipe, stage) not in done:
            done[recipe, stage] = run(recipe, stage)
        if isinstance(done[recipe, stage], AssertionError):
            raise done[recipe, stage]
        return done[recipe, stage]

    return get


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


if __name__ == "__main__":  # build the assets for running the recipes by hand: python tests/test_recipes.py DIR
    print(build_assets(Path(sys.argv[1])))

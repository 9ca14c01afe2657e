"""Reload what the runs of tools/real_scripts/run_all.sh saved, and print one table row per run.

    python tools/real_scripts/check_outputs.py OUT_DIR [--baseline DDP_OUT_DIR]

For each row of OUT_DIR/results.tsv (script, config, exit code, seconds, output dir, log):
  - the losses and gradient norms the Trainer logged (trainer_state.json in the output dir or its last checkpoint);
  - the reload check: the saved model loads with AutoModelFor*.from_pretrained (for the PEFT script:
    PeftModel.from_pretrained over the fixture model) with no missing, unexpected or mismatched key,
    has exactly the fixture model's keys and shapes, every tensor non-empty and finite, and differs
    from the fixture (training reached the saved file);
  - with --baseline, the largest loss, gradient-norm and weight differences from the same script's DDP run.
Exits 1 if any run failed or any check did not pass.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

KIND = {"glue": "classifier", "clm": "lm", "translation": "seq2seq", "sft": "lm", "dpo": "lm", "corda": "lm",
        "reward": "reward", "kto": "lm", "rloo": "lm", "grpo": "lm"}
FIXTURE = {"classifier": "tiny-bert", "lm": "tiny-llama", "seq2seq": "tiny-bart", "reward": "tiny-llama"}
# TRL's RewardTrainer puts a one-output score head on the causal LM's body
EXTRA_KWARGS = {"reward": {"num_labels": 1}}


def adapter_dir(run: Path) -> Path | None:
    """Where a PEFT run saved its adapter: corda_finetuning.py in ft/, TRL's --use_peft in the output dir."""
    return next((d for d in (run / "ft", run) if (d / "adapter_config.json").is_file()), None)


def logged_losses(run: Path, key: str = "loss") -> tuple[list[float], float | None]:
    """Per-step `key` values (loss, grad_norm) and the final train_loss, from the newest trainer_state.json."""
    states = [run / "trainer_state.json"] if (run / "trainer_state.json").is_file() else []
    states += sorted(run.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    if not states:
        return [], None
    history = json.loads(states[0 if states[0].parent == run else -1].read_text())["log_history"]
    steps = [h[key] for h in history if key in h]
    final = next((h["train_loss"] for h in history if "train_loss" in h), None)
    return steps, final


def _load(kind: str, run: Path, fixtures: Path):
    """The saved model, its loading info and the fixture model it started from, all on CPU in fp32."""
    import transformers

    classifier = transformers.AutoModelForSequenceClassification
    auto = {"classifier": classifier, "lm": transformers.AutoModelForCausalLM,
            "seq2seq": transformers.AutoModelForSeq2SeqLM, "reward": classifier}[kind]
    base = auto.from_pretrained(fixtures / FIXTURE[kind], **EXTRA_KWARGS.get(kind, {}))
    adapter = adapter_dir(run)
    if adapter is None:
        model, info = auto.from_pretrained(run, output_loading_info=True)
        return model.state_dict(), info, base.state_dict()
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(adapter / "adapter_model.safetensors")
    # what the same LoraConfig puts on the fixture model: the keys and shapes to expect
    fresh = get_peft_model(auto.from_pretrained(fixtures / FIXTURE[kind]), LoraConfig.from_pretrained(adapter))
    start = get_peft_model_state_dict(fresh)
    # only lora_B has a known start (zero); lora_A's is random, so it is held to its shape alone
    start = {k: saved[k] if "lora_B" not in k and k in saved and saved[k].shape == v.shape else v
             for k, v in start.items()}
    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(base, adapter))
    differ = [k for k in saved if k in loaded and not loaded[k].equal(saved[k])]
    info = {"missing_keys": sorted(set(start) - set(loaded)), "unexpected_keys": [], "mismatched_keys": differ}
    return saved, info, start


def reload_check(kind: str, run: Path, fixtures: Path) -> tuple[bool, str, dict]:
    import torch

    try:
        saved, info, start = _load(kind, run, fixtures)
    except Exception as e:  # a file that does not load is the finding; report it in the row
        return False, f"load failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", {}
    problems = [f"{key}: {info[key]}" for key in ("missing_keys", "unexpected_keys", "mismatched_keys")
                if info.get(key)]
    if set(saved) != set(start):
        problems.append(f"keys differ from the fixture: {sorted(set(saved) ^ set(start))[:4]}")
    for name, tensor in saved.items():
        if tensor.numel() == 0:
            problems.append(f"{name} is empty")
        elif not torch.isfinite(tensor.float()).all():
            problems.append(f"{name} has non-finite values")
        elif name in start and tensor.shape != start[name].shape:
            problems.append(f"{name} shape {tuple(tensor.shape)} != {tuple(start[name].shape)}")
    if problems:
        return False, "; ".join(problems[:3]), saved
    moved = max((saved[k].float() - start[k].float()).abs().max().item() for k in saved)
    if moved == 0:
        return False, "identical to the fixture: the trained weights did not reach the file", saved
    return True, f"{len(saved)} tensors, max|w-w0| {moved:.2e}", saved


def _runs(out: Path) -> list[dict]:
    with (out / "results.tsv").open() as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    latest = {(r["script"], r["config"]): r for r in rows}  # a re-run replaces the earlier row
    return list(latest.values())


def _tag(config: str) -> str:
    """The variant a run_all.sh TAG names (config "zero2+peft" has tag "peft")."""
    return config.partition("+")[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--baseline", type=Path, help="OUT_DIR of a LAUNCHER=ddp run of run_all.sh")
    args = parser.parse_args(argv)
    import transformers

    transformers.utils.logging.set_verbosity_error()  # the table alone: no loading bars or notices
    transformers.utils.logging.disable_progress_bar()
    fixtures = args.out / "fixtures"
    base_rows = {(r["script"], _tag(r["config"])): r for r in _runs(args.baseline)} if args.baseline else {}

    header = ["script", "config", "run", "steps", "first loss", "last loss", "train_loss", "Δloss vs DDP",
              "Δgrad_norm vs DDP", "max|Δw| vs DDP", "reload", "s"]
    rows, ok_all = [], True
    for r in _runs(args.out):
        run, kind = Path(r["output_dir"]), KIND[r["script"]]
        steps, final = logged_losses(run)
        ran = r["rc"] == "0"
        loaded, note, weights = reload_check(kind, run, fixtures) if ran else (False, "not run", {})
        d_loss = d_norm = d_w = "-"
        baseline = base_rows.get((r["script"], _tag(r["config"])))
        if baseline is not None and ran:
            b_run = Path(baseline["output_dir"])
            b_steps, _ = logged_losses(b_run)
            if steps and len(b_steps) == len(steps):
                d_loss = f"{max(abs(a - b) for a, b in zip(steps, b_steps)):.1e}"
            norms, b_norms = logged_losses(run, "grad_norm")[0], logged_losses(b_run, "grad_norm")[0]
            if norms and len(b_norms) == len(norms):
                d_norm = f"{max(abs(a - b) for a, b in zip(norms, b_norms)):.1e}"
            _, _, b_weights = reload_check(kind, b_run, fixtures)
            if weights and b_weights and set(weights) == set(b_weights):
                d_w = f"{max((weights[k].float() - b_weights[k].float()).abs().max().item() for k in weights):.1e}"
        ok = ran and loaded
        ok_all &= ok
        rows.append([r["script"], r["config"], "ok" if ok else ("FAIL" if ran else f"FAIL rc={r['rc']}"),
                     str(len(steps)), f"{steps[0]:.4f}" if steps else "-", f"{steps[-1]:.4f}" if steps else "-",
                     f"{final:.4f}" if final is not None else "-", d_loss, d_norm, d_w, note, r["seconds"]])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for line in [header, ["-" * w for w in widths], *rows]:
        print(" | ".join(str(x).ljust(w) for x, w in zip(line, widths)))
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())

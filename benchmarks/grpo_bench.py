"""GRPO with TRL's own `scripts/grpo.py`, on zerofit or on DeepSpeed, with rollout and training timed apart.

    python benchmarks/grpo_bench.py --make_assets DIR [--hidden 2048 --layers 24 ...]   (model, tokenizer, prompts)
    python benchmarks/grpo_bench.py --write_script FILE               (TRL's grpo.py, one import changed)
    GRPO_BENCH_TRAINER=zerofit GRPO_BENCH_RESULT=r.json zerofit launch --config_file ds.json FILE ...
    GRPO_BENCH_TRAINER=trl GRPO_BENCH_RESULT=r.json accelerate launch --config_file ds.yaml FILE ...

`--make_assets` writes what a user downloads, offline: `DIR/model` (a random-init Llama-shaped causal LM in bf16
safetensors with a word-level tokenizer trained on examples/data, the model's vocabulary exactly the tokenizer's),
`DIR/prompts/train.jsonl` (short prompts cut from the shipped texts; `--dataset_name DIR/prompts` loads it) and
`DIR/info.json` (the parameter count: ZeRO-3 leaves each rank's `numel()` a shard).

`--write_script` copies the installed TRL's `trl/scripts/grpo.py` and changes one line: `GRPOTrainer` comes from
this module instead of `trl`. This module's `GRPOTrainer` is the class the run benchmarks (`GRPO_BENCH_TRAINER`:
`zerofit` = `zerofit.integrations.trl.GRPOTrainer`, `trl` = TRL's own, which DeepSpeed runs under Accelerate) with
timers around TRL's `_generate` and `_generate_and_score_completions` and a step clock; nothing else changes. Both
rows run the same copied script, so the timers cost the same on each.

Per optimizer step: `step` is the wall time between consecutive `on_step_end` calls (CUDA synchronised);
`generate` the time in `_generate` (the rollout's `model.generate`, with TRL's ZeRO-3 weight gather under
DeepSpeed); `train` = step - generate (rewards, log-prob passes, forward, backward, optimizer step). Medians over
the steps after `GRPO_BENCH_WARMUP` (default 2). Rank 0 writes the record to `GRPO_BENCH_RESULT` after
`train()` and prints it as one line starting `grpo_bench:`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import time
from pathlib import Path

import records
import step_clock
import torch
import transformers

IMPORTED_AT = time.perf_counter()
VERSIONS = ("torch", "transformers", "accelerate", "trl", "datasets", "deepspeed", "zerofit")
DATA = Path(__file__).resolve().parent.parent / "examples" / "data"
TRL_IMPORT = "    from trl import GRPOTrainer, get_dataset, get_peft_config, get_quantization_config\n"
BENCH_IMPORT = ("    from trl import get_dataset, get_peft_config, get_quantization_config\n"
                "    from grpo_bench import GRPOTrainer  # the one changed line (benchmarks/grpo_bench.py)\n")


def distinct_words(completions, **kwargs) -> list[float]:
    """A rule-based reward (no reward model): the share of distinct words in each completion."""
    out = []
    for c in completions:
        words = c.split() if isinstance(c, str) else str(c).split()
        out.append(len(set(words)) / len(words) if words else 0.0)
    return out


# ---- assets -------------------------------------------------------------------------------------------------


def _texts() -> list[str]:
    texts = [(DATA / name).read_text(encoding="utf-8") for name in ("text_train.txt", "text_validation.txt")]
    for name in ("conversations_train.json", "conversations_validation.json", "mrpc_train.json"):
        for line in (DATA / name).read_text(encoding="utf-8").splitlines():
            texts.extend(str(v) for v in json.loads(line).values() if isinstance(v, str))
    return texts


def _prompts(texts: list[str], n: int) -> list[str]:
    """`n` short prompts: the first 6-10 words of each sentence of the shipped texts (cycled if too few)."""
    sentences = [s.strip() for t in texts for s in re.split(r"(?<=[.!?])\s+", t) if len(s.split()) >= 6]
    return [" ".join(sentences[i % len(sentences)].split()[: 6 + i % 5]) for i in range(n)]


def _tokenizer():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    tok.train_from_iterator(_texts(), trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<eos>"]))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>", bos_token="<eos>",
        model_max_length=2048, padding_side="left")


def make_assets(args: argparse.Namespace) -> None:
    """Model (random init on the GPU when there is one: seconds), tokenizer, prompts, info.json."""
    root = Path(args.make_assets)
    tok = _tokenizer()
    config = transformers.LlamaConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        intermediate_size=args.intermediate, vocab_size=len(tok), max_position_embeddings=2048,
        tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(root / "model", safe_serialization=True)
    tok.save_pretrained(root / "model")
    (root / "prompts").mkdir(parents=True, exist_ok=True)
    with open(root / "prompts" / "train.jsonl", "w", encoding="utf-8") as f:
        for prompt in _prompts(_texts(), args.prompts):
            f.write(json.dumps({"prompt": prompt}) + "\n")
    n = sum(p.numel() for p in model.parameters())
    info = {"parameters": n, "vocab_size": len(tok), "prompts": args.prompts}
    (root / "info.json").write_text(json.dumps(info))
    print(f"grpo_bench: wrote {root}: {n / 1e6:.1f} M parameters (bf16 safetensors), vocabulary {len(tok)}, "
          f"{args.prompts} prompts")


def write_script(path: str) -> None:
    """TRL's installed grpo.py with the GRPOTrainer import taken from this module; an error if TRL changed it."""
    spec = importlib.util.find_spec("trl.scripts.grpo")
    if spec is None or spec.origin is None:
        raise SystemExit("grpo_bench: trl.scripts.grpo is not installed: install trl (../shared/wheels) first")
    text = Path(spec.origin).read_text(encoding="utf-8")
    if text.count(TRL_IMPORT) != 1:
        raise SystemExit(f"grpo_bench: {spec.origin} no longer imports GRPOTrainer as {TRL_IMPORT.strip()!r}: "
                         "update TRL_IMPORT in benchmarks/grpo_bench.py")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text.replace(TRL_IMPORT, BENCH_IMPORT), encoding="utf-8")
    print(f"grpo_bench: {path} = {spec.origin} with GRPOTrainer imported from grpo_bench")


# ---- the timed trainer --------------------------------------------------------------------------------------


class StepClock(step_clock.StepClock):
    """Step marks (train start, each step's end) and named spans; GPU peaks overall and while generating."""

    def __init__(self):
        super().__init__()
        self.spans: dict[str, list[tuple[float, float]]] = {}
        self.peak = 0.0
        self.peak_generate = 0.0

    @contextlib.contextmanager
    def span(self, name: str):
        gpu = torch.cuda.is_available()
        step_clock.sync()
        if gpu and name == "generate":  # a peak of its own: fold the running one in, then restart it
            self.peak = max(self.peak, torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            yield
        finally:
            step_clock.sync()
            self.spans.setdefault(name, []).append((start, time.perf_counter()))
            if gpu and name == "generate":
                self.peak_generate = max(self.peak_generate, torch.cuda.max_memory_allocated() / 2**30)

    def gpu_peak(self) -> float | None:
        if not torch.cuda.is_available():
            return None
        return max(self.peak, torch.cuda.max_memory_allocated() / 2**30)

    def per_step(self, name: str) -> list[float]:
        """Seconds spent in span `name` within each step (between consecutive marks)."""
        out = []
        for a, b in zip(self.marks, self.marks[1:]):
            out.append(sum(e - s for s, e in self.spans.get(name, []) if a <= s < b))
        return out


def __getattr__(name: str):
    """`GRPOTrainer` is built on first import from this module (the copied grpo.py's one changed line), so
    `--make_assets` and `--write_script` need neither TRL nor zerofit's TRL integration imported."""
    if name != "GRPOTrainer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    which = os.environ.get("GRPO_BENCH_TRAINER", "trl")
    if which == "zerofit":
        from zerofit.integrations.trl import GRPOTrainer as base
    elif which == "trl":
        from trl import GRPOTrainer as base
    else:
        raise SystemExit(f"GRPO_BENCH_TRAINER={which!r}: set it to zerofit or trl")
    globals()[name] = trainer = _timed(base)
    return trainer


def _timed(base: type) -> type:
    """`base` with the timers of the module doc; its training is the base class's."""

    class GRPOTrainer(base):
        __doc__ = f"{base.__module__}.{base.__qualname__} with rollout and step timers (benchmarks/grpo_bench.py)."

        def __init__(self, *args, **kwargs):
            init_start = time.perf_counter()
            super().__init__(*args, **kwargs)
            self.bench_clock = StepClock()
            self.add_callback(self.bench_clock)
            # the model's load from disk is included: grpo.py hands GRPOTrainer the model's path
            self.bench_init_s = time.perf_counter() - init_start

        def _generate(self, *args, **kwargs):
            with self.bench_clock.span("generate"):
                return super()._generate(*args, **kwargs)

        def _generate_and_score_completions(self, *args, **kwargs):
            with self.bench_clock.span("rollout"):
                return super()._generate_and_score_completions(*args, **kwargs)

        def train(self, *args, **kwargs):
            result = super().train(*args, **kwargs)
            if self.is_world_process_zero():
                write_record(self, f"{base.__module__}.{base.__qualname__}")
            return result

    return GRPOTrainer


def write_record(trainer, base_class: str) -> None:
    """The run's record: to `GRPO_BENCH_RESULT` (when set) and one `grpo_bench:` line on stdout."""
    clock, args = trainer.bench_clock, trainer.args
    warmup = int(os.environ.get("GRPO_BENCH_WARMUP", "2"))
    step_s, gen_s, rollout_s = clock.step_s, clock.per_step("generate"), clock.per_step("rollout")
    train_s = [s - g for s, g in zip(step_s, gen_s)]
    logs = trainer.state.log_history

    def logged(key: str) -> list[float]:
        return [e[key] for e in logs if key in e]

    def median(xs: list[float]) -> float | None:
        return records.median_after(xs, warmup)

    losses, rewards = logged("loss"), logged("reward")
    model_path = trainer.model.config._name_or_path
    record = {
        "trainer": os.environ.get("GRPO_BENCH_TRAINER", "trl"), "base_class": base_class,
        "model": model_path, "parameters": _info(model_path).get("parameters"),
        "model_config": {k: getattr(trainer.model.config, k, None) for k in
                         ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                          "vocab_size", "_attn_implementation")},
        "world_size": args.world_size, "per_device_batch": args.per_device_train_batch_size,
        "num_generations": args.num_generations, "max_completion_length": args.max_completion_length,
        "beta": args.beta, "gradient_checkpointing": args.gradient_checkpointing, "bf16": args.bf16,
        "ds3_gather_for_generation": args.ds3_gather_for_generation, "steps": args.max_steps, "warmup": warmup,
        "median_step_s": median(step_s), "median_generate_s": median(gen_s), "median_train_s": median(train_s),
        "median_rollout_s": median(rollout_s),
        "step_s": step_s, "generate_s": gen_s, "train_s": train_s, "rollout_s": rollout_s,
        "completion_mean_length": logged("completions/mean_length"),
        "losses": losses, "rewards": rewards, "grad_norms": logged("grad_norm"),
        "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        "first_reward": rewards[0] if rewards else None, "final_reward": rewards[-1] if rewards else None,
        "init_s": trainer.bench_init_s, "setup_s": clock.marks[0] - IMPORTED_AT if clock.marks else None,
        "gpu_peak_gib": clock.gpu_peak(), "gpu_peak_generate_gib": clock.peak_generate or None,
        "gpu_reserved_peak_gib": records.gpu_reserved_peak_gib(), "host_rss_peak_gib": records.host_rss_peak_gib(),
        "resolved_config": resolved_config(trainer), "versions": records.versions(VERSIONS),
        "hardware": records.hardware(),
    }
    records.emit(record, os.environ.get("GRPO_BENCH_RESULT"), "grpo_bench")


def resolved_config(trainer):
    """zerofit's completed RunConfig, or the DeepSpeed config with Trainer's "auto" values filled in."""
    if os.environ.get("GRPO_BENCH_TRAINER") == "zerofit":
        from zerofit.config.schema import to_dict

        return to_dict(trainer.accelerator.config)
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return records.strict_json(getattr(plugin, "deepspeed_config", None))


def _info(model_path: str) -> dict:
    """DIR/info.json next to DIR/model, written by --make_assets ({} for another model)."""
    try:
        return json.loads((Path(model_path).parent / "info.json").read_text())
    except (OSError, ValueError):
        return {}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write_script", metavar="FILE", help="write TRL's grpo.py with the import changed to FILE")
    p.add_argument("--make_assets", metavar="DIR", help="write DIR/model, DIR/prompts/train.jsonl, DIR/info.json")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=5504)
    p.add_argument("--prompts", type=int, default=256, help="rows of prompts/train.jsonl")
    p.add_argument("--cpu", action="store_true", help="initialise the model on the CPU")
    args = p.parse_args(argv)
    if not (args.write_script or args.make_assets):
        p.error("nothing to do: give --write_script FILE and/or --make_assets DIR")
    if args.write_script:
        write_script(args.write_script)
    if args.make_assets:
        make_assets(args)


if __name__ == "__main__":
    main()

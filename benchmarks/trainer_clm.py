"""A causal-LM fine-tune with transformers' Trainer, on zerofit or on DeepSpeed, timed step by step.

    python benchmarks/trainer_clm.py --make_checkpoint DIR [--hidden 2048 --layers 24 --heads 16 ...]
    zerofit launch --config_file ds.json benchmarks/trainer_clm.py --trainer zerofit --model DIR --result r.json
    torchrun --nproc_per_node 1 benchmarks/trainer_clm.py --trainer hf --deepspeed ds.json --model DIR --result r.json

What a user's script does: TrainingArguments first (so DeepSpeed's ZeRO-3 loads the weights partitioned),
then `AutoModelForCausalLM.from_pretrained(DIR, dtype=bfloat16)` from safetensors on disk, a fixed
synthetic token dataset (`--seq` tokens a row, labels = inputs), and `Trainer.train()`. The only line that
differs between the two runs is the Trainer import (`--trainer`); DeepSpeed gets `--deepspeed FILE`, zerofit
gets the same FILE from its launcher. Step time: the wall time between consecutive `on_step_end` calls
(CUDA synchronised there), the median over the steps after `--warmup`. Rank 0 writes one JSON record
(times, losses, GPU and host peaks, the config as the engine resolved it, versions, hardware) to
`--result` and prints it as one line starting `trainer_clm:`.
"""

from __future__ import annotations

import argparse
import os
import time

import records
import step_clock
import torch
import transformers

VERSIONS = ("torch", "transformers", "accelerate", "deepspeed", "zerofit")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer", choices=("zerofit", "hf"), default="zerofit",
                   help="zerofit.integrations.transformers.Trainer or transformers.Trainer")
    p.add_argument("--model", help="a checkpoint folder written by --make_checkpoint (or any causal LM)")
    p.add_argument("--deepspeed", help="DeepSpeed JSON for transformers' Trainer (--trainer hf only)")
    p.add_argument("--steps", type=int, default=12, help="max_steps")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    p.add_argument("--seq", type=int, default=512, help="tokens per row")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in fp32 (the CPU check)")
    p.add_argument("--cpu", action="store_true", help="TrainingArguments(use_cpu=True)")
    p.add_argument("--output_dir", default=None, help="Trainer's output_dir (default: a folder under /tmp)")
    p.add_argument("--result", default=None, help="where rank 0 writes the JSON record")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    shape = p.add_argument_group("--make_checkpoint: a random-init Llama-shaped model saved in bf16 safetensors")
    shape.add_argument("--make_checkpoint", metavar="DIR", help="write the checkpoint to DIR and exit")
    shape.add_argument("--hidden", type=int, default=2048)
    shape.add_argument("--layers", type=int, default=24)
    shape.add_argument("--heads", type=int, default=16)
    shape.add_argument("--intermediate", type=int, default=5504)
    shape.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args(argv)
    if args.make_checkpoint is None and args.model is None:
        p.error("--model DIR is required (write one with --make_checkpoint DIR)")
    if args.deepspeed and args.trainer != "hf":
        p.error("--deepspeed hands the run to DeepSpeed: use it with --trainer hf; zerofit takes the same file "
                "from `zerofit launch --config_file`")
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}: raise --steps")
    return args


def make_checkpoint(args: argparse.Namespace) -> None:
    """A pretrained-looking checkpoint: random init (on the GPU when there is one: seconds, not minutes),
    bf16 safetensors on disk, as `from_pretrained` users have them."""
    config = transformers.LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads, intermediate_size=args.intermediate,
                                      vocab_size=args.vocab, max_position_embeddings=max(2048, args.seq),
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    with torch.device(device):  # built in bf16: an fp32 build of an 18 B model alone would fill an 80 GB GPU
        model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.make_checkpoint, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(f"trainer_clm: wrote {args.make_checkpoint}: {n / 1e6:.1f} M parameters, bf16 safetensors")


class TokenRows(torch.utils.data.Dataset):
    """`rows` fixed rows of `seq` random token ids (the same on every rank and every run)."""

    def __init__(self, rows: int, seq: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (rows, seq), generator=g)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepClock(step_clock.StepClock):
    """The step marks, and `peak_train`: the GPU peak from training's start (loading and setup left out)."""

    def __init__(self):
        super().__init__()
        self.peak_train: float | None = None

    def on_train_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            self.peak_train = torch.cuda.max_memory_allocated() / 2**30


def trainer_class(name: str) -> type:
    if name == "zerofit":
        from zerofit.integrations.transformers import Trainer
    else:
        from transformers import Trainer
    return Trainer


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.make_checkpoint:
        return make_checkpoint(args)
    started = time.perf_counter()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    output_dir = args.output_dir or f"/tmp/trainer_clm_{args.trainer}_{os.getpid()}"
    # Before the model, as run_clm.py does: with --deepspeed and ZeRO-3 this makes from_pretrained load
    # the weights partitioned (zero.Init).
    training_args = transformers.TrainingArguments(
        output_dir=output_dir, bf16=args.bf16, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to=[], deepspeed=args.deepspeed, use_cpu=args.cpu, seed=0, disable_tqdm=True)
    load_start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    load_s = time.perf_counter() - load_start
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 leaves numel() 0
    data = TokenRows(args.batch * world * args.steps, args.seq, model.config.vocab_size)
    clock = StepClock()
    trainer = trainer_class(args.trainer)(model=model, args=training_args, train_dataset=data, callbacks=[clock])
    metrics = trainer.train().metrics
    if not trainer.is_world_process_zero():
        return
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    median = records.median_after(clock.step_s, args.warmup)
    record = {
        "trainer": args.trainer, "deepspeed_arg": args.deepspeed, "model": args.model, "parameters": params,
        "model_config": {k: getattr(model.config, k, None) for k in
                         ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                          "vocab_size", "_attn_implementation")},
        "world_size": world, "per_device_batch": args.batch, "seq": args.seq, "steps": args.steps,
        "warmup": args.warmup, "bf16": args.bf16,
        "median_step_s": median, "tokens_per_s": args.batch * world * args.seq / median, "step_s": clock.step_s,
        "losses": losses, "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        "load_s": load_s, "setup_s": clock.marks[0] - started, "train_runtime_s": metrics.get("train_runtime"),
        "gpu_peak_gib": records.gpu_peak_gib(), "gpu_peak_train_gib": clock.peak_train,
        "gpu_reserved_peak_gib": records.gpu_reserved_peak_gib(), "host_rss_peak_gib": records.host_rss_peak_gib(),
        "resolved_config": resolved_config(trainer, args),
        "versions": records.versions(VERSIONS), "hardware": records.hardware(),
    }
    records.emit(record, args.result, "trainer_clm")


def resolved_config(trainer, args: argparse.Namespace):
    """The config the engine ran: zerofit's completed RunConfig, or the DeepSpeed JSON with Trainer's "auto"
    values filled in."""
    if args.trainer == "zerofit":
        from zerofit.config.schema import to_dict

        return to_dict(trainer.accelerator.config)
    hf_config = getattr(trainer.args, "hf_deepspeed_config", None)
    return records.strict_json(getattr(hf_config, "config", None))


if __name__ == "__main__":
    main()

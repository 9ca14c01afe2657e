"""What the three no_trainer recipes share: their common flags, the optimizer/schedule choice, resuming,
checkpointing, timing and the results.json every recipe writes.

The recipes import this file as a sibling (`python examples/run_X.py` puts `examples/` on sys.path),
so each script keeps only what is particular to its task.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import SchedulerType, get_scheduler

from zerofit.checkpoint.resume import latest_complete
from zerofit.logging import get_logger
from zerofit.utils import DummyOptim, DummyScheduler

logger = get_logger(__name__)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The flags every Accelerate no_trainer example takes, with the same names and meanings."""
    add = parser.add_argument
    add("--dataset_name", type=str, default=None, help="dataset name (or local builder path) for load_dataset")
    add("--dataset_config_name", type=str, default=None, help="configuration of the dataset")
    add("--train_file", type=str, default=None, help="a csv, json or txt file with the training data")
    add("--validation_file", type=str, default=None, help="a csv, json or txt file with the validation data")
    add("--model_name_or_path", type=str, default=None, help="pretrained model directory or hub id")
    add("--config_name", type=str, default=None, help="config to train from scratch (random init)")
    add("--tokenizer_name", type=str, default=None, help="tokenizer, if not the model's")
    add("--use_slow_tokenizer", action="store_true", help="use the Python tokenizer instead of the Rust one")
    add("--per_device_train_batch_size", type=int, default=8)
    add("--per_device_eval_batch_size", type=int, default=8)
    add("--learning_rate", type=float, default=5e-5)
    add("--weight_decay", type=float, default=0.0)
    add("--num_train_epochs", type=int, default=3)
    add("--max_train_steps", type=int, default=None, help="overrides --num_train_epochs when given")
    add("--gradient_accumulation_steps", type=int, default=1)
    add("--lr_scheduler_type", type=SchedulerType, default="linear",
        choices=["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"])
    add("--num_warmup_steps", type=int, default=0)
    add("--output_dir", type=str, default=None, help="where checkpoints, the model and results.json go")
    add("--seed", type=int, default=None)
    add("--preprocessing_num_workers", type=int, default=None)
    add("--overwrite_cache", action="store_true")
    add("--trust_remote_code", action="store_true")
    add("--checkpointing_steps", type=str, default=None, help="save state every N steps, or 'epoch'")
    add("--resume_from_checkpoint", type=str, default=None, help="a checkpoint folder, or '' for the latest")
    add("--with_tracking", action="store_true")
    add("--report_to", type=str, default="all")


def setup_logging() -> None:
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        datefmt="%m/%d/%Y %H:%M:%S", level=logging.INFO)


def data_files(args: argparse.Namespace) -> tuple[str, dict[str, str]]:
    """The `load_dataset` builder and data_files for --train_file/--validation_file ('txt' reads as 'text')."""
    files = {}
    if args.train_file is not None:
        files["train"] = args.train_file
    if args.validation_file is not None:
        files["validation"] = args.validation_file
    extensions = {path.rsplit(".", 1)[-1] for path in files.values()}
    if len(extensions) != 1:
        raise ValueError(f"--train_file and --validation_file must have the same extension (got {sorted(extensions)}): "
                         "load_dataset reads both with one builder; convert one of them")
    extension = extensions.pop()
    return ("text" if extension == "txt" else extension), files


def _no_decay(name: str) -> bool:
    # biases and normalisation weights are not decayed, as in every official recipe
    return name.endswith("bias") or "norm" in name.lower() or ".ln_" in name


def optimizer_and_scheduler(accelerator, model: torch.nn.Module, args: argparse.Namespace,
                            num_training_steps: int) -> tuple[Any, Any]:
    """AdamW and a transformers schedule, or the config's own through DummyOptim / DummyScheduler.

    A DeepSpeed-style config that names `optimizer` / `scheduler` builds them itself; the script
    then passes placeholders carrying its lr, weight decay and step counts for the "auto" values.
    """
    groups = [
        {"params": [p for n, p in model.named_parameters() if not _no_decay(n)], "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if _no_decay(n)], "weight_decay": 0.0},
    ]
    plugin = accelerator.state.deepspeed_plugin
    named = plugin.deepspeed_config if plugin is not None else {}
    if "optimizer" in named:
        optimizer = DummyOptim(groups, lr=args.learning_rate, weight_decay=args.weight_decay)
    else:
        optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)
    if "scheduler" in named:
        # counted on the unsharded data, like the torch schedule below; zerofit divides it back
        scheduler = DummyScheduler(optimizer, total_num_steps=num_training_steps * accelerator.num_processes,
                                   warmup_num_steps=args.num_warmup_steps)
    else:
        # the prepared scheduler steps once per process per optimizer step (Accelerate's rule), so
        # the step counts are multiplied by the process count here
        scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                  num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
                                  num_training_steps=num_training_steps * accelerator.num_processes)
    return optimizer, scheduler


def resume(accelerator, args: argparse.Namespace, batches_per_epoch: int) -> tuple[int, int, int]:
    """Load --resume_from_checkpoint; returns (starting_epoch, batches to skip in it, completed_steps).

    `batches_per_epoch` is len(train_dataloader) after prepare(): micro-batches of this rank.
    """
    if args.resume_from_checkpoint is None:
        return 0, 0, 0
    path = args.resume_from_checkpoint
    if not path:  # '' means the newest complete checkpoint: the one --output_dir/latest names
        found = latest_complete(Path(args.output_dir or "."))
        if found is None:
            raise ValueError(f"--resume_from_checkpoint '' found no checkpoint in {args.output_dir} (no 'latest' "
                             "file): pass a checkpoint folder, or drop the flag to start from scratch")
        path = str(found)
    accelerator.print(f"Resumed from checkpoint: {path}")
    accelerator.load_state(path)
    kind, number = os.path.basename(path.rstrip("/")).split("_")
    if kind == "epoch":
        epoch = int(number) + 1
        return epoch, 0, epoch * math.ceil(batches_per_epoch / args.gradient_accumulation_steps)
    completed = int(number)
    epoch, skip = divmod(completed * args.gradient_accumulation_steps, batches_per_epoch)
    return epoch, skip, completed


def checkpoint_every(args: argparse.Namespace) -> int | None:
    steps = args.checkpointing_steps
    return int(steps) if steps is not None and steps.isdigit() else None


def save_step_checkpoint(accelerator, args: argparse.Namespace, completed_steps: int) -> None:
    every = checkpoint_every(args)
    if every and completed_steps % every == 0:
        accelerator.save_state(os.path.join(args.output_dir or ".", f"step_{completed_steps}"))


def save_epoch_checkpoint(accelerator, args: argparse.Namespace, epoch: int) -> None:
    if args.checkpointing_steps == "epoch":
        accelerator.save_state(os.path.join(args.output_dir or ".", f"epoch_{epoch}"))


class Stopwatch:
    """Wall time of a phase, measured across every rank (waits for the slowest, and for the GPU)."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def _sync(self) -> None:
        if torch.cuda.is_available() and self.accelerator.device.type == "cuda":
            torch.cuda.synchronize(self.accelerator.device)
        self.accelerator.wait_for_everyone()

    def __enter__(self) -> Stopwatch:
        self._sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._sync()
        self.seconds = time.perf_counter() - self.start


def mean_over_ranks(accelerator, total: torch.Tensor | float, count: int) -> float:
    """The mean of a per-rank sum over `count` items, averaged over the ranks."""
    value = torch.as_tensor(total, dtype=torch.float32, device=accelerator.device) / max(count, 1)
    return accelerator.reduce(value, reduction="mean").item()


def peak_gpu_memory_gib(accelerator) -> float | None:
    if accelerator.device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(accelerator.device) / 2**30


def reset_peak_memory(accelerator) -> None:
    if accelerator.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(accelerator.device)


class Results:
    """Per-epoch records plus the run's facts, written as results.json by the main process."""

    def __init__(self, accelerator, args: argparse.Namespace, task: str, metric: str):
        self.accelerator = accelerator
        self.data: dict[str, Any] = {
            "task": task, "metric": metric,
            "distributed_type": accelerator.distributed_type.value,
            "zero_stage": accelerator.config.zero.stage,
            "offload_optimizer": accelerator.config.zero.offload_optimizer.device,
            "offload_param": accelerator.config.zero.offload_param.device,
            "mixed_precision": accelerator.mixed_precision,
            "num_processes": accelerator.num_processes,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "per_device_eval_batch_size": args.per_device_eval_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "total_train_batch_size": (args.per_device_train_batch_size * accelerator.num_processes
                                       * args.gradient_accumulation_steps),
            "epochs": [],
        }

    def add_epoch(self, epoch: int, train_seconds: float, eval_seconds: float, train_loss: float,
                  metrics: dict[str, float]) -> None:
        record = {"epoch": epoch, "train_time_s": train_seconds, "eval_time_s": eval_seconds,
                  "train_loss": train_loss, **metrics}
        self.data["epochs"].append(record)
        self.data.update(metrics)  # the last epoch's metrics are the run's
        logger.info(f"epoch {epoch}: " + ", ".join(f"{k} {v:.6g}" for k, v in record.items() if k != "epoch"))

    def write(self, output_dir: str | None, completed_steps: int, largest_batch: list[int]) -> None:
        epochs = self.data["epochs"]
        self.data.update({
            "completed_steps": completed_steps,
            "largest_batch": largest_batch,  # [rows, tokens per row] of the biggest training batch
            "train_time_per_epoch_s": [e["train_time_s"] for e in epochs],
            "eval_time_per_epoch_s": [e["eval_time_s"] for e in epochs],
            "peak_gpu_memory_gib": peak_gpu_memory_gib(self.accelerator),
        })
        self.accelerator.print(json.dumps(self.data, indent=2))
        if output_dir is not None and self.accelerator.is_main_process:
            with open(os.path.join(output_dir, "results.json"), "w") as f:
                json.dump(self.data, f, indent=2)


def save_final_model(accelerator, model: torch.nn.Module, tokenizer: Any, output_dir: str | None) -> None:
    """The consolidated model (full tensors gathered from every shard) as save_pretrained writes it."""
    if output_dir is None:
        return
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)  # collective: every rank takes part in the gather
    accelerator.unwrap_model(model).save_pretrained(output_dir, is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save, state_dict=state_dict)
    if accelerator.is_main_process and tokenizer is not None:
        tokenizer.save_pretrained(output_dir)


class Loop:
    """The training loop's counters, shared between the epochs and the final report."""

    def __init__(self, args: argparse.Namespace, completed_steps: int = 0):
        self.args = args
        self.completed_steps = completed_steps
        self.largest_batch = [0, 0]

    @property
    def done(self) -> bool:
        return self.completed_steps >= self.args.max_train_steps


def train_one_epoch(accelerator, model, optimizer, lr_scheduler, train_dataloader, loop: Loop, progress_bar,
                    skip_batches: int = 0) -> float:
    """One pass of the official no_trainer loop; returns the epoch's mean training loss over all ranks."""
    model.train()
    dataloader = accelerator.skip_first_batches(train_dataloader, skip_batches) if skip_batches else train_dataloader
    total_loss, batches = torch.zeros((), device=accelerator.device), 0
    for batch in dataloader:
        shape = list(batch["input_ids"].shape)
        if math.prod(shape) > math.prod(loop.largest_batch):
            loop.largest_batch = shape
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            total_loss += loss.detach().float()  # stays on the device: no host sync per step
            batches += 1
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            progress_bar.update(1)
            loop.completed_steps += 1
            save_step_checkpoint(accelerator, loop.args, loop.completed_steps)
        if loop.done:
            break
    return mean_over_ranks(accelerator, total_loss, batches)


def prepare_for_training(accelerator, args: argparse.Namespace, model, train_dataloader, eval_dataloader,
                         tracker_name: str):
    """Build the optimizer and schedule for the run's length, `prepare()` everything, then settle the
    step and epoch counts from the prepared (per-rank) loader. Returns what `prepare()` returned."""
    overrode_max_train_steps = args.max_train_steps is None
    steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps / accelerator.num_processes)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    optimizer, lr_scheduler = optimizer_and_scheduler(accelerator, model, args, args.max_train_steps)
    prepared = accelerator.prepare(model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    # the prepared loader holds this rank's share only: recompute the epoch count from it
    steps_per_epoch = math.ceil(len(prepared[2]) / args.gradient_accumulation_steps)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / steps_per_epoch)
    if args.with_tracking:
        accelerator.init_trackers(tracker_name, {k: str(v) for k, v in vars(args).items()})
    return prepared


def train_and_evaluate(accelerator, args: argparse.Namespace, model, optimizer, lr_scheduler, train_dataloader,
                       evaluate, results: Results, tokenizer: Any) -> None:
    """The epoch loop every recipe shares: resume, train and evaluate each epoch (both timed), log,
    checkpoint, then save the final model and `results.json`. `evaluate()` returns the epoch's metrics."""
    starting_epoch, skip, completed_steps = resume(accelerator, args, len(train_dataloader))
    loop = Loop(args, completed_steps)
    progress_bar = tqdm(range(args.max_train_steps), initial=completed_steps,
                        disable=not accelerator.is_local_main_process)
    reset_peak_memory(accelerator)

    for epoch in range(starting_epoch, args.num_train_epochs):
        with Stopwatch(accelerator) as train_time:
            train_loss = train_one_epoch(accelerator, model, optimizer, lr_scheduler, train_dataloader, loop,
                                         progress_bar, skip if epoch == starting_epoch else 0)
        with Stopwatch(accelerator) as eval_time:
            metrics = evaluate()
        results.add_epoch(epoch, train_time.seconds, eval_time.seconds, train_loss, metrics)
        if args.with_tracking:
            accelerator.log({**metrics, "train_loss": train_loss, "epoch": epoch, "step": loop.completed_steps},
                            step=loop.completed_steps)
        save_epoch_checkpoint(accelerator, args, epoch)
        if loop.done:
            break

    if args.with_tracking:
        accelerator.end_training()
    save_final_model(accelerator, model, tokenizer, args.output_dir)
    results.write(args.output_dir, loop.completed_steps, loop.largest_batch)

"""The run's config, completed from what the script says: `Accelerator(...)` arguments and prepared objects.

[Note: who wins]
* A config value "auto" takes the script's value (`Accelerator(gradient_accumulation_steps=...)`,
  `Accelerator(mixed_precision=...)`, the DataLoader's batch size, `DummyOptim(lr=...)`, ...), with
  Accelerate's rules (`zerofit.config.auto`).
* Without a config file (a plain `python train.py`, or `zerofit launch` without `--config_file`),
  the script's arguments win: the defaults are nobody's choice.
* A value the config file sets wins over a different script argument, with one warning that says
  how to let the script decide (as Accelerate does for gradient accumulation under DeepSpeed).

Resolution happens in pieces, when the facts exist: the base config when the first model is
prepared (the batch triple waits for a DataLoader if the config leaves it to one), the `optimizer`
and `scheduler` sections when `DummyOptim` / `DummyScheduler` are prepared.

[Note: a micro-batch "auto" with no DataLoader]
`train_micro_batch_size_per_gpu: "auto"` means "the batch size of my DataLoader". A DataLoader
prepared with `batch_size=None` still has one where it has a `BatchSampler`, and `prepare()` refuses
one it cannot shard (a custom batch sampler, unbatched samples), so the value is missing only when
the script prepares no DataLoader at all and makes its own batches. zerofit then cannot fill it, and
neither can the planner: a micro-batch it picked would change nothing, because the script's own
loader decides what each step sees (and without data the sequence length, which sets the activation
memory, is unknown too). So the first `backward()` raises a ConfigError naming the key, the value
and the two fixes (prepare the DataLoader, or write the number), as Accelerate does at prepare().
It waits for the first backward because a DataLoader may be prepared after the model; a run that
never trains (evaluation) is not stopped. Where the file did not write the key - an Accelerate YAML
without a DeepSpeed file holds "auto" only as Accelerate's default - or wrote a train_batch_size to
derive it from, the value is simply left unset.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

from zerofit.config import ScriptFacts, resolve_auto
from zerofit.config.naming import key_name
from zerofit.config.schema import RunConfig, is_auto
from zerofit.errors import ConfigError


def _name(config: RunConfig, key: str) -> str:
    return key_name(config.source_format, key)


def apply_script_arguments(config: RunConfig, *, gradient_accumulation_steps: int,
                           mixed_precision: str | None, world: int) -> RunConfig:
    """`config` with the Accelerator's arguments applied per the module note."""
    batch, precision = config.batch, config.precision
    ga = batch.gradient_accumulation_steps
    no_file = config.source is None
    if no_file or is_auto(ga):
        batch = dataclasses.replace(batch, gradient_accumulation_steps=gradient_accumulation_steps)
    elif ga is None:
        train, micro = batch.train_batch_size, batch.train_micro_batch_size_per_gpu
        if isinstance(train, int) and isinstance(micro, int) and not is_auto(train) and not is_auto(micro):
            ga = train // (micro * world) if micro * world else 1
        else:  # nothing to derive it from: the script's value
            batch = dataclasses.replace(batch, gradient_accumulation_steps=gradient_accumulation_steps)
            ga = gradient_accumulation_steps
    if isinstance(ga, int) and not no_file and ga != gradient_accumulation_steps and gradient_accumulation_steps != 1:
        warnings.warn(
            f"gradient accumulation: {_name(config, 'batch.gradient_accumulation_steps')} is {ga} in {config.source} "
            f"but the script passes Accelerator(gradient_accumulation_steps={gradient_accumulation_steps}); using "
            f'the config\'s {ga}. Set it to "auto" in the config to take the script\'s value', stacklevel=4)
    mode = precision.mixed_precision
    if no_file and mixed_precision is not None:
        precision = dataclasses.replace(precision, mixed_precision=mixed_precision)
    elif is_auto(mode):
        precision = dataclasses.replace(precision, mixed_precision=mixed_precision or "no")
    elif mixed_precision is not None and mixed_precision != mode:
        warnings.warn(
            f"mixed precision: {_name(config, 'precision.mixed_precision')} is {mode!r} in {config.source} but the "
            f"script passes Accelerator(mixed_precision={mixed_precision!r}); using the config's {mode!r}. Set it "
            f'to "auto" in the config to take the script\'s value', stacklevel=4)
    return config.replace(batch=batch, precision=precision)


def early_accumulation(config: RunConfig, world: int) -> int:
    """The accumulation steps known before prepare() (see `apply_script_arguments`)."""
    b = config.batch
    if isinstance(b.gradient_accumulation_steps, int) and not is_auto(b.gradient_accumulation_steps):
        return b.gradient_accumulation_steps
    train, micro = b.train_batch_size, b.train_micro_batch_size_per_gpu
    if isinstance(train, int) and isinstance(micro, int) and micro > 0:
        return max(1, train // (micro * world))
    return 1


@dataclass
class Facts:
    """What prepare() has learnt about the script so far (becomes `ScriptFacts`)."""

    micro_batch_size: int | None = None
    lr: float | None = None
    weight_decay: float | None = None
    total_num_steps: int | None = None
    warmup_num_steps: int | None = None
    hidden_size: int | None = None

    def script_facts(self, config: RunConfig, world: int) -> ScriptFacts:
        return ScriptFacts(
            micro_batch_size=self.micro_batch_size,
            gradient_accumulation_steps=early_accumulation(config, world),
            mixed_precision=None if is_auto(config.precision.mixed_precision) else config.precision.mixed_precision,
            num_processes=world, lr=self.lr, weight_decay=self.weight_decay,
            total_num_steps=self.total_num_steps, warmup_num_steps=self.warmup_num_steps,
            hidden_size=self.hidden_size)


def hidden_size_of(model: Any) -> int | None:
    """`model.config.hidden_size`, or the largest of `hidden_sizes` (what "auto" bucket sizes come from)."""
    cfg = getattr(model, "config", None)
    size = getattr(cfg, "hidden_size", None)
    if isinstance(size, int):
        return size
    sizes = getattr(cfg, "hidden_sizes", None)
    return max(sizes) if sizes else None


def scheduler_total_steps(total: int | None, world: int, split_batches: bool) -> int | None:
    """DummyScheduler's total counted on the unsharded data, as this process's optimizer steps."""
    if total is None:
        return None
    return total if split_batches else math.ceil(total / world)


def resolve(config: RunConfig, facts: Facts, world: int, *, optimizer: bool, scheduler: bool) -> tuple[RunConfig, bool]:
    """`config` with every "auto" it can fill now filled; returns (config, batch triple still waiting).

    Sections not asked for (`optimizer`, `scheduler`) are left as they are. When no DataLoader has
    told the micro batch size and the config leaves the batch triple to one, the rest is resolved
    and the batch section is kept (accumulation filled) until a DataLoader is prepared.
    """
    held = {"optimizer": config.optimizer if not optimizer else None,
            "scheduler": config.scheduler if not scheduler else None}
    work = config.replace(optimizer=config.optimizer if optimizer else None,
                          scheduler=config.scheduler if scheduler else None)
    b = work.batch
    waiting = False
    if facts.micro_batch_size is None:
        micro = None if is_auto(b.train_micro_batch_size_per_gpu) else b.train_micro_batch_size_per_gpu
        train = None if is_auto(b.train_batch_size) else b.train_batch_size
        waiting = micro is None and train is None
        # a stand-in micro batch lets the rest resolve; the real triple is resolved with a DataLoader
        work = work.replace(batch=dataclasses.replace(b, train_batch_size=None if waiting else train,
                                                      train_micro_batch_size_per_gpu=1 if waiting else micro))
    resolved = resolve_auto(work, facts.script_facts(config, world))
    if waiting:
        kept = dataclasses.replace(config.batch, gradient_accumulation_steps=resolved.batch.gradient_accumulation_steps)
        resolved = resolved.replace(batch=kept)
    resolved = resolved.replace(optimizer=held["optimizer"] or resolved.optimizer,
                                scheduler=held["scheduler"] or resolved.scheduler)
    return resolved, waiting



def require_micro_batch(config: RunConfig) -> None:
    """Raise when training starts with a written micro-batch "auto" nothing filled (see the module note)."""
    b = config.batch
    if not is_auto(b.train_micro_batch_size_per_gpu) or config.source_format == "accelerate":
        return
    if isinstance(b.train_batch_size, int) and not is_auto(b.train_batch_size):
        return
    key = _name(config, "batch.train_micro_batch_size_per_gpu")
    raise ConfigError(
        f'{key} is "auto", but training started and no DataLoader with a batch size was passed to '
        "accelerator.prepare(), so zerofit has no value to fill it with: prepare the training DataLoader "
        f"(built with batch_size=...) before the first backward, or write the per-GPU micro-batch size "
        f"instead of \"auto\" (for example {key}: 8)", config.source)

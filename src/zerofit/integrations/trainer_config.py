"""The run's config under transformers' `Trainer`: the launch file, completed from `TrainingArguments`.

[Note: Trainer owns the loop]
Trainer counts micro-steps, divides the loss by its own `gradient_accumulation_steps`, tells the
Accelerator which micro-step closes a window (`gradient_state._set_sync_gradients`) and clips with
`max_grad_norm` through `accelerator.clip_grad_norm_`. So the Accelerator it gets must neither divide
again nor clip again: its engine runs with a window of 1 micro-step and no clipping of its own, and
the window Trainer really uses is kept as a hint for the planner (`stage: auto`).

Everything else follows the rule DeepSpeed users know from `--deepspeed ds.json`: a key the file
leaves "auto" (or out) takes the TrainingArguments value, a key the file writes must agree with it,
and every disagreement is listed in one error naming the key, both values and the fix. The
precision is the one exception: Trainer's `--bf16` / `--fp16` decide it, as `Accelerator(mixed_precision=...)`
(which Trainer passes) wins over the launcher's setting in Accelerate; only a file that asks for
another low precision than the script (fp16 against bf16, or either against fp32) is an error,
because "no" is also what a file that never mentions precision holds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from zerofit.config.naming import key_name
from zerofit.config.schema import AUTO, RunConfig, is_auto
from zerofit.errors import ConfigError
from zerofit.frontend.lowbit_optimizers import trainer_optim, with_optimizer_state


@dataclasses.dataclass(frozen=True)
class TrainerFacts:
    """The TrainingArguments values the config is completed from (read once, so tests can build one)."""

    micro_batch: int
    accumulation: int
    world: int
    max_grad_norm: float
    mixed_precision: str
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    optim: str = "adamw_torch"
    """TrainingArguments.optim: its 8-bit names set precision.optimizer_state (zerofit.frontend.lowbit_optimizers)."""

    @classmethod
    def from_args(cls, args: Any, world: int) -> TrainerFacts:
        return cls(micro_batch=int(args.per_device_train_batch_size),
                   accumulation=int(args.gradient_accumulation_steps),
                   world=world, max_grad_norm=float(args.max_grad_norm or 0.0),
                   mixed_precision=trainer_precision(args), lr=float(args.learning_rate),
                   betas=(float(args.adam_beta1), float(args.adam_beta2)), eps=float(args.adam_epsilon),
                   weight_decay=float(args.weight_decay), optim=str(getattr(args.optim, "value", args.optim)))


def trainer_precision(args: Any) -> str:
    """'bf16', 'fp16' or 'no', as TrainingArguments' bf16/fp16 flags say."""
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    return "no"


class _Checker:
    """Fills "auto" keys from TrainingArguments and collects every written key that disagrees."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.problems: list[str] = []

    def take(self, key: str, written: Any, wanted: Any, argument: str, *, same=None, default: Any = None) -> Any:
        """`wanted` where the file left `key` "auto" or out; else `written`, noting a disagreement.

        Out means not among the keys the file wrote (`RunConfig.written`), so a written 0 or false is compared
        like any value, as transformers compares a DeepSpeed file's; a config built without a file (no
        record) counts a value other than the schema's `default` as written."""
        if written is None or is_auto(written) or not self.is_written(key, written, default):
            return wanted
        agree = same(written, wanted) if same is not None else written == wanted
        if not agree:
            name = key_name(self.config.source_format, key)
            self.problems.append(
                f"{name} is {written!r} in the config but TrainingArguments has {argument}={wanted!r}: Trainer "
                f'drives this value, so set {name} to "auto" (or leave it out) to take it from TrainingArguments, '
                f"or make them equal (pass --{argument} {written!r} to the script)")
        return written

    def is_written(self, key: str, value: Any, default: Any) -> bool:
        if self.config.written or self.config.source is not None:
            return key in self.config.written or key.startswith(("optimizer.params.", "scheduler.params."))
        return value != default


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    except (TypeError, ValueError):
        return a == b


def trainer_config(config: RunConfig, facts: TrainerFacts) -> RunConfig:
    """`config` completed from the Trainer's arguments, as the Accelerator under Trainer runs it
    ([Note: Trainer owns the loop]): batch triple for a window of 1, no engine clipping, the
    optimizer section's "auto" params filled. Raises one ConfigError listing every disagreement."""
    check = _Checker(config)
    b = config.batch
    micro = check.take("batch.train_micro_batch_size_per_gpu", b.train_micro_batch_size_per_gpu, facts.micro_batch,
                       "per_device_train_batch_size")
    check.take("batch.gradient_accumulation_steps", b.gradient_accumulation_steps, facts.accumulation,
               "gradient_accumulation_steps", default=AUTO)
    check.take("batch.train_batch_size", b.train_batch_size, facts.micro_batch * facts.accumulation * facts.world,
               "per_device_train_batch_size x gradient_accumulation_steps x processes")
    check.take("gradient_clipping", config.gradient_clipping, facts.max_grad_norm, "max_grad_norm", same=_close,
               default=0.0)
    precision = config.precision
    mode = precision.mixed_precision
    if (config.source_format != "accelerate" and mode not in ("no", facts.mixed_precision) and not is_auto(mode)):
        name = key_name(config.source_format, "precision.mixed_precision")
        check.problems.append(
            f"{name} asks for {mode} in the config but TrainingArguments trains in "
            f"{'fp32' if facts.mixed_precision == 'no' else facts.mixed_precision}: Trainer's --bf16 / --fp16 "
            f"decide the precision, so pass --{mode} true to the script, or write \"auto\" in the config")
    mode = facts.mixed_precision
    optimizer = config.optimizer
    if optimizer is not None:
        wanted = {"lr": facts.lr, "betas": list(facts.betas), "eps": facts.eps, "weight_decay": facts.weight_decay}
        params = dict(optimizer.params)
        for name, value in wanted.items():
            if name in params:
                params[name] = check.take(f"optimizer.params.{name}", params[name], value,
                                          _ARGUMENT[name], same=_close)
        optimizer = dataclasses.replace(optimizer, params=params)
    if check.problems:
        raise ConfigError(check.problems, config.source)
    if config.optimizer is None:  # a config's optimizer section replaces --optim (DeepSpeed's rule)
        mapped = trainer_optim(facts.optim)
        if mapped is not None:
            config = with_optimizer_state(config, mapped.state, f"--optim {facts.optim}")
            precision = config.precision
    batch = dataclasses.replace(b, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=1,
                                train_batch_size=micro * facts.world)
    return config.replace(batch=batch, gradient_clipping=0.0, optimizer=optimizer,
                          precision=dataclasses.replace(precision, mixed_precision=mode))


_ARGUMENT = {"lr": "learning_rate", "betas": "adam_beta1/adam_beta2", "eps": "adam_epsilon",
             "weight_decay": "weight_decay"}


def scheduler_filled(config: RunConfig, *, total_steps: int, warmup_steps: int, lr: float) -> RunConfig:
    """`config` with its scheduler section's "auto" params filled from the Trainer's schedule (optimizer
    steps in all, warmup steps, peak learning rate); a written value that disagrees raises."""
    named = config.scheduler
    if named is None:
        return config
    check = _Checker(config)
    wanted = {"total_num_steps": (total_steps, "max_steps"), "warmup_num_steps": (warmup_steps, "warmup_steps"),
              "warmup_max_lr": (lr, "learning_rate")}
    params = dict(named.params)
    if is_auto(params.get("warmup_min_lr")):  # Trainer's schedules start from 0
        params["warmup_min_lr"] = 0.0
    for name, (value, argument) in wanted.items():
        if name in params:
            params[name] = check.take(f"scheduler.params.{name}", params[name], value, argument, same=_close)
    if check.problems:
        raise ConfigError(check.problems, config.source)
    return config.replace(scheduler=dataclasses.replace(named, params=params))

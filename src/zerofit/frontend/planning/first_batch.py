"""A plan made without the batch, checked at the first training forward, before it can run out of memory.

[Note: planned without the batch]
The planner sizes activations from the first batch of the DataLoader given to `prepare()`. A script
that feeds the model batches of its own (no DataLoader passed to `prepare()`) leaves the shape unknown,
so `stage: auto` plans the model states alone and may fill the GPU with them: a pretrained 13 B Llama
at 8x512 on one H200 was planned at 122.7 GiB of states, and its first forward ran out of memory at
138 GiB (#29). So when the shape was unknown, the first forward with gradients on - the first one a
backward follows - is checked before it runs (a forward pre-hook on the model, removed after):
- its `input_ids` (or first 2-D integer tensor) give the shape, the largest over the ranks (one small
  all-reduce, once, so every rank decides the same);
- the setting the engine runs is estimated with the activations traced at that shape;
- it fits: nothing changes. It fits only with activation checkpointing, which the config leaves open
  and the model supports: checkpointing is turned on for this forward and the rest of the run, and the
  main process says so. Otherwise: a `ConfigError` before the forward, naming the batch, the bytes it
  needs and has, the setting the planner chooses for this batch, and the fixes (pass the DataLoader to
  `prepare()`, write that setting, or lower the batch).
A model the planner cannot replicate (not a transformers model) has no trace: nothing is checked, as
before, and the probe of the first optimizer step (`zerofit.frontend.planning.first_step_check`) still reports the peak.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerofit.config.schema import RunConfig
from zerofit.distributed.failures import named
from zerofit.errors import ConfigError
from zerofit.plan.activations import checkpointing_switch, has_checkpointing
from zerofit.plan.auto import activation_traces, checkpointing_choices, choose, workload_for
from zerofit.plan.choose import Budget, Plan
from zerofit.plan.memory import GIB, Estimate, ModelCounts, estimate

_FOUND_NO_SHAPE = (0, 0)


def batch_shape(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """(samples, tokens) of a forward's token ids: `input_ids`, else the first 2-D integer tensor."""
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        ids = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)
                    and a.dim() == 2 and not a.is_floating_point()), None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    return int(ids.shape[0]), int(ids.shape[1])


class FirstBatchCheck:
    """The check of [Note: planned without the batch] for one planned model."""

    def __init__(self, config: RunConfig, result: Plan, budget: Budget, *, world: int, device: torch.device,
                 is_main: bool, spell: Callable[[str], str], on_checkpointing: Callable[[], None]):
        """`config`: as the script wrote it (its "auto" keys open), `result`: the plan prepare() ran,
        `on_checkpointing`: called when the check turns activation checkpointing on."""
        self.config, self.result, self.budget = config, result, budget
        self.world, self.device, self.is_main, self.spell = world, device, is_main, spell
        self.on_checkpointing = on_checkpointing
        self.whole: frozenset[int] = frozenset()
        """id() of the parameters a per-parameter optimizer steps whole (the planner counts them apart)."""
        self._handle: Any = None

    def install(self, model: nn.Module) -> None:
        self._handle = model.register_forward_pre_hook(self._check, with_kwargs=True)

    def _check(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():  # evaluation: not the step that was planned
            return
        self._handle.remove()
        shape = self._agreed(batch_shape(args, kwargs))
        if shape is None:
            return
        self.judge(model, shape)

    def _agreed(self, shape: tuple[int, int] | None) -> tuple[int, int] | None:
        """The largest shape over the ranks (each rank must take the same decision)."""
        if self.world > 1 and dist.is_initialized():
            local = torch.tensor(shape or _FOUND_NO_SHAPE, dtype=torch.int64,
                                 device=self.device if self.device.type == "cuda" else "cpu")
            with named("all_reduce of the first batch's shape (stage: auto)", dist.get_rank()):
                dist.all_reduce(local, op=dist.ReduceOp.MAX)
            shape = (int(local[0]), int(local[1]))
        return None if shape in (None, _FOUND_NO_SHAPE) else shape

    def judge(self, model: nn.Module, shape: tuple[int, int]) -> None:
        """Let the forward of a `shape` batch run, turn checkpointing on for it, or raise (see the note)."""
        chosen = self.result.choice or self.result.smallest
        if chosen is None:
            return
        setting = chosen.setting
        precision = self.config.precision.mixed_precision
        work = workload_for(self.config, world=self.world, shape=shape)
        counts = ModelCounts.of(model, unit_size_threshold=work.unit_size_threshold, whole=self.whole)
        on = has_checkpointing(model)
        choices = checkpointing_choices(self.config, model)  # the planner's own rule: (True,) when on
        traces = activation_traces(model, shape, choices, precision, work)
        if traces.get(on) is None:
            return  # no trace (a model the planner cannot replicate): nothing to hold the batch against
        now = estimate(counts, dataclasses.replace(setting, checkpointing=on), work, traces[on])
        if self.budget.fits(now):
            return
        if not on and traces.get(True) is not None:
            checked = estimate(counts, dataclasses.replace(setting, checkpointing=True), work, traces[True])
            if self.budget.fits(checked):
                checkpointing_switch(model)[0]()
                self.on_checkpointing()
                if self.is_main:
                    print(f"zerofit: the first training batch is {shape[0]}x{shape[1]} tokens, which prepare() did "
                          f"not see (no DataLoader passed to it): with its activations {setting.label} needs "
                          f"{self.budget.need(now) / GIB:.2f} GiB, more than fits, so activation checkpointing is on "
                          f"from this forward ({self.budget.need(checked) / GIB:.2f} GiB). Pass the "
                          "DataLoader to prepare() to have the planner weigh the batch", flush=True)
                return
        raise ConfigError(self._message(model, shape, setting.label, now))

    def _message(self, model: nn.Module, shape: tuple[int, int], label: str, now: Estimate) -> str:
        fresh = choose(self.config, model, world=self.world, shape=shape, budget=self.budget)[1]
        better = fresh.choice.setting.label if fresh.choice is not None else None
        what = "memory" if self.budget.unified else "GPU"
        allowed = self.budget.gpu_allowance(now)
        if self.budget.unified and allowed is not None:
            allowed += now.host_total  # the allowance leaves the host share out; the need counts it
        have = f" of the {allowed / GIB:.2f} GiB it may use" if allowed is not None else ""
        stage = self.spell("zero.stage")
        text = (f"the first training batch is {shape[0]}x{shape[1]} tokens, which prepare() did not see (no DataLoader "
                f"was passed to it), so {stage}: auto planned {label} without activations; with this batch's "
                f"activations that setting needs {self.budget.need(now) / GIB:.2f} GiB {what}{have} and would run "
                "out of memory. ")
        if better is not None:
            text += (f"For this batch the planner chooses {better}: pass the training DataLoader to prepare() "
                     "(prepare(model, optimizer, train_dataloader)) so the planner sees the batch, or write that "
                     "setting in the config")
        else:
            text += f"No setting fits this batch ({fresh.reason})"
        return text + ", or lower the batch size"

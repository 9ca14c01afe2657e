"""The DeepSpeedEngine calls scripts make on what `prepare()` returned, answered by zerofit.

Under Accelerate with DeepSpeed, `prepare()` returns a `DeepSpeedEngine`, and scripts written for it
(the blog's seq2seq and clm scripts, for two) call its methods when `accelerator.state.deepspeed_plugin`
is set: `model.save_checkpoint(dir, tag, client_state=...)`, `model.load_checkpoint(dir, tag)`,
`model.zero_optimization_stage()`; scripts written for DDP call `model.no_sync()`.
zerofit's `prepare()` returns the script's own model, changed in
place, so that `model.config`, `generate` and `save_pretrained` keep working; the DeepSpeedEngine
calls are given to that one object as instance attributes (functions bound to this run's
Accelerator), never to its class, and only where the model has no attribute of that name already.
They write and read zerofit's own checkpoint format (`save_state` / `load_state`), so such a
checkpoint also resumes at another world size or stage.

`.module` is left out on purpose: transformers' and PEFT's unwrapping helpers follow `model.module`
while it exists, so a model that is its own `.module` would send them round in a circle.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from zerofit.checkpoint import resume
from zerofit.checkpoint.commit import LATEST


def attach(model: nn.Module, accelerator: Any, stage: int) -> None:
    """Give `model` the DeepSpeedEngine calls it lacks (see the module doc); `no_sync` (DDP's and
    DeepSpeedEngine's) at every stage, the rest where ZeRO shards (stage >= 1)."""
    calls = {"no_sync": lambda: accelerator.no_sync(model)}
    if stage >= 1:
        calls |= {
            "save_checkpoint": functools.partial(save_checkpoint, accelerator),
            "load_checkpoint": functools.partial(load_checkpoint, accelerator),
            "zero_optimization_stage": lambda: stage,
            "gradient_accumulation_steps": lambda: accelerator.gradient_accumulation_steps,
        }
    for name, call in calls.items():
        if not hasattr(model, name):
            setattr(model, name, call)


def save_checkpoint(accelerator: Any, save_dir: str | os.PathLike, tag: Any = None,
                    client_state: dict[str, Any] | None = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False, **kwargs: Any) -> bool:
    """DeepSpeed's `save_checkpoint`: the whole training state in `save_dir/tag` (default
    `global_step<N>`), `client_state` stored with it, `save_dir/latest` naming it; without the frozen
    parameters' values with `exclude_frozen_parameters`. Collective."""
    if tag is None:
        tag = f"global_step{accelerator.completed_steps}"
    accelerator._save(Path(save_dir) / str(tag), client_state=client_state or {}, update_latest=save_latest,
                      exclude_frozen=exclude_frozen_parameters)
    return True


def load_checkpoint(accelerator: Any, load_dir: str | os.PathLike, tag: Any = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, **kwargs: Any) -> tuple[str | None, dict[str, Any] | None]:
    """DeepSpeed's `load_checkpoint`: restore `load_dir/tag` (default: the tag `load_dir/latest` names)
    and return `(path, client_state)`; `(None, None)` when there is no `latest` to follow. Collective."""
    if load_module_only or not load_optimizer_states or not load_lr_scheduler_states:
        raise ValueError("load_checkpoint(load_module_only / load_optimizer_states / load_lr_scheduler_states) "
                         "asks for part of a checkpoint: zerofit restores the whole training state; for the "
                         "weights alone, load an accelerator.save_model export with from_pretrained")
    root = Path(load_dir)
    found = resume.latest_complete(root) if tag is None else root / str(tag)
    if found is None:
        warnings.warn(f"load_checkpoint: {root / LATEST} does not exist, so there is no checkpoint to load "
                      "(as DeepSpeed, returning (None, None)): pass tag=, or save one first", stacklevel=2)
        return None, None
    path = str(found)
    extra = accelerator._load(path, custom_may_follow=False)
    return path, extra.get("client_state", {})

"""Accelerate's global state, made to describe the zerofit run it sits in.

Libraries built on Accelerate ask its process-wide singletons instead of the Accelerator they were
given: TRL's GRPO, RLOO and distillation trainers call `accelerate.utils.set_seed(seed,
device_specific=True)`, which reads `AcceleratorState().process_index`; `accelerate.utils.gather`,
`gather_object` and `broadcast_object_list` read `PartialState()`. Under zerofit no Accelerate
`Accelerator` is ever built, so `AcceleratorState()` raises ("Please make sure to properly initialize
your accelerator"). `share_with_accelerate(accelerator)` builds Accelerate's state over the process
group zerofit already runs on, with zerofit's answers:

* `PartialState`: process index, world, local index and device are zerofit's. It is the one
  TrainingArguments already built (transformers builds it in `_setup_devices`), or one built here over
  the existing process group; one that counts another world or device is an error naming both.
* `AcceleratorState`: zerofit's mixed precision, and a plain data-parallel `distributed_type` (NO,
  MULTI_CPU or MULTI_GPU), never DEEPSPEED or FSDP: zerofit's engine shards behind plain data-parallel
  calls, and a DeepSpeed answer sends libraries down paths that import `deepspeed` (TRL's
  `prepare_deepspeed`, `unwrap_model_for_generation`'s gather). `deepspeed_plugin` is None.

zerofit's own packages never import Accelerate; only `zerofit.integrations` does, where the library
being served imports it anyway. The Trainer integration calls this when it builds its Accelerator; a
script on `zerofit.Accelerator` that calls library code asking Accelerate's state calls it once after
building its Accelerator.
"""

from __future__ import annotations

import os
from typing import Any

from accelerate.state import AcceleratorState, DistributedType, PartialState
from accelerate.utils import TorchDynamoPlugin

from zerofit.errors import ConfigError

_OTHER_ENGINES = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_MEGATRON_LM")
_PLAIN = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def share_with_accelerate(accelerator: Any) -> None:
    """Make Accelerate's `PartialState` and `AcceleratorState` say what `accelerator` (zerofit's) says."""
    _refuse_other_engines()
    cpu = accelerator.device.type == "cpu"
    partial = PartialState(cpu=cpu)  # the existing one, or built now over zerofit's process group
    _check_same_process(partial, accelerator)
    mixed_precision = accelerator.mixed_precision
    if _accelerator_state_built():
        state = AcceleratorState()
        if state.distributed_type in _PLAIN and state.mixed_precision == mixed_precision:
            return
        # Left by an Accelerate Accelerator built earlier in this process (transformers resets it at every
        # TrainingArguments): its answers are not this run's, and PartialState underneath stays.
        AcceleratorState._reset_state()
    # `_from_accelerator=True` is how Accelerate's own Accelerator builds this state; no public route
    # builds it without building that Accelerator (whose prepare, hooks and loaders zerofit replaces).
    AcceleratorState(mixed_precision=mixed_precision, cpu=cpu, dynamo_plugin=TorchDynamoPlugin(backend="no"),
                     _from_accelerator=True)


def _accelerator_state_built() -> bool:
    """Whether an Accelerator (Accelerate's, or this module) built `AcceleratorState`. Asked without calling
    `AcceleratorState()`, which raises when it was not; a failed call leaves a copy of PartialState's state
    behind, which is what `AcceleratorState.initialized` compares against too."""
    shared = AcceleratorState._shared_state
    return bool(shared) and shared != PartialState._shared_state


def _refuse_other_engines() -> None:
    """Environment that makes Accelerate's state claim another engine than zerofit's."""
    set_to = [name for name in _OTHER_ENGINES if os.environ.get(name, "false").lower() == "true"]
    if set_to:
        raise ConfigError(
            [f"{name}=true in the environment makes Accelerate's state claim that engine, and libraries under "
             "zerofit then take its paths (TRL imports deepspeed): unset it (zerofit launch never sets it; "
             "`accelerate launch` with a DeepSpeed or FSDP config does), and launch with zerofit launch "
             "--config_file" for name in set_to])


def _check_same_process(partial: PartialState, accelerator: Any) -> None:
    ours = (accelerator.process_index, accelerator.num_processes, accelerator.device)
    theirs = (partial.process_index, partial.num_processes, partial.device)
    # Accelerate names a CPU rank's device `cpu:<local rank>`, zerofit `cpu`: one memory either way
    same_device = ours[2].type == theirs[2].type and (ours[2].type == "cpu" or ours[2].index == theirs[2].index)
    if ours[:2] != theirs[:2] or not same_device or partial.distributed_type not in _PLAIN:
        raise ConfigError(
            f"Accelerate's PartialState says process {theirs[0]} of {theirs[1]} on {theirs[2]} "
            f"({partial.distributed_type}), but zerofit runs process {ours[0]} of {ours[1]} on {ours[2]}: "
            "something built Accelerate's state for another launch. Build TrainingArguments and the Trainer "
            "in the processes `zerofit launch` started (on CPUs with `zerofit launch --cpu` or --use_cpu), "
            "and no Accelerate Accelerator beside zerofit's")

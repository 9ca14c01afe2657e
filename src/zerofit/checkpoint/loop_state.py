"""What `save_state` / `load_state` add to the engine's sharded state: the loop's own state, per rank.

The engine's parameters, master weights, optimizer state and loss scaler are written by
`zerofit.checkpoint`; this module collects the rest as `extra_state` (plain Python values and
tensors only, so loading never needs to unpickle arbitrary objects): every scheduler's
`state_dict()`, the optimizer wrappers' flags, each dataloader's epoch, position and order, this
rank's RNG states (Python, NumPy, torch CPU and CUDA), and the `state_dict()` of every object given
to `register_for_checkpointing`. The accumulation window's micro-step is the engine's to save (its
common record); a `micro_step` key older checkpoints have here is ignored.
"""

from __future__ import annotations

import random
from typing import Any

import torch

EXTRA_STATE_VERSION = 1


def rng_state() -> dict[str, Any]:
    """This process's generator states, as plain lists and tensors."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def collect(*, schedulers: list[Any], optimizers: list[Any], dataloaders: list[Any], custom: list[Any],
            iteration: int) -> dict[str, Any]:
    """The `extra_state` dict handed to `zerofit.checkpoint.save_state`."""
    return {
        "version": EXTRA_STATE_VERSION,
        "schedulers": [s.state_dict() for s in schedulers],
        "optimizers": [{"step_was_skipped": bool(o.step_was_skipped), "steps_taken": o.steps_taken}
                       for o in optimizers],
        "dataloaders": [{"epoch": d.iteration, "batches_yielded": d.batches_yielded, "seed": d.seed,
                         "order": d.order.state_dict() if d.order is not None else {}} for d in dataloaders],
        "custom": [obj.state_dict() for obj in custom],
        "iteration": iteration,
        "rng": rng_state(),
    }


def restore(extra: dict[str, Any], *, schedulers: list[Any], optimizers: list[Any], dataloaders: list[Any],
            custom: list[Any], custom_may_follow: bool = False) -> list[Any]:
    """Put `extra` (from `zerofit.checkpoint.load_state`) back.

    With `custom_may_follow` (an automatic resume inside `prepare()`), the checkpoint may hold more
    registered objects than are registered yet: the states of the missing ones come back, in order,
    for `register_for_checkpointing` to apply when the script registers them.
    """
    saved_custom = extra.get("custom", [])
    later = saved_custom[len(custom):] if custom_may_follow else []
    for what, saved, live in (("schedulers", extra.get("schedulers", []), schedulers),
                              ("dataloaders", extra.get("dataloaders", []), dataloaders),
                              ("registered objects", saved_custom[:len(saved_custom) - len(later)], custom)):
        if len(saved) != len(live):
            raise ValueError(f"the checkpoint holds {len(saved)} {what} but this run prepared {len(live)}: "
                             f"prepare (or register_for_checkpointing) the same objects, in the same order, "
                             f"as the run that saved it")
    for sched, sd in zip(schedulers, extra["schedulers"]):
        sched.load_state_dict(sd)
    for opt, sd in zip(optimizers, extra.get("optimizers", [])):
        opt.step_was_skipped = sd["step_was_skipped"]
        opt.steps_taken = int(sd.get("steps_taken", 0))
    for loader, sd in zip(dataloaders, extra["dataloaders"]):
        loader.iteration = sd["epoch"]
        loader.resume_position = sd["batches_yielded"]
        loader.seed = sd.get("seed", loader.seed)
        loader.load_order_state(sd.get("order", {}))
    for obj, sd in zip(custom, saved_custom):
        obj.load_state_dict(sd)
    if "rng" in extra:
        set_rng_state(extra["rng"])
    return later

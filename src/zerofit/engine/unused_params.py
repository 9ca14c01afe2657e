"""Which parameters no rank gave a gradient in an accumulation window (see the note below)."""

from __future__ import annotations

import torch

from zerofit.engine.comm import Collectives
from zerofit.engine.unit import Unit


def mark_unused(units: list[Unit], comm: Collectives, device: torch.device) -> None:
    """Tell every trainable group which of its parameters no rank gave a gradient in this window.

    [Note: parameters without a gradient]
    torch's optimizers skip a parameter whose `.grad` is None - no weight decay, no moment update,
    no step count - and DDP leaves such a parameter's gradient None when no rank used it. The
    engine does the same: each rank records which parameters got a gradient in the window
    (`Unit.used`), the ranks sum one flag per parameter, and the step leaves the master pieces of
    parameters with a sum of 0 out (`FlatGroup.unused`, `optim.without_grads`). A parameter used on
    some ranks only is stepped on every rank with the averaged gradient, as DDP does. The sum is
    one small all-reduce per step, issued by every rank; a rank that used every parameter knows
    the answer without reading it, so only a window with a parameter unused here waits for it.
    """
    groups = [(g, u.used[gi]) for u in units for gi, g in enumerate(u.trainable)]
    flags = [float(i in used) for g, used in groups for i in range(len(g.params))]
    missing = 0.0 in flags
    if comm.world > 1:
        counts = (torch.tensor(flags, dtype=torch.float32).to(device) if missing
                  else torch.ones(len(flags), dtype=torch.float32, device=device))
        comm.all_reduce_now(counts, "used_params")
        if missing:
            flags = counts.tolist()  # host sync only where some parameter went unused here
    cursor = 0
    for g, _ in groups:
        n = len(g.params)
        g.unused = frozenset(i for i in range(n) if flags[cursor + i] == 0) if missing else frozenset()
        cursor += n

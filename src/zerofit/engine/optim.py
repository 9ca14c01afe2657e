"""The optimizer step on shards: rebinding the user's optimizer, gradient norm, clipping.

[Note: one optimizer object]
The script's optimizer object stays the one that steps: its param groups keep every setting (lr,
betas, weight decay, ...) but their `params` are replaced by this rank's fp32 master pieces, one per
parameter part in the shard (see `zerofit.engine.layout`), each with its own optimizer state. LR
schedulers built on that optimizer before `prepare()` therefore keep working, and any torch optimizer
whose update is
elementwise (Adam, AdamW, SGD with momentum, ...) computes exactly what it would on the whole model.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from zerofit.engine.comm import Collectives
from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.optimizer_kinds import PER_PARAMETER, optimizer_kind
from zerofit.engine.optimizer_set import OptimizerSet, members_of
from zerofit.errors import EngineError

_FUSED_CAPABLE = ("Adam", "AdamW", "SGD", "Adagrad")


def param_group_index(optimizer: torch.optim.Optimizer | None) -> dict[int, int]:
    """id(parameter) -> index of its param group in `optimizer`."""
    index: dict[int, int] = {}
    if optimizer is None:
        return index
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) in index:
                raise EngineError(f"a parameter of shape {tuple(p.shape)} is in two optimizer param groups "
                                  f"({index[id(p)]} and {g}): put each parameter in one group")
            index[id(p)] = g
    return index


def group_kinds(optimizer: torch.optim.Optimizer | None) -> list[str]:
    """Per param group of `optimizer`: ELEMENTWISE or PER_PARAMETER, from the class of the optimizer (the
    set's member) holding it; an EngineError for a class zerofit cannot step exactly (see
    zerofit.engine.optimizer_kinds)."""
    out = []
    for m in members_of(optimizer):
        out += [optimizer_kind(m)] * len(m.param_groups)
    return out


def whole_param_ids(optimizer: torch.optim.Optimizer | None) -> frozenset[int]:
    """id() of the parameters `optimizer` holds in the param groups of a per-parameter optimizer (stepped whole:
    see zerofit.engine.whole_step), for the memory model; refuses an optimizer zerofit cannot classify."""
    kinds = group_kinds(optimizer)
    return frozenset(pid for pid, g in param_group_index(optimizer).items() if kinds[g] == PER_PARAMETER) \
        if optimizer is not None else frozenset()


def member_of_group(optimizer: torch.optim.Optimizer, index: int) -> torch.optim.Optimizer:
    """The optimizer that owns param group `index` of `optimizer`: a set's member, else `optimizer` itself."""
    return optimizer.member_of_group(index) if isinstance(optimizer, OptimizerSet) else optimizer


def rebind_optimizer(optimizer: torch.optim.Optimizer, groups: list[FlatGroup], rank: int) -> None:
    """Point `optimizer` at this rank's master pieces and give every piece its gradient view (compact
    groups get theirs at each step: see `zerofit.engine.step_mode.CompactStep`)."""
    pieces: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
    for fg in groups:
        if not fg.trainable or fg.whole:  # whole groups: stand-ins, see zerofit.engine.whole_step
            continue
        fg.piece_masters = []
        for piece in fg.layout.pieces(fg.placement.rank):
            sl = slice(piece.shard_offset, piece.shard_offset + piece.length)
            master = fg.master[sl]
            if not fg.compact and not fg.placement.gpu_stepped:  # streamed: bound chunk by chunk
                master.grad = fg.grad_shard[sl]
            pieces[piece.group].append(master)
            fg.piece_masters.append((piece.index, master))
    for gi, (group, tensors) in enumerate(zip(optimizer.param_groups, pieces)):
        group["params"] = tensors
        member = member_of_group(optimizer, gi)
        # Fused kernels step many big flat tensors fastest, on CPU as on GPU (unless the script chose).
        if type(member).__name__ in _FUSED_CAPABLE and group.get("fused") is None and not group.get("foreach") \
                and not group.get("differentiable") and "fused" in member.defaults:
            group["fused"] = True
            if "foreach" in group:
                group["foreach"] = False
    optimizer.state = defaultdict(dict)


def _by_device(groups: list[FlatGroup]) -> dict[torch.device, list[torch.Tensor]]:
    out: dict[torch.device, list[torch.Tensor]] = {}
    for fg in groups:
        if fg.grad_shard is not None:
            out.setdefault(fg.grad_shard.device, []).append(fg.grad_shard)
    return out


def sub_optimizer(optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor], *,
                  match: Callable[[torch.Tensor], int] = torch.Tensor.data_ptr):
    """An optimizer of `optimizer`'s class (a set: of each member's) over a subset of its tensors, found by
    `match` (their address by default; `id` for tensors that are re-pointed, as whole-parameter stand-ins
    are), sharing its state dict.

    Returns (sub, index): `index[i]` is the script param group that sub group i mirrors; call
    `sync_hyperparams` before each step so schedulers' changes reach it. None when nothing matches.
    """
    wanted = {match(t) for t in tensors}
    if isinstance(optimizer, OptimizerSet):  # a sub-optimizer per member, as one set
        subs, index, base = [], [], 0
        for m in optimizer.members:
            sub, idx = sub_optimizer(m, [t for g in m.param_groups for t in g["params"] if match(t) in wanted],
                                     match=match)
            if sub is not None:
                subs.append(sub)
                index.extend(base + i for i in idx)
            base += len(m.param_groups)
        return (OptimizerSet(subs), index) if subs else (None, [])
    groups, index = [], []
    for i, pg in enumerate(optimizer.param_groups):
        mine = [t for t in pg["params"] if match(t) in wanted]
        if mine:
            groups.append({**{k: v for k, v in pg.items() if k != "params"}, "params": mine})
            index.append(i)
    if not groups:
        return None, []
    # Every group carries all its settings; the constructor gets the script's own (transformers' Adafactor
    # refuses an lr beside its default relative_step=True), so its checks see what the script built.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    sub = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"})
    sub.state = optimizer.state  # one state dict: checkpoints and inspection see every piece
    return sub, index


def sync_hyperparams(sub: torch.optim.Optimizer, index: list[int], source) -> None:
    """Copy lr & co. into `sub` from `source`: the script's optimizer, or a list of its groups' settings."""
    groups = source.param_groups if isinstance(source, torch.optim.Optimizer) else source
    for sg, i in zip(sub.param_groups, index):
        for k, v in groups[i].items():
            if k != "params":
                sg[k] = v


def master_pieces(g: FlatGroup) -> list[torch.Tensor]:
    return [g.master[p.shard_offset:p.shard_offset + p.length] for p in g.layout.pieces(g.placement.rank)]


def bind_grads(optimizer: torch.optim.Optimizer, g: FlatGroup, grad: torch.Tensor | None) -> None:
    """Give `g`'s master pieces in `optimizer` their views of `grad` (a tensor shaped like `g.grad_shard`),
    or none (`grad` None)."""
    base = g.master.data_ptr()
    for pg in optimizer.param_groups:
        for t in pg["params"]:
            off = (t.data_ptr() - base) // t.element_size()
            if 0 <= off < g.master.numel():
                t.grad = None if grad is None else grad[off:off + t.numel()]


def unused_pieces(g: FlatGroup, unused: frozenset[int] | None = None) -> list[torch.Tensor]:
    """`g`'s master pieces of the parameters in `unused` (default: `g.unused`, the parameters no rank gave a
    gradient this window; see [Note: parameters without a gradient] in zerofit.engine.unused_params)."""
    unused = g.unused if unused is None else unused
    return [t for index, t in g.piece_masters if index in unused] if unused else []


@contextlib.contextmanager
def without_grads(pieces: list[torch.Tensor]) -> Iterator[None]:
    """Inside: `pieces` have no gradient, so torch's optimizers skip them - no decay, no moment update, no
    step count - as they skip any parameter whose `.grad` is None; their gradients come back after."""
    saved = [(t, t.grad) for t in pieces]
    for t, _ in saved:
        t.grad = None
    try:
        yield
    finally:
        for t, grad in saved:
            t.grad = grad


def mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell LR schedulers built on `optimizer` that it stepped, when the engine stepped its pieces through
    smaller optimizers (torch's schedulers warn about a scheduler step before the first optimizer step
    by reading this flag, which their wrapper of `optimizer.step` sets)."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


def local_grad_sumsq(groups: list[FlatGroup], device: torch.device) -> torch.Tensor:
    """Sum of squared gradient elements of this rank's shards (fp32, on `device`).

    Offloaded shards are summed where they live (or taken from the norm measured on the device on
    their way down); only one scalar per device moves.
    """
    total = torch.zeros((), dtype=torch.float32, device=device)
    measured = [g.device_sumsq for g in groups if g.device_sumsq is not None]
    if measured:
        total += torch.stack(measured).sum()
    rest = [g for g in groups if g.device_sumsq is None]
    for shards in _by_device(rest).values():
        wide = [s for s in shards if s.dtype == torch.float32]
        if wide:
            total += torch.stack(torch._foreach_norm(wide, 2.0)).square().sum().to(device)
        for s in shards:  # compact (compute-dtype) shards: the norm in fp32, never rounded to bf16
            if s.dtype != torch.float32:
                total += torch.linalg.vector_norm(s, dtype=torch.float32).square().to(device)
    return total


def global_grad_sumsq(groups: list[FlatGroup], comm: Collectives, device: torch.device) -> torch.Tensor:
    """Sum of squared gradient elements over every rank's shards (one scalar all-reduce when sharded)."""
    sumsq = local_grad_sumsq(groups, device)
    if any(g.placement.shard_world > 1 for g in groups):
        comm.all_reduce_now(sumsq, "grad_norm")
    return sumsq


def folds_grad_scale(optimizer: torch.optim.Optimizer | None) -> bool:
    """True when `optimizer`'s fused kernels can divide the gradients by a scale themselves.

    Torch's fused Adam/AdamW/SGD read an optional `grad_scale` tensor (the hook AMP's GradScaler
    uses) and divide every gradient by it inside the update: unscaling and clipping then cost no
    extra pass over the gradients - which matters when they sit in host memory.
    """
    return (optimizer is not None and type(optimizer).__name__ in ("Adam", "AdamW", "SGD")
            and all(g.get("fused") for g in optimizer.param_groups))


def step_with_factor(optimizer: torch.optim.Optimizer, factor: torch.Tensor | float | None) -> None:
    """`optimizer.step()` on gradients multiplied by `factor` (folded into the kernel, see above)."""
    if factor is None or (not isinstance(factor, torch.Tensor) and factor == 1.0):
        optimizer.step()
        return
    device = next((t.device for g in optimizer.param_groups for t in g["params"]), torch.device("cpu"))
    inverse = 1.0 / factor if isinstance(factor, torch.Tensor) else torch.tensor(1.0 / factor)
    optimizer.grad_scale = inverse.to(device=device, dtype=torch.float32)
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale


def scale_grads(groups: list[FlatGroup], factor: torch.Tensor | float) -> None:
    """Multiply the gradient shards by `factor` in place (compact ones are scaled as they are upcast)."""
    for dev, shards in _by_device([g for g in groups if not g.compact]).items():
        f = factor.to(dev) if isinstance(factor, torch.Tensor) else factor
        torch._foreach_mul_(shards, f)

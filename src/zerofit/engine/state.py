"""The engine's training state as per-parameter fragments, the unit checkpoints are made of.

A rank's flat shards cut parameters at arbitrary element offsets. `local_fragments` turns them back
into the natural coordinates: for every parameter, the contiguous run of its flattened elements this
rank holds, with views of the fp32 master and of every optimizer state tensor over exactly that run.
A checkpoint written as "parameter name -> chunks of a 1-D tensor of `numel` elements" reloads at
any world size, stage or layout: the loader asks for its own fragments and reads whatever chunks
overlap them. Writing into the views writes into the engine.

[Note: per-block state]
Optimizer state stored in 8 bits ([Note: narrow optimizer state] in zerofit.engine.state_codec) keeps,
beside each per-element key K (uint8 codes, one per element), `K + SCALE_SUFFIX`: one fp32 absmax per block
of BLOCK (16) elements of the piece. Pieces start at multiples of 16 of their parameter, so a piece's
blocks are its parameter's blocks from `start // 16` on, and the absmax of a parameter is a tensor of its
own of `blocks(numel)` elements (the last block may be partial) that reshards like per-element state with
a stride of 16: a fragment of elements [start, start + length) holds the blocks whose first element it
holds, [ceil(start / 16), ceil((start + length) / 16)) (`Fragment.span`). Every block is thereby held by
exactly one fragment however the elements are cut, also where `writer_fragments` cuts a replicated
parameter at an arbitrary element.

Ranks holding replicated state (stage 0, unsharded units) report the whole parameter on rank 0 only,
so every element is owned by exactly one rank; a checkpoint's writers share those out instead
(`writer_fragments`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.offload.stored_homes import SCALE_SUFFIX, is_scale_key
from zerofit.engine.state_codec import BLOCK, Codec, blocks


def per_element(key: str, value, numel: int) -> bool:
    """`value` is per-element state of a piece of `numel` elements (or its per-block scales), not scalar state."""
    want = blocks(numel) if is_scale_key(key) else numel
    return isinstance(value, torch.Tensor) and value.ndim == 1 and value.numel() == want


def _block_slice(start: int, lo: int, hi: int) -> slice:
    """The blocks, counted in a run starting at element `start` of its parameter (a multiple of 16, or the
    run's first block is the one after it), held by elements [start + lo, start + hi) of it."""
    first = -(-start // BLOCK)
    return slice(-(-(start + lo) // BLOCK) - first, -(-(start + hi) // BLOCK) - first)


@dataclass
class Fragment:
    """This rank's run [start, start + length) of one flattened parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    """The parameter's compute dtype (what the model sees)."""
    numel: int
    start: int
    length: int
    trainable: bool
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """'master' (fp32) or 'param' (frozen, compute dtype), plus optimizer state tensors by state key."""
    group: int = 0
    """Optimizer param group of the parameter."""
    state: dict = field(default_factory=dict)
    """The optimizer state of the piece the run lies in (live: scalars written here reach the optimizer)."""

    def span(self, key: str) -> tuple[int, int]:
        """(first element, elements of the whole parameter) of `tensors[key]` in its checkpoint tensor: the
        parameter's elements, or for block scales its blocks ([Note: per-block state])."""
        if is_scale_key(key):
            return -(-self.start // BLOCK), blocks(self.numel)
        return self.start, self.numel

    def cut(self, lo: int, hi: int) -> Fragment:
        """Elements [start + lo, start + hi) of this run, with views of its tensors over them."""
        return dataclasses.replace(
            self, start=self.start + lo, length=hi - lo,
            tensors={k: t[_block_slice(self.start, lo, hi) if is_scale_key(k) else slice(lo, hi)]
                     for k, t in self.tensors.items()})


def _piece_state(optimizer, master: torch.Tensor) -> dict:
    return optimizer.state.get(master, {}) if optimizer is not None else {}


def local_fragments(groups: list[FlatGroup], optimizer: torch.optim.Optimizer | None,
                    rank: int) -> list[Fragment]:
    """Every parameter run this rank owns, with views into its master/param and optimizer state."""
    for hook in {id(g.before_read): g.before_read for g in groups if g.before_read is not None}.values():
        hook()  # NVMe-offloaded state is brought into memory first (see zerofit.engine.offload.nvme)
    out: list[Fragment] = []
    for g in groups:
        if g.placement.shard_world == 1 and rank != 0:
            continue  # replicated: rank 0 speaks for everyone
        lay = g.layout
        pieces = lay.pieces(g.placement.rank)
        piece_masters = {}
        if g.trainable:
            for opt_group in (optimizer.param_groups if optimizer is not None else []):
                for t in opt_group["params"]:
                    piece_masters[t.data_ptr()] = t
        for o in lay.overlaps(g.placement.rank):
            sl = slice(o.shard_offset, o.shard_offset + o.length)
            frag = Fragment(name=g.names[o.index], shape=tuple(g.shapes[o.index]), dtype=g.compute_dtype,
                            numel=lay.numels[o.index], start=o.param_start, length=o.length,
                            trainable=g.trainable, group=lay.groups[o.index])
            if not g.trainable:
                frag.tensors["param"] = g.param_shard[sl]
            else:
                frag.tensors["master"] = g.master[sl]
                piece = next(p for p in pieces if p.shard_offset <= o.shard_offset < p.shard_offset + p.length)
                piece_master = piece_masters.get(g.master[piece.shard_offset:].data_ptr())
                state = _piece_state(optimizer, piece_master) if piece_master is not None else {}
                frag.state = state
                rel = slice(o.shard_offset - piece.shard_offset, o.shard_offset - piece.shard_offset + o.length)
                for key, value in state.items():
                    if per_element(key, value, piece.length):
                        frag.tensors[key] = value[_block_slice(0, rel.start, rel.stop) if is_scale_key(key) else rel]
            out.append(frag)
    return out


def writer_fragments(groups: list[FlatGroup], optimizer: torch.optim.Optimizer | None, rank: int,
                     world: int, *, among: list[FlatGroup] | None = None) -> list[Fragment]:
    """The runs rank `rank` of `world` writes into a checkpoint: its own of the sharded groups, and its 1/world
    of the replicated groups' elements (in group order, cut where the share ends, so a large parameter may be
    written by two ranks). Every rank holds the replicated ones; rank 0 writing them alone made it the whole
    checkpoint's wait at stages 0-2 (a frozen base, or every weight at stage 0). Every element is still
    written by exactly one rank. `among`: every group of the checkpoint, of which `groups` are the ones read now
    (a save that reads a few groups at a time; the shares are cut over `among`)."""
    out = local_fragments([g for g in groups if g.placement.shard_world > 1], optimizer, rank)
    replicated = [g for g in (groups if among is None else among) if g.placement.shard_world == 1]
    starts, total = {}, 0
    for g in replicated:  # where each group's elements begin in the replicated groups' order
        starts[id(g)], total = total, total + _held(g)
    lo, hi = total * rank // world, total * (rank + 1) // world
    reading = {id(g) for g in groups}
    mine = [g for g in replicated if id(g) in reading and lo < starts[id(g)] + _held(g) and starts[id(g)] < hi]
    frags = iter(local_fragments(mine, optimizer, 0))  # in group order, each group's summing to `_held`
    for g in mine:
        at, end = starts[id(g)], starts[id(g)] + _held(g)
        while at < end:
            f = next(frags)
            a, b = max(lo, at) - at, min(hi, at + f.length) - at
            if a < b:
                out.append(f.cut(a, b))
            at += f.length
    return out


def _held(g: FlatGroup) -> int:
    """Elements of parameters the shard of `g` holds (what `local_fragments` gives for it)."""
    return sum(o.length for o in g.layout.overlaps(g.placement.rank))


def optimizer_scalars(optimizer: torch.optim.Optimizer | None) -> list[dict]:
    """Per param group: hyperparameters and the scalar state (e.g. Adam's `step`) of its first piece that has
    some (a parameter whose own differs is kept apart: `fragment_scalars`, `differing_scalars`)."""
    if optimizer is None:
        return []
    out = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        scalars: dict = {}
        for t in group["params"]:
            if hasattr(t, "_zerofit_whole"):  # a whole parameter's stand-in: its state is saved whole
                continue
            for key, value in optimizer.state.get(t, {}).items():
                if not per_element(key, value, t.numel()):
                    scalars[key] = value
            if scalars:
                break
        out.append({"hyper": hyper, "scalars": scalars})
    return out


def scalar_values(state: dict) -> dict[str, float]:
    """The scalar state of one piece (Adam's `step`) as numbers; per-element state (1-D tensors) is left out."""
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.ndim == 0:
            out[key] = value.item()
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value
    return out


def fragment_scalars(fragments: list[Fragment]) -> dict[str, dict[str, float]]:
    """Parameter name -> the scalar state of its piece, for this rank's trainable fragments. Each parameter
    keeps a step count of its own (one no rank gave a gradient is not stepped), which a checkpoint keeps."""
    return {f.name: values for f in fragments if f.trainable and (values := scalar_values(f.state))}


def differing_scalars(per_param: dict[str, dict[str, float]], groups: list[dict],
                      group_of: dict[str, int]) -> dict[str, dict[str, float]]:
    """The entries of `per_param` that differ from their param group's scalars (`groups`: what the checkpoint
    keeps per group, as `optimizer_scalars` gives it)."""
    common = [scalar_values(g["scalars"]) for g in groups]
    return {name: values for name, values in per_param.items()
            if group_of.get(name, -1) < len(common) and values != common[group_of[name]]}


def restore_param_scalars(fragments: list[Fragment], saved: dict[str, dict[str, float]]) -> None:
    """Write each saved parameter's scalar state into its pieces' optimizer state (after
    `allocate_optimizer_state` gave every piece its group's)."""
    for f in fragments:
        values = saved.get(f.name)
        if not values or not f.trainable:
            continue
        for key, value in values.items():
            old = f.state.get(key)
            f.state[key] = (torch.tensor(value, dtype=old.dtype, device=old.device) if isinstance(old, torch.Tensor)
                            else value)


def allocate_optimizer_state(optimizer: torch.optim.Optimizer, tensor_keys: list[str],
                             scalars: list[dict], codec: Codec | None = None) -> None:
    """Give every master piece zeroed state tensors under `tensor_keys` and each group's scalar state,
    so a checkpoint can be read into the views `local_fragments` then returns (fresh optimizers create
    their state only on the first step). `codec`: the form the state is stored in (default fp32, as the
    optimizer makes it); 8-bit adds each key's block scales ([Note: per-block state])."""
    for group, saved in zip(optimizer.param_groups, scalars):
        for t in group["params"]:
            if hasattr(t, "_zerofit_whole"):  # a whole parameter's stand-in: see zerofit.checkpoint.whole_state
                continue
            state = optimizer.state[t]
            for key in tensor_keys:
                if codec is None or not codec.narrow:
                    state.setdefault(key, torch.zeros_like(t, memory_format=torch.preserve_format))
                    continue
                stored = codec.empty(t.numel(), t.device)
                codec.encode(torch.zeros(t.numel(), device=t.device), stored, key)  # the code of 0.0, not code 0
                state.setdefault(key, stored.codes)
                if stored.scale is not None:
                    state.setdefault(key + SCALE_SUFFIX, stored.scale)
            for key, value in saved.get("scalars", {}).items():
                state[key] = value.clone().to(t.device) if isinstance(value, torch.Tensor) else value

"""Consolidated weights from a live engine: the full state dict, or HF files written by rank 0.

Both walk the engine's flat groups in order and take one group (one unit's trainable or frozen
parameters) at a time, cutting it into parameters. Where a group is split over the ranks it is
gathered: to rank 0 alone for the files `save_consolidated` writes and for the state dict of a
stage-3 model, to every rank for the state dict of a stage 0-2 model (see `full_state_dict`). A tied
weight appears once, under its first name (safetensors refuses shared tensors, and `from_pretrained`
ties them again), except in the state dict `Accelerator.get_state_dict` returns.

[Note: saved dtype]
Weights are saved in the dtype each parameter had when `prepare()` received it (`FlatGroup.arrived`):
a model loaded with `from_pretrained(..., dtype=torch.bfloat16)` is saved in bf16, as it was loaded
and as DDP or DeepSpeed save it; a model built in fp32 is saved in fp32 even when it trained under bf16
mixed precision. The values are read where the engine holds them exactly: from the fp32 master when
a parameter's own dtype is wider than (or differs from) a low-precision compute dtype, else from the
compute copy, which equals the master rounded to that dtype (and is half the bytes to gather). A
frozen parameter has no master: it is saved from its compute copy, in its own dtype. A resumable
run keeps its fp32 masters in `save_state`, whatever this writes.

[Note: export gathers in pieces]
A group split over the ranks is gathered into host memory, never whole onto a GPU: one unit's fp32
master can be gigabytes (a 128k x 4096 embedding: 2 GiB) on top of the training state the GPU still
holds. NCCL gathers only device tensors, so the group is gathered in pieces of at most
`GATHER_PIECE_BYTES` on the device (each rank's next slice of its shard, side by side), each piece
copied into the host buffer before the next is gathered. Every rank takes the same pieces (their size
follows from the group's layout and the world size alone), so the ranks issue the same collectives.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from zerofit.checkpoint.export import ShardWriter, parse_size, plan_shards, save_hf_configs
from zerofit.checkpoint.inventory import buffer_entries, param_entries, persistent_buffers
from zerofit.checkpoint.ranks import Ranks
from zerofit.distributed import arrival
from zerofit.distributed.failures import named
from zerofit.engine.comm import all_gather_flat

GATHER_PIECE_BYTES = 64 * 2**20
"""The most device memory one gather of a split group takes on a receiving rank ([Note: export gathers in
pieces]): small beside a GPU's training state, large enough that a piece's collective is not dominated by
its latency."""


def reads_master(g) -> bool:
    """The group's saved values come from its fp32 master (see [Note: saved dtype])."""
    return (g.trainable and g.master is not None and g.compute_dtype != torch.float32
            and any(d != g.compute_dtype for d in g.arrived))


def _source(g) -> tuple[torch.Tensor, bool]:
    """Where the group's saved values are read ([Note: saved dtype]), and whether that tensor is split over
    the ranks (then `_whole_group` gathers it: a collective)."""
    if reads_master(g):
        return g.master, g.placement.shard_world > 1
    if g.placement.shard_params:
        return g.param_shard, g.placement.shard_world > 1
    return g.param_flat, False  # whole on every rank (stages 0-2)


def _whole_group(g, ranks: Ranks, device: torch.device, *, everywhere: bool) -> torch.Tensor | None:
    """The group's whole padded flat buffer in its source dtype, on every rank where `everywhere`, else on
    rank 0 alone (None on the others): gathered into host memory where the source is split over the ranks
    ([Note: export gathers in pieces]), else the live `param_flat` itself (stages 0-2)."""
    local, split = _source(g)
    if not split:
        return local if everywhere or ranks.is_main else None
    return _gather_to_host(local, ranks, device, everywhere=everywhere, label=f"export:{g.unit_name or 'root'}")


def piece_numel(world: int, element_size: int) -> int:
    """Elements of each rank's slice in one gathered piece: `world` slices together fit `GATHER_PIECE_BYTES`."""
    return max(1, GATHER_PIECE_BYTES // (world * element_size))


def _gather_to_host(shard: torch.Tensor, ranks: Ranks, device: torch.device, *, everywhere: bool,
                    label: str) -> torch.Tensor | None:
    """Every rank's `shard` (equal sizes) concatenated in rank order, a new CPU tensor on every rank where
    `everywhere`, else on rank 0 alone (None on the others), gathered through `device` in pieces of at most
    `GATHER_PIECE_BYTES` ([Note: export gathers in pieces])."""
    world, per_rank = ranks.world, shard.numel()
    receives = everywhere or ranks.is_main
    step = min(piece_numel(world, shard.element_size()), per_rank)
    full_cpu = torch.empty(world * per_rank, dtype=shard.dtype) if receives else None
    piece_dev = torch.empty(world * step, dtype=shard.dtype, device=device) if receives else None
    for start in range(0, per_rank, step):
        n = min(step, per_rank - start)
        send = shard[start:start + n].to(device)  # a copy up only where the shard lives on the host (offloaded)
        recv = piece_dev[:world * n].view(world, n) if piece_dev is not None else None  # rank r's slice: row r
        with named(ranks.prefix + label, ranks.rank):
            if everywhere:
                all_gather_flat(piece_dev[:world * n], send, group=ranks.group)
            else:
                dist.gather(send, list(recv.unbind(0)) if recv is not None else None, dst=ranks.dst0(),
                            group=ranks.group)
        if full_cpu is not None:
            full_cpu.view(world, per_rank)[:, start:start + n].copy_(recv)
    return full_cpu


def iter_full_tensors(engine, model: nn.Module | None = None, *, everywhere: bool = False,
                      trainable_everywhere: bool = False,
                      names: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective generator: (name, full CPU copy in its saved dtype) for every parameter and persistent
    buffer, on rank 0 (every rank where `everywhere`; the trainable parameters on every rank where
    `trainable_everywhere`); nothing else on the others. Every rank must exhaust it (it gathers as it
    goes). Copies, never views of the live tensors: what a caller keeps is a snapshot that later steps
    do not change (a "best weights so far" dict stays the best). `names`: only these (the same on every
    rank): a group holding none of them is neither gathered nor copied."""
    model = model if model is not None else engine.model
    ranks = Ranks(engine.comm.group)
    # offloaded masters readable: host steps finished; an NVMe group read in while its tensors are copied out, one
    # at a time ([Note: saving from NVMe] in zerofit.engine.offload.nvme)
    with engine.state_by_group() as scope:
        for g in _groups_holding(engine, names):
            with scope(g) or contextlib.nullcontext():
                full = _whole_group(g, ranks, engine.device,
                                    everywhere=everywhere or (trainable_everywhere and g.trainable))
                if full is None:
                    continue
                for name, off, n, shape, dtype in zip(g.names, g.layout.offsets, g.layout.numels, g.shapes,
                                                      g.arrived):
                    if names is None or name in names:
                        yield name, full[off:off + n].view(shape).to("cpu", dtype=dtype, copy=True)
                del full
    if everywhere or ranks.is_main:
        for name, buf in persistent_buffers(model):
            if names is None or name in names:
                yield name, buf.detach().to("cpu", copy=True)


def _groups_holding(engine, names: Collection[str] | None) -> list:
    """The engine's flat groups, in order; with `names`, those holding at least one of them."""
    return [g for g in engine.groups if names is None or any(n in names for n in g.names)]


def full_state_dict(engine, model: nn.Module | None = None, *, every_tied_key: bool = False,
                    keys: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """Collective: the consolidated state dict (keys in the model's state-dict order), in the saved
    dtypes of [Note: saved dtype].
    - Stages 0-2 (parameters whole on every rank): the full dict on every rank, as Accelerate gives it
      (a CPU snapshot per rank, as Accelerate under DeepSpeed ZeRO-1/2 makes; fp32 masters split over the
      ranks are gathered to each).
    - Stage 3: full CPU tensors on rank 0 only, gathered unit by unit; on the other ranks every key maps
      to a tensor on the meta device of the right shape and dtype, so key filters (PEFT's) and
      `save_pretrained(..., is_main_process=False)` work there without a private full copy (writing
      those tensors fails: they hold no values). An adapter's trainable parameters come in full on every
      rank ([Note: adapters everywhere] in zerofit.engine.full_state).
    A tied weight appears once, under its first name, unless `every_tied_key`: then under each name
    `model.state_dict()` gives it, one tensor for all (what a strict `load_state_dict` into a plain
    model of the same class needs). `keys` (the same on every rank): only the entries of these keys (a
    tied weight's other names count as its own), and only the groups holding them gathered or copied -
    what saving a PEFT adapter needs of a large frozen base ([Note: an adapter's save gathers the adapter]
    in zerofit.integrations.adapter_keys)."""
    model = model if model is not None else engine.model
    live = model.state_dict(keep_vars=True)  # the parameters and buffers themselves: no gather
    names = None
    if keys is not None:  # every name of each tensor asked for, so a tied weight asked by its other name is found
        asked = {id(live[k]) for k in keys if k in live}
        names = {k for k, t in live.items() if id(t) in asked}
    if any(_source(g)[1] for g in _groups_holding(engine, names)):  # it gathers: every rank must be here too
        arrival.check_in(arrival.GET_STATE_DICT)
    everywhere = not engine.shards_parameters
    adapter = engine.shards_parameters and engine.full_state.adapter
    out = dict(iter_full_tensors(engine, model, everywhere=everywhere, trainable_everywhere=adapter, names=names))
    if not everywhere and engine.comm.rank != 0:  # stage 3, off rank 0: placeholders without storage
        saved = {name: dtype for g in engine.groups for name, dtype in zip(g.names, g.arrived)}
        have = {id(live[k]) for k in out if k in live}
        for k, t in live.items():
            if id(t) not in have and (names is None or k in names):  # a tied weight once, under its first name
                have.add(id(t))
                out[k] = torch.empty(t.shape, dtype=saved.get(k, t.dtype), device="meta")
    if every_tied_key:
        first: dict[int, str] = {}
        for k, t in live.items():
            if k in out:
                first.setdefault(id(t), k)
        for k, t in live.items():
            if k not in out and id(t) in first:
                out[k] = out[first[id(t)]]
    order = [k for k in live if k in out]
    return {k: out[k] for k in order} | out


def save_consolidated(engine, model: nn.Module | None, directory: str | os.PathLike[str], *,
                      max_shard_size: int | str = "5GB", safe_serialization: bool = True) -> None:
    """Collective: write the model's consolidated weights to `directory` as `from_pretrained` reads
    them (plus `config.json` when the model has a Hugging Face config), one shard file at a time."""
    model = model if model is not None else engine.model
    arrival.check_in(arrival.SAVE_MODEL)  # collective from here: every rank must be here too
    ranks = Ranks(engine.comm.group)
    out = Path(directory)
    plan = plan_shards(param_entries(engine, saved=True) + buffer_entries(model), parse_size(max_shard_size))
    writer, error = None, None
    if ranks.is_main:
        try:
            writer = ShardWriter(out, plan, safe=safe_serialization)
        except Exception as e:  # every failure must reach the agreement: peers wait in collectives
            error = f"{out}: cannot write the export ({e}): check the path and free space"
    ranks.agree(error)
    for name, tensor in iter_full_tensors(engine, model):
        if writer is not None and error is None:  # keep gathering after a failure: peers are waiting
            try:
                writer.add(name, tensor)
            except Exception as e:
                error = f"{out}: writing the export failed at {name} ({e}): check free space"
    if writer is not None and error is None:
        try:
            writer.finish()
            save_hf_configs(model, out)
        except Exception as e:
            error = f"{out}: finishing the export failed ({e})"
    ranks.agree(error)


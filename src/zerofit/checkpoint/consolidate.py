"""Consolidated weights from a live engine: the full state dict on rank 0, or HF files written by it.

Both walk the engine's flat groups in order and gather one group (one unit's trainable or frozen
parameters) at a time to rank 0, which cuts it into parameters and drops it. Rank 0 therefore never
holds more than one unit's gathered buffer beyond what it is about to return or write:
`full_state_dict` keeps everything by nature; `save_consolidated` keeps at most the shard file being
filled. Trainable parameters come from the fp32 masters, frozen ones in the compute dtype, buffers
as they are; a tied weight appears once, under its first name (safetensors refuses shared tensors,
and `from_pretrained` ties them again), except in the state dict `Accelerator.get_state_dict` returns.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from zerofit.checkpoint.export import ShardWriter, parse_size, plan_shards, save_hf_configs
from zerofit.checkpoint.inventory import buffer_entries, param_entries, persistent_buffers
from zerofit.checkpoint.ranks import Ranks
from zerofit.dist import arrival


def _gather_group(g, ranks: Ranks, device: torch.device) -> torch.Tensor | None:
    """The group's whole padded flat buffer (fp32 master or frozen param) on rank 0, None elsewhere."""
    local = g.master if g.trainable else g.param_shard
    if g.placement.shard_world == 1:
        return local if ranks.is_main else None  # replicated: rank 0 already holds all of it
    send = local.to(device).contiguous()
    full = torch.empty(g.layout.padded_numel, dtype=send.dtype, device=device) if ranks.is_main else None
    parts = list(full.chunk(ranks.world)) if full is not None else None
    dist.gather(send, parts, dst=ranks.dst0(), group=ranks.group)
    return full


def iter_full_tensors(engine, model: nn.Module | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective generator: yields (name, full CPU tensor) on rank 0, nothing elsewhere; every rank
    must exhaust it (it gathers as it goes)."""
    model = model if model is not None else engine.model
    ranks = Ranks(engine.comm.group)
    engine.settle()  # offloaded masters readable: host steps finished, NVMe groups materialised
    for g in engine.groups:
        full = _gather_group(g, ranks, engine.device)
        if full is None:
            continue
        for name, off, n, shape in zip(g.names, g.layout.offsets, g.layout.numels, g.shapes):
            yield name, full[off:off + n].view(shape).to("cpu", copy=True)
        del full
    if ranks.is_main:
        for name, buf in persistent_buffers(model):
            yield name, buf.detach().to("cpu", copy=True)


def full_state_dict(engine, model: nn.Module | None = None, *, every_tied_key: bool = False
                    ) -> dict[str, torch.Tensor]:
    """Collective: the consolidated state dict on rank 0 (keys in the model's state-dict order), {} on
    the other ranks. A tied weight appears once, under its first name, unless `every_tied_key`: then
    under each name `model.state_dict()` gives it, one tensor for all (what a strict
    `load_state_dict` into a plain model of the same class needs)."""
    model = model if model is not None else engine.model
    if any(g.placement.shard_world > 1 for g in engine.groups):  # it gathers: every rank must be here too
        arrival.check_in(arrival.GET_STATE_DICT)
    out = dict(iter_full_tensors(engine, model))
    if not out:
        return out
    live = model.state_dict(keep_vars=True)  # the parameters and buffers themselves: no gather
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
    plan = plan_shards(param_entries(engine) + buffer_entries(model), parse_size(max_shard_size))
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


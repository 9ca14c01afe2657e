"""The optimizer state of parameters stepped whole, in a checkpoint.

A per-parameter optimizer's state (Adafactor's row and column factors, Muon's momentum) belongs to a
whole parameter on its owner rank ([Note: whole-parameter steps] in zerofit.engine.whole_step), not to
flat pieces, so it is not one of the per-element fragments the rest of a checkpoint is made of. Each
owner writes every state tensor of its parameters whole, flattened, as the chunk
`whole:<state key>/<parameter name>`; the common record keeps each one's shape and dtype, and the plain
numbers (a step count kept as a Python number). Loading gives each parameter's state to its owner in
the loading run, whatever rank held it before: owners are a function of the world size, not a property
of the checkpoint, so the world size and stage may change between save and load.
"""

from __future__ import annotations

import torch

from zerofit.checkpoint.chunks import Chunk

PREFIX = "whole:"


def _stand_ins(engine) -> dict[str, torch.Tensor]:
    step = getattr(engine, "whole_step", None)
    return step.named_stand_ins() if step is not None else {}


def chunks_to_save(engine) -> tuple[dict[str, Chunk], dict[str, dict]]:
    """(chunks this rank writes, {name: {"tensors": {key: [shape, dtype]}, "numbers": {key: value}}})."""
    chunks: dict[str, Chunk] = {}
    records: dict[str, dict] = {}
    for name, stand_in in _stand_ins(engine).items():
        state = engine.optimizer.state.get(stand_in, {})
        record: dict = {"tensors": {}, "numbers": {}}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                flat = value.detach().reshape(-1).contiguous()
                chunks[f"{PREFIX}{key}/{name}"] = Chunk(flat, 0, flat.numel())
                record["tensors"][key] = [list(value.shape), str(value.dtype).removeprefix("torch.")]
            elif isinstance(value, (int, float, bool)):
                record["numbers"][key] = value
        if state:
            records[name] = record
    return chunks, records


def chunks_to_load(engine, records: dict[str, dict]) -> dict[str, Chunk]:
    """Give this rank's stand-ins their saved state (allocated here) and return the chunks to read into it.
    A parameter with no record (never stepped when saved) starts with no state, as a fresh optimizer does."""
    chunks: dict[str, Chunk] = {}
    for name, stand_in in _stand_ins(engine).items():
        record = records.get(name)
        state: dict = {}
        if record is not None:
            state.update(record["numbers"])
            for key, (shape, dtype) in record["tensors"].items():
                value = torch.empty(shape, dtype=getattr(torch, dtype), device=stand_in.device)
                state[key] = value
                chunks[f"{PREFIX}{key}/{name}"] = Chunk(value.view(-1), 0, value.numel())
        engine.optimizer.state[stand_in] = state
    return chunks

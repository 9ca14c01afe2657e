"""`merge`: a sharded checkpoint to consolidated Hugging Face weight files, offline, in one process.

What `zerofit merge CKPT OUT` runs. It needs no process group, no GPU and no model code: the
checkpoint's parameter table says what to write, and each output shard's tensors are read whole
from the saved chunks (only the byte ranges they occupy), written, and dropped. The files are the
ones `save_consolidated` writes from a live engine: same names, shards and values.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from zerofit.checkpoint.chunks import Chunk, read_chunks
from zerofit.checkpoint.commit import LATEST, is_checkpoint, resolve
from zerofit.checkpoint.export import ShardWriter, parse_size, plan_shards
from zerofit.checkpoint.inventory import Entry, dtype_of
from zerofit.checkpoint.manifest import MANIFEST
from zerofit.checkpoint.ranks import Ranks
from zerofit.checkpoint.sharded import COMMON, HF_CONFIG_DIR, STATE_DIR, read_common, verify
from zerofit.errors import CheckpointError

TRAINER_STATE = "zerofit_state"
"""The folder inside a Trainer's `checkpoint-N/` that holds zerofit's checkpoint
(`zerofit.integrations.transformers.ZEROFIT_STATE`, named here so merging needs no transformers)."""


def merge_source(directory: str | os.PathLike[str]) -> tuple[Path, str]:
    """The checkpoint `zerofit merge DIRECTORY` merges, and a line saying how it was found ('' when
    DIRECTORY is it or names it with `latest`).

    Besides what `resolve` takes, the two folders a zerofit Trainer writes: its `checkpoint-N/` (the
    checkpoint is `checkpoint-N/zerofit_state/`) and its output folder (Trainer's rotation keeps several
    `checkpoint-N/`: the highest N is the newest)."""
    path = Path(directory)
    if (path / TRAINER_STATE).is_dir() and not (path / MANIFEST).is_file():
        return resolve(path / TRAINER_STATE), ""
    if not path.is_dir() or (path / MANIFEST).is_file() or (path / LATEST).is_file():
        return resolve(path), ""
    steps = [c for c in path.glob("checkpoint-*")
             if c.name.removeprefix("checkpoint-").isdigit() and is_checkpoint(c / TRAINER_STATE)]
    if not steps:
        weights = [n for n in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
                   if (path / n).is_file()]
        if weights:
            raise CheckpointError(f"{path} holds no zerofit checkpoint but already-merged weights ({weights[0]}, as "
                                  "save_model / save_pretrained write them): load it with from_pretrained; "
                                  "zerofit merge takes a folder written by save_state or a Trainer's checkpoint-N")
        return resolve(path), ""
    steps.sort(key=lambda c: int(c.name.removeprefix("checkpoint-")))
    newest = steps[-1] / TRAINER_STATE
    others = ", ".join(c.name for c in steps[:-1])
    said = f"merging {newest}: the newest of the Trainer checkpoints in {path}"
    said += f" (also {others}: pass one of them to merge it instead)" if others else ""
    return newest, said


def merge(checkpoint_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
          max_shard_size: int | str = "5GB", safe_serialization: bool = True) -> list[str]:
    """Write the consolidated weights of the checkpoint at `checkpoint_dir` (or the one `merge_source`
    finds there) into `out_dir`, with the model's `config.json` when it was saved; returns the file names."""
    path, _ = merge_source(checkpoint_dir)
    verify(path, Ranks(None, local=True))
    common = read_common(path)
    source = str(path / f"{COMMON}.json")
    if common.get("frozen_excluded"):  # [Note: a checkpoint without the frozen weights] in zerofit.checkpoint.sharded
        frozen = sum(d["kind"] == "param" for d in common["params"])
        raise CheckpointError(
            f"{source}: saved with exclude_frozen_parameters, it holds no values for the model's {frozen} frozen "
            "parameters, so it cannot be merged into full weights: load the base model, prepare it, "
            "load_state this checkpoint and call accelerator.save_model (or save the adapter with "
            "save_pretrained)")
    entries = [Entry.from_json(d, source) for d in [*common["params"], *common["buffers"]]]
    plan = plan_shards(entries, parse_size(max_shard_size))
    out = Path(out_dir)
    writer = ShardWriter(out, plan, safe=safe_serialization)
    for shard in plan:
        chunks = {f"{e.kind}/{e.name}": Chunk(torch.empty(e.numel, dtype=dtype_of(e.dtype, source)), 0, e.numel)
                  for e in shard if e.numel}
        read_chunks(path / STATE_DIR, chunks, None, no_dist=True)
        for e in shard:
            c = chunks.get(f"{e.kind}/{e.name}")
            writer.add(e.name, c.tensor.view(e.shape) if c is not None
                       else torch.empty(e.shape, dtype=dtype_of(e.dtype)))
    written = writer.finish()
    configs = path / HF_CONFIG_DIR
    if configs.is_dir():
        for f in sorted(configs.iterdir()):
            if f.is_file():
                shutil.copyfile(f, out / f.name)
                written.append(f.name)
    return written

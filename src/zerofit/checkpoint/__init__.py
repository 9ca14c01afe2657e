"""Checkpoints: sharded training state that reloads at any world size or stage, and HF weight files.

    path = save_state("ckpt/step-600", engine, extra_state={...}, config=cfg)   # every rank; moves ckpt/latest
    extra = load_state("ckpt", engine)          # every rank; "ckpt" resolves through ckpt/latest
    sd = full_state_dict(engine, model)         # every rank; the full state dict on rank 0
    save_consolidated(engine, model, "out")     # every rank; model.safetensors (+ index) and config.json
    merge("ckpt", "out")                        # offline, one process: the same files from a checkpoint

Modules: `sharded` (save_state / load_state), `chunks` (the DCP storage of tensor chunks and why it
never unpickles), `tree` (non-tensor state as JSON + safetensors), `manifest` (checksums), `commit`
(temporary directory, rename, `latest`), `retention` (`total_limit`: keeping the newest few), `ranks`
(agreeing on failure), `inventory` (what a model's checkpoint holds), `consolidate` and `export` (HF
weight files), `merge` (offline export).
Every failure raises `zerofit.errors.CheckpointError`, on every rank.
"""

from __future__ import annotations

from zerofit.checkpoint.consolidate import full_state_dict, save_consolidated
from zerofit.checkpoint.merge import merge
from zerofit.checkpoint.sharded import load_state, save_state, saved_config

__all__ = ["full_state_dict", "load_state", "merge", "save_consolidated", "save_state", "saved_config"]

"""Automatic resume: which checkpoint `prepare()` loads by itself, and when (`checkpoint.resume`).

Under `zerofit launch --max_restarts K` a failed worker group is started again from the top of the
script. With the default `checkpoint.resume: restart`, the `prepare()` call that prepares the trained
model then loads the latest complete checkpoint of the run's checkpoint directory: model, optimizer,
scheduler, RNG streams, the objects given to `register_for_checkpointing`, every prepared
dataloader's epoch and position (its next iteration continues after the last batch the checkpoint
had seen) and the optimizer-step counter (`accelerator.completed_steps`). The script continues from
there without repeating or skipping a batch.

The checkpoint directory is `<project_dir>/checkpoints` under `ProjectConfiguration(project_dir=...,
automatic_checkpoint_naming=True)` (where `save_state()` writes), else `checkpoint.output_dir`.
Only a complete checkpoint is ever chosen: the directory itself when it holds a manifest, else the
one its `latest` file names (`latest` only ever names committed checkpoints, see
`zerofit.checkpoint.commit`). Rank 0 decides and every rank loads what it decided.
"""

from __future__ import annotations

import logging
from pathlib import Path

from zerofit.checkpoint.commit import LATEST, pointed_to
from zerofit.checkpoint.manifest import MANIFEST
from zerofit.errors import CheckpointError, ConfigError

MODES = ("restart", "auto", "must", "never")
KEY = "checkpoint.resume"

logger = logging.getLogger("zerofit.checkpoint.resume")


def checkpoint_root(project_dir: str | None, automatic_naming: bool, output_dir: str | None) -> Path | None:
    """The directory whose latest complete checkpoint a resume loads (None: the run names none)."""
    if automatic_naming and project_dir:
        return Path(project_dir) / "checkpoints"
    if output_dir:
        return Path(output_dir)
    return None


def latest_complete(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None when none was committed there yet."""
    target = pointed_to(root)  # also recovers a commit that died between its renames
    if target is None or target == root:
        return target
    if not (target / MANIFEST).is_file():
        raise CheckpointError(f"{root / LATEST} names {target.name!r}, which is not a complete checkpoint (no "
                              f"{MANIFEST}): point {LATEST} at a complete checkpoint directory under {root}, or "
                              "delete it to start from scratch")
    return target


def choose(mode: str, attempt: int, root: Path | None) -> Path | None:
    """The checkpoint to resume from under `mode` on restart attempt `attempt`; None: start from scratch.

    Raises when `mode` is "must" and there is nothing to load; logs loudly when a restarted attempt
    has nothing to resume from.
    """
    if mode not in MODES:
        raise ConfigError(f"{KEY} is {mode!r}: use one of {', '.join(MODES)}")
    if mode == "never" or (mode == "restart" and attempt == 0):
        return None
    if root is None:
        if mode == "must" or attempt > 0:
            message = (f"{KEY} is {mode!r} (attempt {attempt}) but the run has no checkpoint directory: pass "
                       "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True) to the "
                       "Accelerator, or set checkpoint.output_dir")
            if mode == "must":
                raise ConfigError(message)
            logger.warning("zerofit: %s; this attempt starts again from step 0", message)
        return None
    found = latest_complete(root)
    if found is None:
        if mode == "must":
            raise CheckpointError(f"{KEY} is 'must' but {root} holds no complete checkpoint (no {LATEST} file and "
                                  f"no {MANIFEST}): save one first, or set {KEY} to auto to start from scratch")
        if attempt > 0:
            logger.warning("zerofit: restart attempt %d found no complete checkpoint in %s: starting again from "
                           "step 0", attempt, root)
    return found

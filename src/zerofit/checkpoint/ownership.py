"""Whose checkpoints a run may replace or delete: its own, and an earlier run's only when told to.

[Note: an earlier run's checkpoints]
A save replaces a checkpoint of the same name, and `checkpoint.total_limit` deletes old ones beside it
(`retention`). Both may touch only checkpoints this run wrote (its id is in their manifest, `run_id`)
or those of a folder the run adopted: one it loaded a checkpoint from (a resume continues the folder's
numbering and retention, as before), or any folder under `checkpoint.overwrite: true`
(`zerofit launch --overwrite_checkpoints`). Everything else is an earlier run's work: the same command
launched again in the same project folder restarts its numbering at checkpoint_0, so its saves would
replace checkpoint_0, 1, ... and retention would delete the rest.

Such a save is refused before anything is written, on every rank, naming the folder, what it holds and
the ways forward (`refusal`):
- under automatic naming (`<project_dir>/checkpoints`): any earlier checkpoint in that folder (the
  numbering restarts there, and `latest` would move to this run's checkpoints);
- at `checkpoint.output_dir` itself: an earlier checkpoint there (every save replaces it);
- in a directory the script names (`save_state(dir)`, `save_checkpoint(dir, tag)`): when it would
  replace an earlier checkpoint of that name, or when a retention limit is set and the folder holds
  earlier checkpoints (the limit would delete them).

It is checked at the save, not at `prepare()`: scripts written for Accelerate load their checkpoint
with `load_state` after `prepare()` (Accelerate's documentation does so), which adopts the folder, and
only the save knows where a `save_state(dir)` writes. `prepare()` warns at once when the run's
checkpoint folder holds an earlier run's checkpoints and nothing was resumed (`earlier_held`).
The restarted attempts of one `zerofit launch --max_restarts` share one id (the launcher sets
ZEROFIT_RUN_ID), so a restart owns what its earlier attempts wrote; checkpoints written before this
change carry no id and count as an earlier run's.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from zerofit.checkpoint.commit import read_latest
from zerofit.checkpoint.manifest import run_of
from zerofit.checkpoint.retention import is_zerofit_checkpoint
from zerofit.distributed.runtime import RUN_ID_ENV
from zerofit.errors import CheckpointError

RUN_ENV = RUN_ID_ENV
OVERWRITE_KEY = "checkpoint.overwrite"
OVERWRITE_FLAG = "--overwrite_checkpoints"

_process_run: str | None = None


def run_id() -> str:
    """This run's id: the launcher's, else one made for this process on first use (never at import: the
    test harness forks ranks from a server that imported zerofit, and they must not share one)."""
    global _process_run
    launched = os.environ.get(RUN_ENV)
    if launched:
        return launched
    if _process_run is None:
        _process_run = uuid.uuid4().hex
    return _process_run


def earlier_held(folder: Path, run: str) -> list[Path]:
    """The committed zerofit checkpoints directly in `folder` that `run` did not write, by name."""
    try:
        children = sorted(folder.iterdir(), key=lambda p: p.name)
    except OSError:  # no folder yet (or unreadable): nothing in it to protect
        return []
    return [p for p in children if is_zerofit_checkpoint(p) and run_of(p) != run]


def held_at_start(root: Path, run: str) -> str | None:
    """What `prepare()` warns of when a run starting from step 0 finds an earlier run's checkpoints in its
    checkpoint folder `root` (or at `root` itself, `checkpoint.output_dir`); None: nothing to say."""
    earlier = [root] if is_zerofit_checkpoint(root) and run_of(root) != run else earlier_held(root, run)
    if not earlier:
        return None
    shown = ", ".join(p.name for p in earlier[:5]) + (f", ... ({len(earlier)} in all)" if len(earlier) > 5 else "")
    return (f"{root} holds checkpoints of an earlier run ({shown}) and this run starts from step 0: its first "
            "save there will be refused unless it loads one of them first (accelerator.load_state); to resume "
            f"from them pass --resume auto, to replace them {OVERWRITE_FLAG} ({OVERWRITE_KEY}: true)")


def refusal(final: Path, *, run: str, named_root: Path | None, fixed_dir: Path | None,
            limit: int | None) -> tuple[str | None, bool]:
    """Whether the save at `final` would replace or delete an earlier run's checkpoint (see the note).

    Returns (the error to raise, or None; whether the folder holds no earlier checkpoint at all, so later
    saves of this run into it need no check). `named_root`: the folder of automatic naming;
    `fixed_dir`: `checkpoint.output_dir`; `limit`: the retention limit in force.
    """
    if fixed_dir is not None and final == fixed_dir:
        earlier = [final] if is_zerofit_checkpoint(final) and run_of(final) != run else []
        if not earlier:  # not "clean": that would spare other saves into the parent folder their check
            return None, False
        return _message(final, earlier, "every save to checkpoint.output_dir replaces the checkpoint there",
                        "another checkpoint.output_dir"), False
    folder = final.parent
    earlier = earlier_held(folder, run)
    if not earlier:
        return None, True
    if named_root is not None and folder == named_root:
        why = "its numbering restarts at checkpoint_0, so its saves would replace them"
        if limit is not None:
            why += f" and total_limit {limit} delete the rest"
        return _message(folder, earlier, why, "another project_dir"), False
    if final in earlier:
        return _message(folder, earlier, f"this save would replace {final.name}", "another directory"), False
    if limit is not None:
        return _message(folder, earlier, f"total_limit {limit} would delete them",
                        "another directory"), False
    return None, False


def _message(where: Path, earlier: list[Path], why: str, elsewhere: str) -> str:
    shown = ", ".join(p.name for p in earlier[:5]) + (f", ... ({len(earlier)} in all)" if len(earlier) > 5 else "")
    try:  # the folder's pointer (a checkpoint at checkpoint.output_dir itself has none inside it)
        latest = None if earlier == [where] else read_latest(where)
    except (OSError, CheckpointError):
        latest = None
    if latest is not None:
        shown += f"; its latest names {latest}"
    return (f"{where} holds checkpoints of an earlier run ({shown}) and this run loaded none: {why}, and zerofit "
            "keeps another run's checkpoints. Resume from them (--resume auto, or load_state after prepare()), "
            f"replace them ({OVERWRITE_FLAG}, i.e. {OVERWRITE_KEY}: true) or save into {elsewhere}")

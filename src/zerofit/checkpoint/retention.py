"""Keeping only the newest checkpoints: `checkpoint.total_limit` and `ProjectConfiguration(total_limit=...)`.

Both say the same thing and reach the same code: after every successful `save_state`, `prune` leaves
at most that many of zerofit's checkpoints in the folder holding the new one (the folder whose
`latest` file `save_state` moves: `<project_dir>/checkpoints` under automatic naming, else the
parent of the directory the script passed). When both are set, the config's value is used.

[Note: what retention may delete]
Only the main rank deletes, and only after the save committed on every rank. A sibling of the new
checkpoint counts as one of zerofit's checkpoints when it is a real directory (not a symlink) holding
a `manifest.json` of zerofit's manifest format; nothing else in the folder is ever touched: other
files and directories, another tool's checkpoints, the `.tmp-` / `.old-` directories of a commit (see
[Note: atomic commit]), and nothing is deleted but through `commit.remove`, which renames a checkpoint
to its doomed name before deleting it, so a kill mid-deletion leaves a folder the next save or prune
finishes deleting (see [Note: atomic removal]).
Of zerofit's checkpoints the newest `limit` are kept, newest meaning the most
recently written manifest (the new checkpoint is always kept), and so is the one `latest` names,
even beyond the limit. A checkpoint saved at `checkpoint.output_dir` itself is the run's only one,
replaced by every save, so nothing beside it is the run's to delete: no pruning then. A deletion
that fails gives a warning; the save itself has succeeded. A run deletes only its own checkpoints, unless
it adopted the folder (`owner`, see [Note: an earlier run's checkpoints] in `ownership`).
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

from zerofit.checkpoint.commit import is_checkpoint, read_latest, remove, remove_doomed
from zerofit.checkpoint.manifest import MANIFEST, run_of
from zerofit.errors import CheckpointError

_warned_conflicts: set[tuple[int, int]] = set()


def limit_of(config_limit: int | None, project_limit: int | None) -> int | None:
    """The number of checkpoints to keep: the config's `checkpoint.total_limit`, else the script's."""
    if config_limit is not None and project_limit is not None and config_limit != project_limit:
        if (config_limit, project_limit) not in _warned_conflicts:
            _warned_conflicts.add((config_limit, project_limit))
            warnings.warn(f"checkpoint.total_limit is {config_limit} in the config but the script passes "
                          f"ProjectConfiguration(total_limit={project_limit}); keeping {config_limit} checkpoints "
                          "(the config wins): remove one of the two", stacklevel=3)
    return config_limit if config_limit is not None else project_limit


def is_zerofit_checkpoint(path: Path) -> bool:
    """True for a committed checkpoint written by zerofit (see [Note: what retention may delete]); a doomed
    one being deleted is not one (`is_checkpoint`)."""
    return ".tmp-" not in path.name and ".old-" not in path.name and is_checkpoint(path)


def _named_by_latest(folder: Path) -> Path | None:
    try:
        name = read_latest(folder)
    except (OSError, CheckpointError):  # an unreadable pointer protects nothing, and deletes nothing either
        return None
    return folder / name if name is not None else None


def _written_at(path: Path) -> tuple:
    """Sort key: the manifest's write time, then the name with its numbers compared as numbers (a
    coarse file-system clock can give two quick saves one time; checkpoint_10 comes after checkpoint_9)."""
    parts = re.split(r"(\d+)", path.name)
    return (path / MANIFEST).stat().st_mtime_ns, [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts]


def to_delete(saved: Path, limit: int, owner: str | None = None) -> list[Path]:
    """The checkpoints beside `saved` that a limit of `limit` removes, oldest first (pure listing).
    `owner`: only those the run of that id wrote count (None: all of zerofit's)."""
    folder = saved.parent
    ours = [p for p in folder.iterdir() if p != saved and is_zerofit_checkpoint(p)
            and (owner is None or run_of(p) == owner)]
    ours.sort(key=_written_at, reverse=True)  # newest first
    keep = {saved, _named_by_latest(folder)}
    kept = 1  # `saved` itself
    doomed = []
    for path in ours:
        if kept < limit or path in keep:
            kept += 1
        else:
            doomed.append(path)
    return doomed[::-1]


def prune(saved: str | os.PathLike[str], *, config_limit: int | None, project_limit: int | None,
          is_main: bool, fixed_dir: str | os.PathLike[str] | None = None, owner: str | None = None) -> list[Path]:
    """After a committed save at `saved`: delete the checkpoints the limit leaves out; returns them.

    Every rank may call it; only `is_main` deletes. `fixed_dir` is `checkpoint.output_dir`: a save
    there is the run's only checkpoint (see the note), so it prunes nothing. `owner`: the saving run's id
    when only its own checkpoints may go; None where the run adopted the folder.
    """
    limit = limit_of(config_limit, project_limit)
    path = Path(saved).absolute()
    if not is_main or limit is None or (fixed_dir is not None and Path(fixed_dir).absolute() == path):
        return []
    remove_doomed(path.parent)  # what a prune killed mid-deletion left (the save did it too, unless it failed)
    doomed = to_delete(path, limit, owner)
    for old in doomed:
        try:
            remove(old)
        except OSError as e:
            warnings.warn(f"checkpoint.total_limit {limit}: could not delete the old checkpoint {old} ({e}); "
                          "the next save tries again, or delete it by hand", stacklevel=2)
    return doomed

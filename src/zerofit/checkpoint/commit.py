"""Where a checkpoint lives on disk, and how it appears there all at once.

[Note: atomic commit]
A save writes into a sibling `<name>.tmp-<token>` and only renames it to `<name>` once every rank's
files and then the manifest are on disk (`commit`). Replacing an existing `<name>` moves the old one
aside first (`<name>.old-<token>`) and deletes it after the rename, so there is never a moment when a
half-written directory carries the final name. A crash, an exception or a full disk at any point
before the rename leaves only a `.tmp-` directory behind, which no loader opens and the next save of
the same name removes. A kill between the two renames leaves no `<name>`, but two complete copies
beside it: loading and resuming put the newer (`.tmp-`, the save being committed) back in its place
(`recover`). After the commit, the parent's `latest` file is replaced atomically (write a temporary
file, fsync, `os.replace`): it always names a complete checkpoint; a kill before the replace leaves the
temporary `.latest.tmp-<token>`, which the next save removes, and an error there (a full disk) removes it
at once and says that the checkpoint itself is saved while `latest` names the previous one.
tests/test_checkpoint_commit_kill.py SIGKILLs a save at each of these steps.

[Note: atomic removal]
Deleting a checkpoint (`remove`, what `checkpoint.total_limit` does to old ones) first renames it to
`<name>.doomed-<token>` in the same folder, then deletes that. A kill in the middle of the deletion
would otherwise leave a folder under the checkpoint's own name that no longer holds its manifest:
not a checkpoint any more, so no later prune would look at it, and its shards would stay on disk
for good. A doomed name is never a checkpoint (`is_checkpoint`, `resolve`, the resume's search and
retention's listing all refuse it), and the next save or prune beside it finishes the deletion
(`remove_doomed`).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

from zerofit.checkpoint.manifest import FORMAT as MANIFEST_FORMAT
from zerofit.checkpoint.manifest import MANIFEST
from zerofit.checkpoint.tree import read_json, write_durable
from zerofit.errors import CheckpointError

LATEST = "latest"
_DOOMED = re.compile(r".+\.doomed-[0-9a-f]{12}")
"""A folder `remove` was deleting (see [Note: atomic removal]): nothing else is ever named like it."""


def temp_dir(final: Path, token: str) -> Path:
    return final.with_name(f"{final.name}.tmp-{token}")


def is_doomed(path: Path) -> bool:
    """True for a checkpoint being deleted (see [Note: atomic removal]), whatever it still holds."""
    return _DOOMED.fullmatch(path.name) is not None


def remove(checkpoint: Path) -> Path:
    """Delete `checkpoint` so that a kill at any moment leaves nothing a later save does not finish
    deleting (see [Note: atomic removal]); returns the doomed name it was deleted under. An OSError from
    the rename leaves the checkpoint as it was; one from the deletion leaves the doomed folder."""
    doomed = checkpoint.with_name(f"{checkpoint.name}.doomed-{uuid.uuid4().hex[:12]}")
    os.rename(checkpoint, doomed)
    _fsync_dir(checkpoint.parent)  # the doomed name is on disk before any file of it goes
    shutil.rmtree(doomed)
    return doomed


def remove_doomed(folder: Path) -> list[Path]:
    """Finish deleting the checkpoints a kill or an error interrupted `remove` on in `folder`; returns them."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if is_doomed(p) and p.is_dir() and not p.is_symlink()]
    for path in found:
        shutil.rmtree(path, ignore_errors=True)  # what cannot go now is tried again at the next save
    return found


def remove_stale(final: Path) -> None:
    """Delete what earlier failed saves of `final` left behind, the temporary `latest` of a save killed
    before it replaced `latest` (`point_latest`), and any checkpoint beside it whose removal was
    interrupted (`remove_doomed`)."""
    if not final.parent.is_dir():
        return
    remove_doomed(final.parent)
    for p in final.parent.iterdir():
        # An `.old-` copy is the only good one if a commit died between its two renames: keep it then.
        stale = p.name.startswith(f"{final.name}.tmp-") or (
            p.name.startswith(f"{final.name}.old-") and final.exists())
        if stale and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(f".{LATEST}.tmp-") and p.is_file() and not p.is_symlink():
            p.unlink(missing_ok=True)


def recover(final: Path) -> None:
    """Put back `final` when a commit died between its two renames (see the module note): of the complete
    copies beside it, the `.tmp-` one (the save being committed) wins over the `.old-` one (the previous
    save), the newest manifest among several; the other copies are left for the next save to clear.
    Safe to run on several ranks at once: a rank that loses the race finds `final` in place."""
    if final.exists() or not final.parent.is_dir():
        return
    copies = [p for p in final.parent.iterdir()
              if p.name.startswith((f"{final.name}.tmp-", f"{final.name}.old-")) and is_checkpoint(p)]
    if not copies:
        return
    best = max(copies, key=lambda p: (".tmp-" in p.name[len(final.name):], (p / MANIFEST).stat().st_mtime_ns))
    try:
        os.rename(best, final)
        _fsync_dir(final.parent)
    except OSError:
        if not final.exists():
            raise


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_replaceable(final: Path, *, update_latest: bool) -> None:
    """Refuse, before anything is written, a save that would replace what zerofit did not write: `final`
    must be absent, an empty directory, or a zerofit checkpoint (its manifest names our format), and
    with `update_latest` the `latest` beside it must be absent or a pointer zerofit could have written."""
    if final.is_symlink() or final.exists():
        if not final.is_dir() or final.is_symlink():
            raise CheckpointError(f"{final} exists and is not a directory: save the checkpoint somewhere else")
        if any(final.iterdir()) and not is_checkpoint(final):
            raise CheckpointError(f"{final} exists and is not a zerofit checkpoint (it holds other files): a save "
                                  "replaces its directory as a whole, so zerofit will not write there; save to a "
                                  "new or empty directory")
    if update_latest:
        try:
            read_latest(final.parent)
        except CheckpointError as e:
            raise CheckpointError(f"{e} - zerofit will not overwrite it: rename it, or save elsewhere") from None


def is_checkpoint(directory: Path) -> bool:
    """True for a real directory holding a manifest of zerofit's format (a committed zerofit checkpoint)
    that is not being deleted (see [Note: atomic removal])."""
    manifest = directory / MANIFEST
    if (is_doomed(directory) or directory.is_symlink() or not directory.is_dir()
            or manifest.is_symlink() or not manifest.is_file()):
        return False
    try:
        doc = read_json(manifest)
    except (OSError, CheckpointError):
        return False
    return isinstance(doc, dict) and doc.get("format") == MANIFEST_FORMAT


def commit(tmp: Path, final: Path, token: str) -> None:
    """Rename the finished `tmp` to `final`, replacing a previous checkpoint of that name."""
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{token}")
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def point_latest(final: Path, token: str) -> None:
    """Make `<parent>/latest` name `final` (atomic replace). On failure `latest` is as it was and the
    temporary file is gone; the CheckpointError says that `final` itself is saved (it is committed by now)."""
    tmp = final.parent / f".{LATEST}.tmp-{token}"
    try:
        before = read_latest(final.parent)
    except CheckpointError:  # check_replaceable refused such a file before the save began
        before = None
    try:
        write_durable(tmp, f"{final.name}\n".encode())
        os.replace(tmp, final.parent / LATEST)
    except Exception as e:
        tmp.unlink(missing_ok=True)  # a full disk still lets a file go; the next save would remove it otherwise
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        left = (f"{LATEST} still names {before!r}, so resuming from {final.parent} loads that one" if before
                else f"there is no {LATEST} file beside it")
        raise CheckpointError(f"{final} is saved and complete (it loads when passed by its own path), but "
                              f"{final.parent / LATEST} could not be moved to it ({reason}): {left}. Free space "
                              f"there and save again, or pass {final} to load_state") from e
    _fsync_dir(final.parent)


LATEST_MAX_BYTES = 4096
"""A `latest` file holds one directory name; anything longer is not one of ours."""
_NAME_MAX_BYTES = 255
"""The longest directory name file systems take: a longer name in `latest` would fail every look-up."""


def read_latest(folder: Path) -> str | None:
    """The checkpoint name `folder/latest` holds (None: no such file), checked: a regular file (not a
    symlink, FIFO or directory), at most LATEST_MAX_BYTES, UTF-8, one sibling directory name. A bad one is a
    CheckpointError that never echoes more than a short prefix of what the file holds."""
    pointer = folder / LATEST
    if not pointer.is_symlink() and not pointer.exists():
        return None
    if pointer.is_symlink() or not pointer.is_file():
        raise CheckpointError(f"{pointer} is not a regular file (a symlink, directory or device): zerofit writes "
                              f"{LATEST} as a plain file naming a checkpoint; delete it, or pass the checkpoint's "
                              "directory itself")
    with open(pointer, "rb") as f:
        raw = f.read(LATEST_MAX_BYTES + 1)
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        name = None
    if name is None or len(raw) > LATEST_MAX_BYTES or not name or "/" in name or "\\" in name \
            or name in (".", "..") or "\n" in name or "\0" in name or len(name.encode()) > _NAME_MAX_BYTES:
        shown = repr(raw[:60].decode("utf-8", "replace")) + ("..." if len(raw) > 60 else "")
        raise CheckpointError(f"{pointer}: names {shown}, which is not a checkpoint directory name: "
                              "write the name of a sibling checkpoint directory into it")
    return name


def pointed_to(path: Path) -> Path | None:
    """The checkpoint `path` stands for - itself when it holds a manifest, else the one its `latest`
    names (which may not exist) - after recovering an interrupted commit of either; None: neither. A
    checkpoint being deleted is refused (see [Note: atomic removal])."""
    _not_doomed(path)
    recover(path)
    if (path / MANIFEST).is_file():
        return path
    name = read_latest(path)
    if name is None:
        return None
    recover(path / name)
    return _not_doomed(path / name, f"{path / LATEST} names it: ")


def _not_doomed(checkpoint: Path, via: str = "") -> Path:
    if is_doomed(checkpoint):
        raise CheckpointError(f"{via}{checkpoint} is a checkpoint zerofit was deleting (checkpoint.total_limit left "
                              "it out and its deletion was interrupted; the next save beside it finishes it): "
                              "load another checkpoint")
    return checkpoint


def resolve(directory: str | os.PathLike[str]) -> Path:
    """The checkpoint directory `directory` means: itself, or the one its `latest` file names."""
    path = Path(directory)
    target = pointed_to(path)
    if target is not None and target != path and not target.is_dir():
        raise CheckpointError(f"{path / LATEST}: names {target.name!r}, but {target} does not exist: point it at an "
                              "existing checkpoint or pass that checkpoint's directory")
    if target is not None:
        return target
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory: check the path")
    held = held_checkpoints(path)
    if held:  # one folder too high: not an unfinished save
        shown = ", ".join(c.name for c in held[:5]) + (f", ... ({len(held)} in all)" if len(held) > 5 else "")
        raise CheckpointError(f"{path} is not a checkpoint, it holds checkpoints ({shown}): pass one of them, "
                              f"e.g. {held[-1]}")
    return path  # `read_manifest` explains what is missing


def _natural_key(name: str) -> list[object]:
    """checkpoint_2 before checkpoint_10: digit runs compare as numbers."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name)]


def held_checkpoints(folder: Path) -> list[Path]:
    """The committed checkpoints directly inside `folder`, by name with numbers in order (empty: none, or
    `folder` cannot be listed)."""
    try:
        children = [p for p in folder.iterdir() if is_checkpoint(p)]
    except OSError:
        return []
    return sorted(children, key=lambda p: _natural_key(p.name))

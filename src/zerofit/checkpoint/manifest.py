"""The checksum manifest: the last file of a checkpoint, and the proof that the save completed.

[Note: manifest]
`manifest.json` lists every other file of the checkpoint with its size and SHA-256. It is written
after all of them, into the temporary directory, right before that directory is renamed into place.
A directory without it is not a checkpoint (a save that died, or a copy that was cut short). Loading
checks every listed file's size, then its hash, before reading a single tensor, so a flipped byte, a
truncated or a missing file is an error that names the file, never silently different weights.
A manifest proves integrity, not authenticity: whoever can write the files can rewrite it too.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath

from zerofit.checkpoint.tree import read_json, write_durable
from zerofit.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT = "zerofit-manifest/1"
_BLOCK = 1 << 22
_MAX_NAME_CHARS = 1024
"""A checkpoint's files have short names (`state/shard-00001-model-00001-of-00001.safetensors`); a longer
one is an edit, and one past the file system's limit would fail every check with an OSError."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def list_files(directory: Path) -> list[str]:
    """Every file under `directory` (relative, '/'-separated, sorted), the manifest excluded."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def describe(directory: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes", "sha256"}} for `names` under `directory`."""
    return {n: {"bytes": (directory / n).stat().st_size, "sha256": sha256_file(directory / n)} for n in names}


def write_manifest(directory: Path, files: dict[str, dict], run: str | None = None) -> None:
    """`run`: the run that writes it (see `zerofit.checkpoint.ownership`), which decides who may delete it."""
    doc: dict = {"format": FORMAT, "files": dict(sorted(files.items()))}
    if run is not None:
        doc["run"] = run
    write_durable(directory / MANIFEST, json.dumps(doc, indent=1).encode())


def run_of(directory: Path) -> str | None:
    """The run that wrote the checkpoint at `directory` (None: not recorded, or unreadable: an earlier run's)."""
    try:
        doc = read_json(directory / MANIFEST)
    except (OSError, CheckpointError):
        return None
    run = doc.get("run") if isinstance(doc, dict) else None
    return run if isinstance(run, str) else None


def read_manifest(directory: Path) -> dict[str, dict]:
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing: {directory} is not a complete zerofit checkpoint (the save did not finish, "
            "or the copy is partial); load an earlier checkpoint or point at the directory holding "
            "manifest.json")
    try:
        doc = read_json(path)
        files = doc["files"]
        if doc.get("format") != FORMAT or not all(
                isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
                for v in files.values()):
            raise ValueError(f"format {doc.get('format')!r}")
    except (CheckpointError, OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({str(e)[:200]}): the checkpoint is damaged; load an "
                              "earlier one") from None
    for name in files:
        parts = PurePosixPath(name).parts
        if not name or name.startswith("/") or "\\" in name or ".." in parts or "\0" in name:
            raise CheckpointError(f"{path}: lists {name[:100]!r}, a path outside the checkpoint: the manifest is "
                                  "damaged or was edited; load an earlier checkpoint")
        if len(name) > _MAX_NAME_CHARS or any(len(part) > 255 for part in parts):
            raise CheckpointError(f"{path}: lists a name of {len(name)} characters ({name[:60]!r}...), longer than "
                                  "any file of a checkpoint: the manifest is damaged or was edited; load an earlier "
                                  "checkpoint")
    return files


def missing_required(files: dict[str, dict], required: tuple[str, ...], folder: str) -> list[str]:
    """Problems for a manifest that leaves out files every checkpoint has (an emptied `files` would
    otherwise switch every integrity check off)."""
    absent = [n for n in required if n not in files]
    if not any(n.startswith(folder + "/") for n in files):
        absent.append(f"{folder}/*.safetensors")
    return [f"{MANIFEST} does not list {', '.join(absent)}, which every checkpoint holds: the manifest is damaged "
            "or was edited; load an earlier checkpoint"] if absent else []


def check_sizes(directory: Path, files: dict[str, dict]) -> list[str]:
    """Problems with the listed files' presence and sizes (cheap: no reads)."""
    problems = []
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: listed in {MANIFEST} but missing (a rank's file was lost or not "
                            "copied): restore it or load an earlier checkpoint")
        elif path.stat().st_size != entry["bytes"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, {MANIFEST} says {entry['bytes']} "
                            "(truncated or overwritten): restore it or load an earlier checkpoint")
    return problems


def unlisted(directory: Path, files: dict[str, dict], folder: str) -> list[str]:
    """Problems for entries of `directory/folder` the manifest does not list (the tensor reader would read
    every `.safetensors` there: a stale file from another run, or a FIFO that blocks it forever)."""
    root = directory / folder
    extra = sorted(f"{folder}/{p.name}" for p in root.iterdir() if f"{folder}/{p.name}" not in files) \
        if root.is_dir() else []
    return [f"{directory / name}: not in the checkpoint's manifest (left from another run, e.g. a cp -r of another "
            f"checkpoint over this one): delete it, or load a clean copy of the checkpoint" for name in extra]


def check_hashes(directory: Path, files: dict[str, dict], names: list[str]) -> list[str]:
    """Problems with the SHA-256 of `names` (a subset of `files`, so ranks can share the reading)."""
    problems = []
    for name in names:
        path = directory / name
        if path.is_file() and path.stat().st_size == files[name]["bytes"] \
                and sha256_file(path) != files[name]["sha256"]:
            problems.append(f"{path}: SHA-256 differs from {MANIFEST} (the file is corrupt): restore it "
                            "or load an earlier checkpoint")
    return problems

"""A save really SIGKILLed at each step of its commit (#18): a fresh process then loads, and resumes from,
the newest complete copy, and nothing the user wrote beside the checkpoint is lost.

Each case is a child process (tests/scripts/kill_commit.py's `run`, in a process forked from
multiprocessing's fork server, which imported torch once for all of them) that saves `ckpt` under a
folder and kills itself right before or after the n-th rename into that folder (see [Note: atomic
commit] in `zerofit.checkpoint.commit`). The children run at once; every check runs here, after they
are dead.
"""

from __future__ import annotations

import multiprocessing
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from test_checkpoint_support import build

from zerofit.checkpoint import load_state, save_state
from zerofit.checkpoint.resume import choose

SCRIPTS = Path(__file__).parent / "scripts"
CHILD_TIMEOUT_S = 120

# case: (ckpt saved before, version the killed save writes, kill point, version each view finds: through
# the folder's `latest` (None: start from scratch), and through the checkpoint's own directory)
CASES = {
    "resave, before moving the old copy aside": (1.0, 2.0, ("before", 1), 1.0, 1.0),
    "resave, between the two renames": (1.0, 2.0, ("after", 1), 2.0, 2.0),
    "resave, before deleting the old copy": (1.0, 2.0, ("after", 2), 2.0, 2.0),
    "resave, before replacing latest": (1.0, 2.0, ("before", 3), 2.0, 2.0),
    "resave, right after replacing latest": (1.0, 2.0, ("after", 3), 2.0, 2.0),
    "first save, before its rename": (None, 1.0, ("before", 1), None, 1.0),
    "first save, before writing latest": (None, 1.0, ("before", 2), None, 1.0),
}
USER_FILES = {"notes.txt": "years of work\n", "data/train.txt": "rows\n"}


def _version(engine) -> set[float]:
    """The values of the masters' first elements (the rest of a flat group may be padding)."""
    return {float(g.master.flatten()[0]) for g in engine.groups}


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict[str, Path]:
    """One folder per case, left as the SIGKILLed save left it."""
    base = tmp_path_factory.mktemp("killed")
    engine = build(1)[3]
    with torch.no_grad():
        for g in engine.groups:
            g.master.fill_(1.0)
    saved = Path(save_state(base / "saved" / "ckpt", engine, extra_state={"version": 1.0}))
    sys.path.insert(0, str(SCRIPTS))  # the children import kill_commit by name, with the sys.path of start()
    import kill_commit

    ctx = multiprocessing.get_context("forkserver")
    roots, children = {}, []
    for i, (case, (before, version, (when, n), _, _)) in enumerate(CASES.items()):
        root = roots[case] = base / f"case{i}"
        for name, text in USER_FILES.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        if before is not None:
            shutil.copytree(saved, root / "ckpt")
            shutil.copy(saved.parent / "latest", root / "latest")
        children.append(ctx.Process(target=kill_commit.run, args=(root, version, when, n)))
        children[-1].start()
    sys.path.remove(str(SCRIPTS))
    for case, child in zip(CASES, children):
        child.join(timeout=CHILD_TIMEOUT_S)
        if child.exitcode is None:
            child.kill()
            child.join()
        # exit code 3: the commit had fewer renames than asked; 1: the save raised (its traceback is on stderr)
        assert child.exitcode == -signal.SIGKILL, f"{case}: the child was not killed ({child.exitcode})"
    return roots


@pytest.mark.parametrize("case", list(CASES))
def test_a_save_killed_at_any_step_of_its_commit_loses_nothing(killed, case):
    _, version, _, through_latest, through_dir = CASES[case]
    root = killed[case]
    engine = build(1, perturb=1.0)[3]
    chosen = choose("auto", 1, root)  # what a restart with checkpoint.resume reads first: the folder's latest
    assert chosen == (None if through_latest is None else root / "ckpt"), case
    assert choose("auto", 1, root / "ckpt") == root / "ckpt", case  # checkpoint.output_dir is the checkpoint
    assert load_state(root / "ckpt", engine) == {"version": through_dir} and _version(engine) == {through_dir}
    if through_latest is not None:
        assert load_state(root, engine) == {"version": through_latest}
    assert {name: (root / name).read_text() for name in USER_FILES} == USER_FILES
    # The next save of the same name clears what the killed one left: only the checkpoint and latest remain.
    with torch.no_grad():
        for g in engine.groups:
            g.master.fill_(version + 1)
    save_state(root / "ckpt", engine, extra_state={"version": version + 1})
    assert sorted(p.name for p in root.iterdir()) == ["ckpt", "data", "latest", "notes.txt"], case
    assert load_state(root, build(1, perturb=1.0)[3]) == {"version": version + 1}

"""A save that is SIGKILLed at one step of its commit, for tests/test_checkpoint_commit_kill.py.

    python kill_commit.py ROOT VERSION before|after N

(or `run(ROOT, VERSION, when, N)` in a fresh process, as the test does: multiprocessing's fork server)
saves a one-process engine (every master weight VERSION, extra_state {"version": VERSION}) to ROOT/ckpt
and kills itself with SIGKILL right before or right after the N-th rename into ROOT: 1 is `ckpt` moved
aside to `ckpt.old-*` (when it exists), then the finished `ckpt.tmp-*` renamed to `ckpt`, then
`latest` replaced. The renames are counted by wrapping os.rename / os.replace in this process only,
so the library runs unchanged. Reaching the end alive exits 3: the commit has fewer steps than asked.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared model helpers

import torch  # noqa: E402
from test_checkpoint_support import build  # noqa: E402

from zerofit.checkpoint import save_state  # noqa: E402


def kill_at(root: Path, when: str, n: int) -> None:
    """SIGKILL this process right `when` ("before" / "after") the n-th rename whose target is in `root`."""
    count = [0]

    def counted(real):
        def rename(src, dst, *args, **kwargs):
            if Path(dst).parent != root:
                return real(src, dst, *args, **kwargs)
            count[0] += 1
            if count[0] == n and when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            result = real(src, dst, *args, **kwargs)
            if count[0] == n and when == "after":
                os.kill(os.getpid(), signal.SIGKILL)
            return result
        return rename

    os.rename, os.replace = counted(os.rename), counted(os.replace)


def run(root: Path, version: float, when: str, n: int) -> None:
    root = Path(root).absolute()
    engine = build(1)[3]
    with torch.no_grad():
        for g in engine.groups:
            g.master.fill_(version)
    kill_at(root, when, n)
    save_state(root / "ckpt", engine, extra_state={"version": version})
    sys.exit(3)


if __name__ == "__main__":
    run(Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3], int(sys.argv[4]))

"""The first code every launched worker runs: it starts the user's script or module as `__main__`.

It exists so that an exception in the user's code is recorded in torchelastic's error file; the
launcher's failure summary then shows the failing rank's Python traceback instead of only an exit
code, without the user decorating anything.
"""

from __future__ import annotations

import os
import runpy
import sys
from types import TracebackType

from torch.distributed.elastic.multiprocessing.errors import record

_BOOTSTRAP_FILES = (os.path.abspath(__file__), runpy.__file__, "<frozen runpy>")


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the first frame outside this bootstrap and runpy (what the user wrote)."""
    head = tb
    while head is not None and head.tb_frame.f_code.co_filename in _BOOTSTRAP_FILES:
        head = head.tb_next
    return head or tb


def _run_target(argv: list[str]) -> None:
    if argv[0] == "-m":
        # Like `python -m`: sys.path[0] stays the working directory, sys.argv[0] becomes the module file.
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        # Like `python script.py`: the script's directory comes first on sys.path.
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


@record
def main(argv: list[str]) -> None:
    try:
        _run_target(argv)
    except Exception as e:
        e.__traceback__ = _user_frames(e.__traceback__)  # re-raised below from the user's first frame
        raise


if __name__ == "__main__":
    main(sys.argv[1:])

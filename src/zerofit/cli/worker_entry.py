"""The first code every launched worker runs: it starts the user's script or module as `__main__`.

It exists so that an exception in the user's code is recorded in torchelastic's error file; the
launcher's failure summary then shows the failing rank's Python traceback instead of only an exit
code, without the user decorating anything.

[Note: the error file appears whole or not at all]
torchelastic writes the error file in place (open, then write). When one rank dies, its peers fail
in their next collective and write theirs while the agent is stopping the group: a peer stopped
between the open and the write leaves an empty file, and the agent then fails to parse it and
crashes instead of restarting the job (seen once in ~20 runs of tests/test_faults.py). So the record
is written to a file beside it and renamed over it: the agent sees the whole record or none.

[Note: a run that never used zerofit]
A script still importing `accelerate`, or transformers' Trainer (which builds Accelerate's own
Accelerator), runs under `zerofit launch` without error, on plain PyTorch / Accelerate: nothing would
tell the user that zerofit never sharded anything. So when the script ends successfully and this
process never built zerofit's `Accelerator` or `PartialState` (`runtime.zerofit_state_built`), rank 0
says so once, naming the import to change. Other ranks stay quiet: every rank runs the same script.

[Note: warnings once per run]
Every rank runs the same code, so a deprecation (of a library, or of a key in the config file) warns
once per rank, and the copies interleave on the terminal. Ranks other than 0 ignore those categories
(`quiet_repeated_warnings`); rank 0 still shows each. Other warnings stay on every rank: they may be
about that rank's own data or state.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import runpy
import signal
import sys
import traceback
import warnings
from types import TracebackType

import torch.distributed as dist
import torch.distributed.elastic.multiprocessing.errors as elastic_errors
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from zerofit.config import ConfigWarning
from zerofit.distributed import runtime

_BOOTSTRAP_FILES = (os.path.abspath(__file__), runpy.__file__, "<frozen runpy>", elastic_errors.__file__)


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


class _WholeFileErrorHandler(ErrorHandler):
    """torchelastic's error record, written beside the error file and renamed over it (see the note)."""

    def record_exception(self, e: BaseException) -> None:
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if not path:
            super().record_exception(e)
            return
        partial = f"{path}.{os.getpid()}.partial"
        os.environ["TORCHELASTIC_ERROR_FILE"] = partial
        try:
            super().record_exception(e)
        finally:
            os.environ["TORCHELASTIC_ERROR_FILE"] = path
        if os.path.exists(partial):
            os.replace(partial, path)


def die_with_launcher() -> None:
    """Ask Linux to kill this worker when its parent (the launcher's torchrun agent) dies, even by SIGKILL:
    otherwise a killed launcher leaves its workers running, one of them possibly sleeping for an hour."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(1)


REPEATED_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning, ConfigWarning)
"""What every rank would warn alike; shown on rank 0 only (see [Note: warnings once per run])."""


def quiet_repeated_warnings() -> None:
    """On ranks other than 0, ignore the warnings every rank would repeat (see [Note: warnings once per run]).
    Filters the script sets later come first and still win."""
    if os.environ.get("RANK", "0") == "0":
        return
    for category in REPEATED_WARNINGS:
        warnings.filterwarnings("ignore", category=category)


def _main(argv: list[str]) -> None:
    try:
        _run_target(argv)
    except Exception as e:
        e.__traceback__ = _user_frames(e.__traceback__)  # re-raised below from the user's first frame
        raise


main = record(_main, error_handler=_WholeFileErrorHandler())


def _excepthook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    """Python's report of an uncaught exception, from the user's first frame, each line prefixed with the
    rank; the launcher's summary then names it without printing it again (zerofit.cli.failure_report).
    Once the process group exists, torch wraps this hook and adds the `[rankN]:` prefix itself."""
    text = "".join(traceback.format_exception(kind, error, _user_frames(tb)))
    if not (dist.is_available() and dist.is_initialized()):
        rank = os.environ.get("RANK", "0")
        text = "".join(f"[rank{rank}]: {line}\n" for line in text.rstrip("\n").split("\n"))
    sys.stderr.write(text)
    sys.stderr.flush()


def unused_notice(argv: list[str]) -> str | None:
    """What rank 0 prints after a successful run that never used zerofit, else None
    (see [Note: a run that never used zerofit])."""
    if os.environ.get("RANK", "0") != "0" or runtime.zerofit_state_built():
        return None
    name = " ".join(argv[:2]) if argv[0] == "-m" else os.path.basename(argv[0])
    return (f"zerofit launch: {name} never created a zerofit Accelerator: the script ran without zerofit "
            f"(plain PyTorch / Accelerate), so nothing was sharded or offloaded. Change {_import_to_change()}")


def _import_to_change() -> str:
    """The one import that puts the script on zerofit, guessed from the libraries it loaded: TRL's and
    transformers' trainers build Accelerate's own Accelerator (docs/transformers.md)."""
    if "trl" in sys.modules:
        return ("`from trl import SFTTrainer` to `from zerofit.integrations.trl import SFTTrainer` (DPOTrainer "
                "likewise; see docs/transformers.md)")
    if "transformers.trainer" in sys.modules:
        return ("`from transformers import Trainer` to `from zerofit.integrations.transformers import Trainer` "
                "(Seq2SeqTrainer likewise; see docs/transformers.md)")
    return "`from accelerate import Accelerator` to `from zerofit import Accelerator`"


def _finished(argv: list[str]) -> None:
    """The script ended successfully: say so if it never used zerofit."""
    notice = unused_notice(argv)
    if notice is not None:
        print(notice, file=sys.stderr, flush=True)


INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT
"""A process stopped by Ctrl-C exits with 130, as shells report it."""


def _exit_interrupted() -> None:
    """End the process after Ctrl-C (or the agent's SIGINT) quietly: the launcher prints the one line that
    says the run was stopped (zerofit.cli.failure_report), so no rank adds a KeyboardInterrupt traceback.
    atexit handlers still run; a second Ctrl-C while they do is ignored, not a traceback from inside them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.last_value = KeyboardInterrupt()  # a failed exit, as in _exit_failed
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(INTERRUPTED_EXIT_CODE)


def _exit_failed(error: BaseException) -> None:
    """Report `error` (already recorded by `record`) and end the process with exit code 1, as Python does,
    but without the interpreter's teardown: a process group whose peer left can abort in its C++
    destructors there ("terminate called without an active exception", exit -6), which would replace
    the script's exit code. atexit handlers (NVMe swap files, trackers) still run."""
    sys.excepthook(type(error), error, error.__traceback__)  # torch's rank-prefixing hook wraps ours
    # As the interpreter records an uncaught error, so exit handlers can tell a failed exit (they destroy
    # no process group then: [Note: end of training] in zerofit.distributed.process_group).
    sys.last_type, sys.last_value, sys.last_traceback = type(error), error, error.__traceback__
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


if __name__ == "__main__":
    die_with_launcher()
    quiet_repeated_warnings()
    sys.excepthook = _excepthook  # set before the script runs, so torch's rank-prefixing hook wraps it
    target = sys.argv[1:]  # the script's run rebinds sys.argv
    try:
        main(target)  # returns on sys.exit(0) too (torchelastic's `record`)
        _finished(target)
    except SystemExit as done:  # sys.exit() / sys.exit(main()) with main returning None: a success too
        if done.code is None:
            _finished(target)
        raise
    except KeyboardInterrupt:
        _exit_interrupted()
    except Exception as failure:
        _exit_failed(failure)

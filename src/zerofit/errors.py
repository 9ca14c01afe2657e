"""The exceptions zerofit raises on purpose, so callers can catch them by kind."""


class ZerofitError(Exception):
    """Base class of every error zerofit raises on purpose."""


MAX_PROBLEM_CHARS = 600
"""A problem's message quotes the value it is about; a 100 KB string value must not become a 100 KB error."""

MAX_PROBLEMS = 50

_HEAD_CHARS, _TAIL_CHARS = 400, 150
"""What a capped problem keeps: its start (the file or key, the value) and its end (the fix)."""


def capped(problems: list[str]) -> list[str]:
    """[Note: echo cap] The one rule for how much of what the user gave an error may echo, read by every
    error that quotes files or values (ConfigError, CheckpointError): each problem at most
    MAX_PROBLEM_CHARS (a longer one keeps its start and its fix, the middle elided), at most MAX_PROBLEMS
    problems and a line counting the rest. Capping a capped list changes nothing, so an error rebuilt from
    another's message (a rank's verdict, re-raised) says the same."""
    keep = len(problems) if len(problems) <= MAX_PROBLEMS + 1 else MAX_PROBLEMS
    shown = []
    for text in problems[:keep]:
        if len(text) > MAX_PROBLEM_CHARS:
            hidden = len(text) - _HEAD_CHARS - _TAIL_CHARS
            text = f"{text[:_HEAD_CHARS]} ... ({hidden} more characters not shown) ... {text[-_TAIL_CHARS:]}"
        shown.append(text)
    if keep < len(problems):
        shown.append(f"... and {len(problems) - keep} more problems")
    return shown


class ConfigError(ZerofitError, ValueError):
    """A config problem; the message lists every problem found, each naming the dotted key, value and fix
    (capped, see [Note: echo cap])."""

    def __init__(self, problems: list[str] | str, source: str | None = None):
        found = [problems] if isinstance(problems, str) else list(problems)
        self.problems = capped([str(p) for p in found])
        source = capped([source])[0] if source else source
        where = f" in {source}" if source else ""
        head = f"{len(self.problems)} problem(s){where}:"
        super().__init__("\n".join([head] + [f"  - {p}" for p in self.problems]))


class EngineError(ZerofitError, RuntimeError):
    """The engine met a state it cannot continue from (the message says which rank and what to change)."""


class LossScaleError(EngineError):
    """fp16 dynamic loss scaling reached its minimum and still overflows."""


class CheckpointError(ZerofitError, RuntimeError):
    """A checkpoint could not be written or read (corrupt, truncated, partial, or from another model);
    the message names the file, the problem and what to do, one problem a line (capped, see
    [Note: echo cap]: a 5 MB `latest` or a 100 KB name in a manifest is never echoed whole)."""

    def __init__(self, message: str = ""):
        super().__init__("\n".join(capped(str(message).split("\n"))))


class CollectiveError(EngineError):
    """A collective did not complete: a peer hung past the timeout, or left the run. The message names
    the collective's label, this rank, and the setting that bounds the wait."""

    def __init__(self, message: str, *, label: str, rank: int):
        super().__init__(message)
        self.label = label
        self.rank = rank


class RanksApartError(CollectiveError):
    """Ranks reached different collective calls (one rank in `state_dict()`, another in `wait_for_everyone()`
    or gone), so the collective would never complete; raised before it is entered (see `zerofit.distributed.arrival`).
    The message names what each rank is doing, the usual cause and the fix."""

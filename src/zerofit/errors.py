"""The exceptions zerofit raises on purpose, so callers can catch them by kind."""


class ZerofitError(Exception):
    """Base class of every error zerofit raises on purpose."""


MAX_PROBLEM_CHARS = 600
"""A problem's message quotes the value it is about; a 100 KB string value must not become a 100 KB error."""

MAX_PROBLEMS = 50


def _capped(text: str) -> str:
    if len(text) <= MAX_PROBLEM_CHARS:
        return text
    return f"{text[:MAX_PROBLEM_CHARS]} ... ({len(text) - MAX_PROBLEM_CHARS} more characters not shown)"


class ConfigError(ZerofitError, ValueError):
    """A config problem; the message lists every problem found, each naming the dotted key, value and fix
    (each capped at MAX_PROBLEM_CHARS, at most MAX_PROBLEMS of them)."""

    def __init__(self, problems: list[str] | str, source: str | None = None):
        found = [problems] if isinstance(problems, str) else list(problems)
        self.problems = [_capped(str(p)) for p in found[:MAX_PROBLEMS]]
        if len(found) > MAX_PROBLEMS:
            self.problems.append(f"... and {len(found) - MAX_PROBLEMS} more problems")
        source = _capped(source) if source else source
        where = f" in {source}" if source else ""
        head = f"{len(self.problems)} problem(s){where}:"
        super().__init__("\n".join([head] + [f"  - {p}" for p in self.problems]))


class EngineError(ZerofitError, RuntimeError):
    """The engine met a state it cannot continue from (the message says which rank and what to change)."""


class LossScaleError(EngineError):
    """fp16 dynamic loss scaling reached its minimum and still overflows."""


class CheckpointError(ZerofitError, RuntimeError):
    """A checkpoint could not be written or read (corrupt, truncated, partial, or from another model);
    the message names the file, the problem and what to do."""


class CollectiveError(EngineError):
    """A collective did not complete: a peer hung past the timeout, or left the run. The message names
    the collective's label, this rank, and the setting that bounds the wait."""

    def __init__(self, message: str, *, label: str, rank: int):
        super().__init__(message)
        self.label = label
        self.rank = rank

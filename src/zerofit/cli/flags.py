"""One way to declare a command-line option: `add_flag`, used by every zerofit subcommand.

[Note: flag spelling] Every option has one canonical name, spelt with underscores as Accelerate spells
its launch flags (`--num_processes`, `--mixed_precision`); the same name with dashes
(`--num-processes`) is accepted everywhere, silently, because both are in use. A name a command used
to have stays accepted as a hidden deprecated alias (dashed twin included) that stores into the same
destination and prints one line naming the new flag, so old scripts keep working and learn the new
spelling (on rank 0 only, when every rank of a launch parses the same argv). `tests/test_cli_flags.py`
freezes the canonical names and aliases of every subcommand.

Errors speak of options as the user typed them: an unknown one gets the nearest known name
(`did_you_mean`), and a number a flag gave a config key outside the config's bounds is told as
`--num_processes 0`, not as the key it sets (`flag_value_problems`, `flags_named`).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
from collections.abc import Iterator
from typing import Any

from zerofit.errors import ConfigError


def twins(name: str) -> tuple[str, ...]:
    """`name` and its dashed spelling (`--micro_batch`, `--micro-batch`); short options have none."""
    if not name.startswith("--") or "_" not in name:
        return (name,)
    return (name, "--" + name[2:].replace("_", "-"))


class _DeprecatedAlias(argparse.Action):
    """An old spelling of `canonical`: the note, then exactly what the canonical option does."""

    def __init__(self, option_strings: list[str], dest: str, *, canonical: argparse.Action, **_: Any):
        super().__init__(option_strings, dest, nargs=canonical.nargs, const=canonical.const,
                         default=argparse.SUPPRESS, type=canonical.type, choices=canonical.choices,
                         help=argparse.SUPPRESS, metavar=canonical.metavar)
        self.canonical = canonical
        self.new_name = next(s for s in canonical.option_strings if s.startswith("--"))

    def __call__(self, parser, namespace, values, option_string=None):
        # Every rank of a launched script parses the same argv: only rank 0 (or a process outside a
        # launch, RANK unset) says it, so the note appears once per run, not once per rank.
        if os.environ.get("RANK", "0") == "0":
            print(f"zerofit: warning: {option_string} is deprecated: use {self.new_name}", file=sys.stderr)
        self.canonical(parser, namespace, values, self.new_name)


def as_typed(name: str, argv: list[str]) -> str:
    """The spelling of option `name` the user typed in `argv` (`--num-processes` for `--num_processes`), so an
    error about its value quotes the command line; `name` itself when neither twin is there."""
    for arg in argv:
        given = arg.split("=", 1)[0]
        if given in twins(name):
            return given
    return name


def did_you_mean(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """`unrecognized arguments: ...` plus the nearest option `parser` has for each mistyped one."""
    known = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    hints = []
    for arg in unknown:
        close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1) if arg.startswith("--") else []
        if close:
            hints.append(f"{arg.split('=', 1)[0]}: did you mean {close[0]}?")
    return f"unrecognized arguments: {' '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else "")


def flag_value_problems(args: argparse.Namespace, flag_to_key: dict[str, str]) -> dict[str, str]:
    """config key -> the problem with the number a flag gave it, checked against the config's own bounds so
    the error quotes the flag as typed (`--num_processes 0`) rather than the config key it sets."""
    from zerofit.config.validate import MAXIMUMS, MINIMUMS

    problems = {}
    argv = list(getattr(args, "argv", None) or [])
    for flag, key in flag_to_key.items():
        value = getattr(args, flag)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        least, most = MINIMUMS.get(key), MAXIMUMS.get(key)
        typed = as_typed(f"--{flag}", argv)
        if least is not None and value < least:
            problems[key] = f"{typed} {value}: must be at least {least} (it sets {key}): pass {least} or more"
        elif most is not None and value > most:
            problems[key] = (f"{typed} {value}: more than the {most} zerofit accepts (it sets {key}): pass a "
                             "smaller value")
    return problems


@contextlib.contextmanager
def flags_named(problems: dict[str, str]) -> Iterator[None]:
    """Inside, a ConfigError's problem about a key a flag set out of bounds is told as `problems` tells it
    (the flag as typed), the other problems as they are, all in one error."""
    try:
        yield
    except ConfigError as e:
        from zerofit.config.naming import key_name

        if not problems:
            raise
        names = {k: {k, *(key_name(f, k) for f in ("deepspeed", "accelerate", "accelerate+deepspeed"))}
                 for k in problems}
        # the bounds' own wording (zerofit.config.validate `_minimums`, `_finite_and_bounded`), not the
        # cross-field rules, which name the same key followed by its value in parentheses
        said = tuple(f"{n} {verb} " for k in problems for n in names[k] for verb in ("must be", "is"))
        rest = [p for p in e.problems if not p.startswith(said)]
        raise ConfigError([*problems.values(), *rest]) from None
    if problems:
        raise ConfigError(list(problems.values()))


def add_flag(parser: argparse.ArgumentParser, *names: str, aliases: tuple[str, ...] = (),
             **kwargs: Any) -> argparse.Action:
    """Register option `names` (plus each one's dashed spelling) and its deprecated `aliases`.

    Takes `add_argument`'s keywords; the destination comes from the first long name, as in argparse.
    Returns the canonical action.
    """
    long_names = [n for n in names if n.startswith("--")]
    if not long_names or any(n.startswith("--") and "-" in n[2:] for n in names):
        raise ValueError(f"flag {names}: give the canonical long name with underscores (see [Note: flag spelling])")
    spellings = [s for n in names for s in twins(n)]
    canonical = parser.add_argument(*spellings, **kwargs)
    for old in aliases:
        parser.add_argument(*twins(old), dest=canonical.dest, action=_DeprecatedAlias, canonical=canonical)
    return canonical

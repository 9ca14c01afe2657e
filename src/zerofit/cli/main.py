"""The `zerofit` command: one subcommand per module of this package."""

from __future__ import annotations

import argparse
import sys
import warnings

from zerofit import __version__
from zerofit.cli import bench, configure, demo, env, estimate, launch, merge
from zerofit.cli.flags import did_you_mean
from zerofit.config import ConfigWarning
from zerofit.errors import ZerofitError

SUBCOMMANDS = (launch, env, configure, demo, merge, estimate, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerofit", allow_abbrev=False,
        description="ZeRO sharding and offload for PyTorch training, driven by the config files you already have.")
    parser.add_argument("--version", action="version", version=f"zerofit {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def _show_config_warnings_plainly() -> None:
    """Config warnings are messages to the user, not Python diagnostics: print them without file and line."""
    default = warnings.showwarning
    if getattr(default, "zerofit", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, ConfigWarning):
            print(f"zerofit: warning: {message}", file=file or sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    show.zerofit = True
    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    _show_config_warnings_plainly()
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        command = next(a for a in parser._actions if a.dest == "command").choices[args.command]
        command.error(did_you_mean(extra, command))
    args.extra = extra
    args.argv = argv  # as given: `zerofit launch --hostfile` hands its own to the other machines
    try:
        return args.func(args)
    except ZerofitError as e:
        print(f"zerofit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

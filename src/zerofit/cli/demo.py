"""`zerofit demo`: the README's main job, a tiny model trained by 2 CPU processes on shipped data."""

from __future__ import annotations

import argparse

from zerofit.cli import launch

DEMO_MODULE = "zerofit.demo.train"
DEMO_LAUNCH_FLAGS = ("--cpu", "--num_processes", "2")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo", allow_abbrev=False, help="train a tiny model on 2 CPU processes (no GPU, no downloads)",
        description=f"Same as `zerofit launch {' '.join(DEMO_LAUNCH_FLAGS)} -m {DEMO_MODULE} ARGS...`; "
                    f"every argument is passed to {DEMO_MODULE} (e.g. --stage 3 --steps 20).")
    p.set_defaults(func=run, accepts_extra=True)


def launch_args(demo_args: list[str]) -> list[str]:
    """What `zerofit launch` is given: the demo's launch flags, the demo module, then the demo's own arguments."""
    return [*DEMO_LAUNCH_FLAGS, "-m", DEMO_MODULE, *demo_args]


def run(args: argparse.Namespace) -> int:
    # Launch's own parser, not `zerofit.cli.main`: a subcommand never imports the command above it.
    parser = argparse.ArgumentParser(prog="zerofit launch", allow_abbrev=False)
    launch.add_arguments(parser)
    return launch.run(parser.parse_args(launch_args(args.extra)))

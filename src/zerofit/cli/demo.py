"""`zerofit demo`: the README's main job, a tiny model trained by 2 CPU processes on shipped data.

The demo's options are declared here, once (`add_demo_options`), for two parsers: this subcommand's,
so that `zerofit demo --help` lists them and a wrong one fails before any process starts, and the demo
module's own (`zerofit.demo.train`), which every rank runs. The subcommand hands the ranks only the
options that were given, in canonical spelling, so a deprecated spelling warns once, here, not once
per rank.
"""

from __future__ import annotations

import argparse

from zerofit.cli import launch
from zerofit.cli.flags import add_flag

DEMO_MODULE = "zerofit.demo.train"
DEMO_LAUNCH_FLAGS = ("--cpu", "--num_processes", "2")


def add_demo_options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The demo's options on `p`; returns their actions."""
    return [
        add_flag(p, "--stage", type=int, choices=[0, 1, 2, 3], default=None,
                 help="ZeRO stage (default: 0, plain data parallelism)"),
        add_flag(p, "--steps", type=int, default=60, metavar="N", help="optimizer steps (default: 60)"),
        add_flag(p, "--micro_batch", aliases=("--batch_size",), type=int, default=8, metavar="B",
                 help="sequences per process per micro-step (default: 8)"),
        add_flag(p, "--gradient_accumulation_steps", type=int, default=1, metavar="K",
                 help="micro-steps per optimizer step (default: 1)"),
        add_flag(p, "--context", type=int, default=64, metavar="C",
                 help="characters per sequence, the model's context (default: 64)"),
        add_flag(p, "--lr", type=float, default=3e-3, metavar="LR", help="AdamW learning rate (default: 0.003)"),
        add_flag(p, "--mixed_precision", choices=["no", "bf16", "fp16"], default=None,
                 help="compute precision (default: no, fp32)"),
    ]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo", allow_abbrev=False, help="train a tiny model on 2 CPU processes (no GPU, no downloads)",
        description=f"Train a tiny character-level transformer on shipped text: `zerofit launch "
                    f"{' '.join(DEMO_LAUNCH_FLAGS)} -m {DEMO_MODULE}` with these options.")
    add_demo_options(p)
    p.set_defaults(func=run)


def demo_argv(args: argparse.Namespace) -> list[str]:
    """The demo options `args` sets away from their defaults, canonically spelt, for the ranks' parser."""
    out: list[str] = []
    for action in add_demo_options(argparse.ArgumentParser(add_help=False)):
        value = getattr(args, action.dest, action.default)
        if value != action.default:
            out += [action.option_strings[0], str(value)]
    return out


def launch_args(demo_args: list[str]) -> list[str]:
    """What `zerofit launch` is given: the demo's launch flags, the demo module, then the demo's own arguments."""
    return [*DEMO_LAUNCH_FLAGS, "-m", DEMO_MODULE, *demo_args]


def run(args: argparse.Namespace) -> int:
    # Launch's own parser, not `zerofit.cli.main`: a subcommand never imports the command above it.
    parser = argparse.ArgumentParser(prog="zerofit launch", allow_abbrev=False)
    launch.add_arguments(parser)
    return launch.run(parser.parse_args(launch_args(demo_argv(args))))

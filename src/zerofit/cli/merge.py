"""`zerofit merge CKPT OUT`: a sharded training checkpoint -> consolidated safetensors, offline.

No processes and no GPU: the saved chunks of every parameter are read and written out as
`model.safetensors` (or shards plus `model.safetensors.index.json` above `--max_shard_size`) that
transformers' `from_pretrained` loads.
"""

from __future__ import annotations

import argparse

from zerofit.cli.flags import add_flag


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("merge", allow_abbrev=False, help="sharded checkpoint -> safetensors (offline)",
                              description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a directory written by save_state (or its parent holding `latest`), a "
                   "Trainer's checkpoint-N, or a Trainer's output folder (its newest checkpoint-N)")
    p.add_argument("out", help="directory for the consolidated model files")
    add_flag(p, "--max_shard_size", default="5GB", help="split the weights into files of at most this size")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from zerofit.checkpoint.merge import merge, merge_source

    source, said = merge_source(args.checkpoint)
    if said:
        print(said, file=sys.stderr)
    written = merge(source, args.out, max_shard_size=args.max_shard_size)
    for path in written:
        print(path)
    return 0

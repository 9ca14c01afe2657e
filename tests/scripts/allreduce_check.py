"""A tiny worker for the launcher tests: one all_reduce, then one JSON line of what the rank saw.

Usage: allreduce_check.py [--fail-rank R] [--exit-code C]. With --fail-rank, rank R raises after the
all_reduce; with --exit-code, every rank exits with code C at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from zerofit.distributed import runtime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--exit-code", type=int, default=0)
    args = parser.parse_args()
    config = runtime.current_config()  # must load the launcher's file
    backend = runtime.backend(config)
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    if args.fail_rank == rank:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    report = json.dumps({
        "rank": rank, "world_size": world, "backend": dist.get_backend(), "sum": total.item(),
        "master_addr": os.environ.get("MASTER_ADDR"), "config_file": os.environ.get(runtime.CONFIG_FILE_ENV),
        "num_processes": config.launch.num_processes, "use_cpu": config.launch.use_cpu,
        "omp": os.environ.get("OMP_NUM_THREADS"), "argv0": os.path.basename(sys.argv[0]),
    })
    # One write of one line: the ranks share the launcher's stdout, and print() may split a line in two writes.
    os.write(sys.stdout.fileno(), f"ZEROFIT_TEST {report}\n".encode())
    dist.destroy_process_group()
    sys.exit(args.exit_code)


if __name__ == "__main__":
    main()

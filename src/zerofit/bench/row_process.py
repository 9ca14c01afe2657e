"""One row of a table in one process (or in each process of a torchrun job): `python -m zerofit.bench.row_process`.

Phases, each skipped when the parent already has its result (a relaunch after an out-of-memory that
left the process unusable continues where the last one stopped):
1. equal: fixed steps at the workload's equal batch, from the seeded initial weights (first loss,
   train and eval seconds per step, and the first step's seconds apart: a compiled row compiles in it);
2. train search: the largest training batch (`zerofit.bench.search`), one step per try;
3. timing: fixed steps at the largest batch (GPU peak memory), then - where the table reports it -
   the largest eval batch searched in the memory state training leaves, and eval steps at it.
`--equal-only` stops after phase 1 (scaling and parity runs: every method at one batch).

Each event is one JSON line in `--events DIR/rank<R>.jsonl`, written before the next phase starts,
so the parent knows every result even if the process dies. On one process an out-of-memory is recovered in place
(`Runner.recover`); with several processes the failing rank exits (the others would wait in a
collective) and the parent relaunches.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import traceback
from typing import Any

import torch

from zerofit.bench.methods import Runner, build_runner, repeated_blocks
from zerofit.bench.search import BatchSearch
from zerofit.bench.workloads import WORKLOADS, Workload
from zerofit.distributed import runtime


class SimulatedOutOfMemory(torch.OutOfMemoryError):
    """`--simulate-oom-above N`: the harness's out-of-memory path, tested on CPU."""


_STARTED = time.perf_counter()
_EVENTS: list[Any] = []  # the open events file of this process


def emit(**event: Any) -> None:
    """One result, written and flushed at once (it must survive this process dying next)."""
    event["rank"] = int(os.environ.get("RANK", "0"))
    event["t"] = round(time.perf_counter() - _STARTED, 2)
    _EVENTS[0].write(json.dumps(event) + "\n")
    _EVENTS[0].flush()


class Row:
    def __init__(self, args: argparse.Namespace, workload: Workload):
        self.args, self.w = args, workload
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        cuda = args.device == "cuda"
        self.device = runtime.local_gpu() if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
            if args.gpu_memory_gib:
                total = torch.cuda.get_device_properties(self.device).total_memory / 2**30
                torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib / total), self.device)
        self.index = 0
        self.first_s: float | None = None
        """Seconds of the first step of the last `timed` call (a compiled row's compile is in it)."""
        self.runner: Runner = build_runner(args.method, workload, tiny=args.tiny, device=self.device,
                                           bf16=args.precision == "bf16", clip=args.clip, world=self.world,
                                           micro_batch=args.equal_batch or workload.equal_batch,
                                           process_group_timeout=args.process_group_timeout,
                                           compile_backend=args.compile_backend)
        if args.simulate_oom_above:
            block = repeated_blocks(self.runner.model)[-1]
            block.register_forward_pre_hook(self._simulated_oom)
        compiled = {"compile": self.runner.compiled} if self.runner.compiled else {}
        emit(event="config", config=self.runner.config() | compiled, world=self.world)

    def _simulated_oom(self, _module, args, kwargs=None):
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.shape[0] > self.args.simulate_oom_above:
            raise SimulatedOutOfMemory(f"simulated: batch {x.shape[0]} > {self.args.simulate_oom_above}")

    # --- one try -----------------------------------------------------------------------------
    def batch(self, size: int) -> dict[str, torch.Tensor]:
        b = self.w.batch(size, self.index * self.world + self.rank, self.args.tiny, self.device)
        self.index += 1
        return b

    def timed(self, size: int, steps: int, *, train: bool) -> tuple[list[float], list[float]]:
        """Seconds of `steps` steps after `--warmup` warm-up steps (0 steps: one untimed step), and every loss."""
        warmup = self.args.warmup if steps else 1
        times, losses = [], []
        for i in range(steps + warmup):
            batch = self.batch(size)
            self._sync()
            t0 = time.perf_counter()
            loss = self.runner.train(batch) if train else self.runner.evaluate(batch)
            self._sync()
            if i == 0:
                self.first_s = time.perf_counter() - t0
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        return times, losses

    def fits(self, size: int, *, train: bool) -> bool:
        """Two training steps (or one forward) at `size`; False on out-of-memory (then `after_oom`). Two,
        because a second step can hold more than the first (zerofit's ZeRO-2 offload on the H200: batch 34
        passed one step and failed the timed steps)."""
        try:
            for _ in range(2 if train else 1):
                self.timed(size, 0, train=train)
            return True
        except torch.OutOfMemoryError as e:
            traceback.clear_frames(e.__traceback__)  # the failed step's frames hold its activations
            return False

    def after_oom(self, size: int) -> None:
        """Once the out-of-memory at `size` is reported: recover in place, or - several processes, whose
        peers wait in a collective - end this one and let the parent relaunch."""
        if self.world > 1:
            leave_out_of_memory(size)
        self.runner.recover()
        emit(event="recovered", batch=size)

    def _peak_gib(self) -> float | None:
        """GPU memory peak since the last reset (None on CPU)."""
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- phases ------------------------------------------------------------------------------
    def equal(self) -> None:
        size = self.args.equal_batch or self.w.equal_batch
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            train_s, losses = self.timed(size, self.args.steps, train=True)
            first_s = self.first_s
            # --eval-steps 0: no eval here (a compiled row would compile its eval graph too)
            eval_s = self.timed(size, self.args.eval_steps, train=False)[0] if self.args.eval_steps else None
        except torch.OutOfMemoryError as e:
            traceback.clear_frames(e.__traceback__)
            emit(event="equal", batch=size, fits=False)
            self.after_oom(size)
            return
        emit(event="equal", batch=size, fits=True, train_s=statistics.median(train_s), train_times=train_s,
             first_s=first_s, eval_s=statistics.median(eval_s) if eval_s else None, losses=losses,
             gpu_peak_gib=self._peak_gib())

    def search(self, phase: str, search: BatchSearch) -> int:
        while (size := search.next()) is not None:
            emit(event="try", phase=phase, batch=size)
            ok = self.fits(size, train=phase == "train")
            emit(event="tried", phase=phase, batch=size, fits=ok)
            if not ok:
                self.after_oom(size)
            search.record(size, ok)
        return search.fits

    def train_timing(self, size: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        emit(event="timing_start", batch=size)
        train_s, losses = self.timed(size, self.args.steps, train=True)
        peak = self._peak_gib()
        emit(event="timing", train_batch=size, train_s=statistics.median(train_s), train_times=train_s,
             losses=losses, gpu_peak_gib=peak, host_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)

    def eval_timing(self, size: int) -> None:
        emit(event="evaluation_start", batch=size)
        eval_s, _ = self.timed(size, self.args.eval_steps, train=False)
        emit(event="evaluation", eval_batch=size, eval_s=statistics.median(eval_s), eval_times=eval_s)


def leave_out_of_memory(size: int) -> None:
    """Several processes: the others wait in a collective, so end this one; the parent relaunches."""
    print(f"zerofit bench: rank {os.environ.get('RANK', '0')}: out of memory at batch {size}", file=sys.stderr,
          flush=True)
    os._exit(3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one row of `zerofit bench` (started by `zerofit bench`)")
    p.add_argument("--events", required=True, help="directory for each rank's events file")
    p.add_argument("--table", required=True, choices=sorted(WORKLOADS))
    p.add_argument("--method", required=True)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--precision", choices=["bf16", "no"], default="bf16")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--gpu-memory-gib", type=float, default=None)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--eval-steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=1024)
    p.add_argument("--equal-batch", type=int, default=None)
    p.add_argument("--skip-equal", action="store_true")
    p.add_argument("--equal-only", action="store_true")
    p.add_argument("--train-timed", action="store_true")
    for phase in ("train", "eval"):
        p.add_argument(f"--{phase}-fits", type=int, default=0)
        p.add_argument(f"--{phase}-fails", type=int, default=None)
    p.add_argument("--process-group-timeout", type=float, default=None)
    p.add_argument("--compile-backend", default="inductor", help="torch.compile's backend for -compiled methods")
    p.add_argument("--simulate-oom-above", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # one events file per call (a test runs several rows in one process, one after the other)
    _EVENTS[:] = [open(os.path.join(args.events, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a")]
    workload = WORKLOADS[args.table]
    row = Row(args, workload)
    equal = args.equal_batch or workload.equal_batch
    if not args.skip_equal:
        row.equal()
    if args.equal_only:
        emit(event="done", equal_only=True)
        return 0
    train = BatchSearch(max_batch=args.max_batch, fits=args.train_fits, fails=args.train_fails, start=equal)
    if row.search("train", train) == 0:
        emit(event="done", train_batch=0)
        return 0
    if args.train_timed:  # a relaunch: one step first, so evaluation meets the memory training leaves behind
        row.timed(train.fits, 0, train=True)
    else:
        row.train_timing(train.fits)
    eval_batch = train.fits
    if workload.search_eval_batch or args.eval_fails is not None:
        evals = BatchSearch(max_batch=4 * args.max_batch, fits=max(args.eval_fits, train.fits),
                            fails=args.eval_fails, start=train.fits)
        eval_batch = row.search("eval", evals)
    row.eval_timing(eval_batch)
    emit(event="done", train_batch=train.fits, eval_batch=eval_batch, capped=train.capped)
    return 0


if __name__ == "__main__":
    sys.exit(main())

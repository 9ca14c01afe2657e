"""The GPU-stepped stream's fixed cost per chunk on the issuing thread, measured on the CPU (issue #39).

    PYTHONPATH=src python benchmarks/issue_cost.py [--blocks 48] [--dim 32] [--steps 12] [--warmup 2] [--profile]

Builds a model of `--blocks` small blocks (two Linear and a LayerNorm each) with the two param groups
transformers' Trainer makes (weights with weight decay; biases and norms without), runs ZeroEngine stage 2 with
`offload_optimizer: {device: cpu, step_on: device}` on one gloo rank (GPU-stepped, the CPU standing in for the
GPU, as tests/engine_cases.py does), `precision.optimizer_state` fp32 and 8bit, and prints per state dtype the
issuing thread's time (`StepTimes.stream_issue`) per step and per chunk, after `--warmup` steps. The layers are
tiny, so the chunks' copies and kernels cost next to nothing and what is left is the fixed round of Python and
kernel launches per chunk. `--profile` also counts the aten ops the issuing thread runs per chunk
(torch.profiler on one step). `--busy-main` keeps the main thread running small torch ops in Python (as a next
forward does) until every group is issued: each op either thread calls lets go of the interpreter lock and takes it
back, so the issuing thread's time then includes its waits for the lock (on the H100, GPT-2 XL's ZeRO-2 offload
step with 8-bit state spent 0.096-0.193 s a step issuing, run to run, against ~0.05 s of its own work).

Measured on the development container (2 CPU cores shared with other jobs, so timings drift by up to 1.5x
between minutes; base and new were run interleaved, 5 runs each, torch 2.13 CPU, 48 blocks, dim 8, 96 chunks a
step), microseconds of issuing per chunk, min / median of the runs, and top-level aten ops per chunk
(`--profile`, deterministic):
    eb63fd7 (before)  fp32 144 / 188 us, 50 ops    8bit 265 / 313 us, 91 ops
    this change       fp32 109 / 175 us, 31 ops    8bit 188 / 236 us, 63 ops
About 40 % of what is left per chunk is torch's `Optimizer.step` around the fused kernel (one call per chunk).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from zerofit.engine import ZeroEngine
from zerofit.testing.models import gpu_stepped_engine, top_level_aten_ops


def build(blocks: int, dim: int, state: str) -> tuple[nn.Module, ZeroEngine]:
    engine = gpu_stepped_engine(blocks, dim, state, lr=1e-3)
    return engine.model, engine


def busy_until_issued(gpu, layers: list[nn.Module], h: torch.Tensor) -> int:
    """Small torch ops in Python on this thread until the issuing thread has issued every group; how many."""
    ops = 0
    while not all(done.is_set() for done in gpu.issuer._issued.values()):
        for layer in layers:
            h = layer(h)
        ops += len(layers)
    return ops


def measure(blocks: int, dim: int, state: str, steps: int, warmup: int, profile: bool, busy: bool) -> dict:
    model, engine = build(blocks, dim, state)
    gpu = engine.offload.gpu
    chunks = sum(len(run.chunks) for runs in gpu._runs.values() for run in runs)
    x = torch.randn(8, dim)
    other = [nn.Linear(dim, dim) for _ in range(8)]  # the main thread's "next forward" (--busy-main)
    per_step, cpu_per_step = [], []
    for step in range(warmup + steps):
        engine.backward(model(x).square().mean())
        before, cpu = engine.times.stream_issue, time.process_time()
        engine.step()
        if busy:
            with torch.no_grad():
                busy_until_issued(gpu, other, x)
        gpu.settle(state=True)  # the issuing thread is done with this step
        if step >= warmup:
            per_step.append(engine.times.stream_issue - before)
            cpu_per_step.append(time.process_time() - cpu)
    ops = None
    if profile:
        engine.backward(model(x).square().mean())
        # the issuing thread's ops too (torch 2.11 and 2.13 both know this flag)
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    experimental_config=config) as prof:
            engine.step()
            gpu.settle(state=True)
        ops = sum(top_level_aten_ops(prof.events()).values()) / chunks
    issue = statistics.median(per_step)
    return {"state": state, "chunks": chunks, "issue_ms_per_step": issue * 1e3, "us_per_chunk": issue / chunks * 1e6,
            "cpu_us_per_chunk": statistics.median(cpu_per_step) / chunks * 1e6, "aten_ops_per_chunk": ops}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=48)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--states", default="fp32,8bit")
    p.add_argument("--profile", action="store_true", help="count aten ops per chunk (one profiled step)")
    p.add_argument("--busy-main", action="store_true", help="the main thread runs small ops meanwhile (see above)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the cost in question is per launch, not per element
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        try:
            for state in args.states.split(","):
                t0 = time.perf_counter()
                r = measure(args.blocks, args.dim, state, args.steps, args.warmup, args.profile, args.busy_main)
                ops = f"  {r['aten_ops_per_chunk']:.1f} aten ops/chunk" if r["aten_ops_per_chunk"] is not None else ""
                busy = " busy main" if args.busy_main else ""
                print(f"issue_cost state={r['state']:4s}{busy} chunks/step={r['chunks']}  issuing "
                      f"{r['issue_ms_per_step']:.2f} ms/step  {r['us_per_chunk']:.0f} us/chunk  (CPU time of the step: "
                      f"{r['cpu_us_per_chunk']:.0f} us/chunk){ops}  "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()

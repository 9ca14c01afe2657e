"""Step time of zerofit's stages against plain PyTorch on the GPT-2 XL workload of shared/ANCHORS.md.

    python benchmarks/engine_step.py                    # every method, one process each, table on stdout
    python benchmarks/engine_step.py --methods torch zerofit-s2 --steps 8 --out results/

Workload: GPT-2 XL architecture (random init), batch 16 x 128 tokens, bf16 compute, AdamW, gradient
clipping 1.0, one GPU. Each method runs in its own process (clean memory peaks); steps run back to
back and the step time is the mean over `--steps` steps after two warm-up steps (the median is kept in
the record as `s_per_step_median`). Results: a markdown table (ratios to plain
PyTorch) and a JSON record with versions and hardware.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

METHODS = ["torch", "zerofit-s0", "zerofit-s1", "zerofit-s2", "zerofit-s3",
           "zerofit-s2-offload", "zerofit-s3-offload", "zerofit-s2-offload-host", "zerofit-s3-offload-host",
           "zerofit-s3-nvme", "zerofit-auto",
           "deepspeed-s2", "deepspeed-s2-offload", "deepspeed-s3-offload", "fsdp2-offload"]


def build_model(args, device: str = "cuda"):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if args.model == "llama":  # Llama-style: --n_embd hidden, --n_layer layers, --n_head heads
        config = LlamaConfig(hidden_size=args.n_embd, num_hidden_layers=args.n_layer,
                             num_attention_heads=args.n_head, intermediate_size=args.intermediate,
                             vocab_size=args.vocab, max_position_embeddings=max(2048, args.seq), use_cache=False)
        cls = LlamaForCausalLM
    else:
        config = GPT2Config(n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head, vocab_size=args.vocab,
                            n_positions=1024, use_cache=False)
        cls = GPT2LMHeadModel
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    return model


def _single_rank_env() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29511"), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1")


def deepspeed_step(method: str, args, ids):
    import deepspeed

    _single_rank_env()
    deepspeed.init_distributed()
    from zerofit.bench.methods import deepspeed_json

    config = deepspeed_json(3 if "s3" in method else 2, "offload" in method, bf16=True, clip=args.clip,
                            micro_batch=args.batch)
    if "offload" in method and args.offload_ratio < 1:  # DeepSpeed's partial offload (ZeRO-3 only)
        config["zero_optimization"]["offload_optimizer"]["ratio"] = args.offload_ratio
    model = build_model(args)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())

    def step():
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss
    return step


def fsdp2_step(args, ids):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    _single_rank_env()
    dist.init_process_group("nccl")
    model = build_model(args, device="cpu")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=mp, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mp_policy=mp, offload_policy=CPUOffloadPolicy())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    return _plain_step(model, opt, ids, args.clip, autocast=False)  # FSDP2's mixed-precision policy casts


def _plain_step(model, opt, ids, clip: float, *, autocast: bool):
    """One training step as a plain PyTorch loop writes it (bf16 autocast when asked)."""
    import contextlib

    import torch

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def run_one(method: str, args) -> dict:
    import torch

    if args.gpu_memory_gib:
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib / total))
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
    if method.startswith("deepspeed"):
        step = deepspeed_step(method, args, ids)
    elif method == "fsdp2-offload":
        step = fsdp2_step(args, ids)
    else:
        step = zerofit_or_torch_step(method, args, ids)
    return measure(method, step, args)


def zerofit_or_torch_step(method: str, args, ids):
    import torch

    # --meta: zerofit materialises the model unit by unit (what a model larger than memory needs)
    model = build_model(args, device="meta" if args.meta and method != "torch" else "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    if method == "torch":
        step = _plain_step(model, opt, ids, args.clip, autocast=True)
    else:
        from zerofit.config.schema import OffloadConfig, PrecisionConfig, ZeroConfig
        from zerofit.engine import ZeroEngine

        if method == "zerofit-auto":
            zero = _planned_zero(model, args)
        else:
            stage = int(method.split("-")[1][1])
            # "-offload": step_on auto (GPU-stepped on CUDA); "-offload-host": the CPU optimizer on host memory
            step_on = "host" if method.endswith("-host") else "auto"
            off = (OffloadConfig(device="cpu", ratio=args.offload_ratio, step_on=step_on, host_share=args.host_share)
                   if "offload" in method else OffloadConfig())
            zero = ZeroConfig(stage=stage, offload_optimizer=off,
                              offload_param=OffloadConfig(device="cpu") if stage == 3 and "offload" in method
                              else OffloadConfig())
        if method.endswith("nvme"):  # optimizer state in files, parameters in host memory
            os.makedirs(args.nvme_path, exist_ok=True)
            zero = ZeroConfig(stage=3, offload_optimizer=OffloadConfig(device="nvme", nvme_path=args.nvme_path),
                              offload_param=OffloadConfig(device="cpu"))
        if args.stream_chunk:
            from zerofit.engine.offload import gpu

            gpu.STREAM_CHUNK = args.stream_chunk  # read when the engine builds its step mode
        engine = ZeroEngine(model, opt, zero=zero, precision=PrecisionConfig(mixed_precision="bf16",
                                                                             optimizer_state=args.optimizer_state),
                            gradient_clipping=args.clip)

        def step():
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            marks[0].record()
            loss = model(input_ids=ids, labels=ids).loss
            marks[1].record()
            engine.backward(loss)
            marks[2].record()
            engine.step()
            marks[3].record()
            step.marks = marks
            return loss
        step.engine = engine
    return step


def _planned_zero(model, args):
    """`stage: auto` with the offload devices, ratio and checkpointing open: what the planner picks at
    prepare() for this model, batch and machine (the same calls Accelerator.prepare makes), printed as
    prepare prints it."""
    import torch

    from zerofit.config.schema import AUTO, OffloadConfig, PrecisionConfig, RunConfig, ZeroConfig
    from zerofit.frontend.planning.auto_plan import (
        apply_checkpointing,
        budget_for,
        host_share_of,
        machine_rates,
        wants_host_share,
    )
    from zerofit.plan.auto import choose, describe

    config = RunConfig(zero=ZeroConfig(stage=AUTO, offload_optimizer=OffloadConfig(device=AUTO, ratio=AUTO,
                                                                                  host_share=args.host_share),
                                       offload_param=OffloadConfig(device=AUTO)),
                       precision=PrecisionConfig(mixed_precision="bf16", optimizer_state=args.optimizer_state))
    device = torch.device("cuda")
    rates = machine_rates(device, 1)
    share = host_share_of(rates, 1, 2) if wants_host_share(config, device) else None
    chosen, result = choose(config, model, world=1, shape=(args.batch, args.seq), budget=budget_for(device, 1),
                            host_share=share, rates=rates)
    apply_checkpointing(chosen, model)  # where the planner turned it on, as prepare() does
    print(describe(config, result), file=sys.stderr, flush=True)
    _planned_zero.label = (result.choice or result.smallest).setting.label
    return chosen.zero


def measure(method: str, step, args) -> dict:
    import torch

    from zerofit.engine import fused_kernels

    times, losses, phases, every, compiled = [], [], [], [], []
    torch.cuda.reset_peak_memory_stats()
    engine = getattr(step, "engine", None)
    # Steps back to back, as in training: each reads its loss (which waits for the main stream only),
    # so work a method leaves on side streams overlaps the next step, as it would in a real loop.
    torch.cuda.synchronize()
    first = _first_steps_trace(args)  # --trace-first: the first three steps, the step-2 stall included
    issue = _IssueProfile(engine) if args.profile_issue else None
    t0 = time.perf_counter()
    for i in range(args.steps + 2):
        before = engine.times.snapshot() if engine is not None else None
        with torch.profiler.record_function("## step") if first is not None else contextlib.nullcontext():
            loss = step()
            losses.append(float(loss))
        t1 = time.perf_counter()
        every.append(t1 - t0)
        compiled.append(getattr(fused_kernels, "compiled", lambda: None)())  # (an older tree's A/B: none)
        if i >= 2:
            times.append(t1 - t0)
            if engine is not None:
                phases.append(_phases(step.marks, before, engine.times.snapshot()))
        if issue is not None:
            issue.after_step(i)
        if first is not None and i == 2:  # written outside the timed spans
            first.stop()
            _export_gz(first, f"{args.trace}.{method}.first.json.gz")
            first = None
            t1 = time.perf_counter()
        t0 = t1
    torch.cuda.synchronize()
    # Back to back, one step's wall time depends on where the host happened to block (work left on side
    # streams lands in the next step's span): the timed steps' total over their count is the throughput.
    s = statistics.fmean(times)
    row = {"method": method, "s_per_step": s, "s_per_step_median": statistics.median(times),
           "tokens_per_s": args.batch * args.seq / s,
           "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
           "host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
           "losses": losses, "times": times, "every_step_s": every, "kernels_compiled_every_step": compiled,
           "optimizer_state": args.optimizer_state}
    if method == "zerofit-auto":
        row["planned"] = _planned_zero.label
    gpu_part = _gpu_part(engine)
    if gpu_part is not None and hasattr(gpu_part, "handover"):  # [Note: handover] (an older tree's A/B: none)
        row["units_kept"] = gpu_part.handover.kept
    if phases:
        row["breakdown_s"] = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
        row["phases_every_step"] = phases  # a step that differs from its neighbours shows here, not in the median
        row["breakdown_s"].update(_copy_times(step))
    if args.profile_cpu:
        row["cpu_profile"] = _cpu_profile(step)
    if issue is not None:
        row["issue_profile"] = issue.report()
    if args.trace:
        _trace(step, f"{args.trace}.{method}.json.gz")
    return row


def _gpu_part(engine):
    """A zerofit engine's GPU-stepped offload part (`GpuStep`), else None (a peer's engine, no GPU-stepped state)."""
    return getattr(getattr(engine, "offload", None), "gpu", None)


class _IssueProfile:
    """--profile-issue: Python's profile of the GPU-stepped stream's issuing thread while it issues the first
    step's stream and while it issues a steady one (the 4th step's): where the first step's issuing time goes."""

    def __init__(self, engine):
        import cProfile

        gpu = _gpu_part(engine)
        self.issuer = gpu.issuer if gpu is not None else None
        self.profiles = {"first": cProfile.Profile(), "steady": cProfile.Profile()}
        self._queue("first", "enable")

    def _queue(self, name: str, what: str) -> None:
        if self.issuer is not None and hasattr(self.issuer, "call"):
            self.issuer.call(getattr(self.profiles[name], what))  # runs on the issuing thread, after its queue

    def after_step(self, i: int) -> None:
        if i == 0:
            self._queue("first", "disable")
        elif i == 2:
            self._queue("steady", "enable")
        elif i == 3:
            self._queue("steady", "disable")

    def report(self) -> dict:
        import io
        import pstats
        import threading

        if self.issuer is None:
            return {}
        done = threading.Event()
        self.issuer.call(done.set)
        done.wait(60)
        out = {}
        for name, prof in self.profiles.items():
            out[name] = []
            for order in ("tottime", "cumulative"):
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats(order).print_stats(22)
                out[name] += text.getvalue().splitlines()[-26:]
        return out


def _first_steps_trace(args):
    """A started profiler (host threads and GPU streams) when `--trace-first` asks for the first steps, else None."""
    if not (args.trace and args.trace_first):
        return None
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.start()
    return prof


def _export_gz(prof, path: str) -> None:
    """The profiler's Chrome trace, gzipped, at `path`."""
    import gzip
    import shutil
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        prof.export_chrome_trace(tmp.name)
        with open(tmp.name, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)


def _trace(step, path: str, steps: int = 3) -> None:
    """A Chrome trace (host threads and GPU streams) of a few more steps, gzipped: where each step's copies,
    kernels and waits fall against one another (chrome://tracing or Perfetto reads it)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("## step"):
                float(step())  # reads the loss, as the timed loop does
        torch.cuda.synchronize()
    _export_gz(prof, path)


def _cpu_profile(step, steps: int = 2) -> list[str]:
    """The host-side ops (every thread) that took the most time over two more steps: what the threads queuing
    the work spend their time on (launches, copies, synchronisations)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:30]
    return [f"{e.key[:60]:60s} calls {e.count // steps:7d}  self {e.self_cpu_time_total / 1e3 / steps:8.1f} ms/step"
            for e in rows]


def _phases(marks, before: dict, after: dict) -> dict:
    """One step's phases: GPU-timeline spans between the marks, host counters of the engine."""
    marks[-1].synchronize()  # the main stream only: side-stream work of the step may still run
    span = [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(3)]
    out = {"forward": span[0], "backward": span[1], "step_call": span[2]}
    for k in ("host_optimizer", "host_publish", "wait_host_step", "wait_grad_download", "nvme_wait", "stream_issue",
              "wait_stream_issue"):
        out[k] = after[k] - before[k]
    return out


def _copy_times(step, steps: int = 2) -> dict:
    """Seconds per step the copy engines spent moving data each way (CUDA profiler, two more steps)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    out = {"copy_to_host": 0.0, "copy_to_gpu": 0.0}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if "DtoH" in e.key:
            out["copy_to_host"] += t / 1e6 / steps
        elif "HtoD" in e.key:
            out["copy_to_gpu"] += t / 1e6 / steps
    return out


def environment() -> dict:
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cpus": os.cpu_count()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--n_embd", type=int, default=1600)
    p.add_argument("--n_layer", type=int, default=48)
    p.add_argument("--n_head", type=int, default=25)
    p.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    p.add_argument("--intermediate", type=int, default=11008, help="llama: MLP width")
    p.add_argument("--vocab", type=int, default=None, help="default: 50257 (gpt2), 32000 (llama)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping (0: none)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing (every method)")
    p.add_argument("--meta", action="store_true", help="zerofit rows: build on the meta device, materialise per unit")
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="cap GPU memory (stands in for a smaller card)")
    p.add_argument("--out", default=None, help="directory for results.json and table.md")
    p.add_argument("--offload-ratio", type=float, default=1.0,
                   help="zerofit offload rows: share of the optimizer state on the CPU (the rest on GPU)")
    p.add_argument("--host-share", type=float, default=None,
                   help="zerofit GPU-stepped offload rows: share of the offloaded state stepped on the CPU instead")
    p.add_argument("--nvme-path", default="/tmp/zerofit-nvme", help="directory for the zerofit-s3-nvme row")
    p.add_argument("--timeout", type=float, default=240, help="seconds per method")
    p.add_argument("--stream-chunk", type=int, default=0, help="zerofit rows: elements per GPU-stepped chunk")
    p.add_argument("--profile-cpu", action="store_true", help="record the host ops of two more steps")
    p.add_argument("--trace", default=None, help="PREFIX: write PREFIX.<method>.json.gz, a trace of 3 more steps")
    p.add_argument("--profile-issue", action="store_true",
                   help="Python's profile of the GPU-stepped issuing thread: the first step's stream, a steady one")
    p.add_argument("--trace-first", action="store_true",
                   help="with --trace: also PREFIX.<method>.first.json.gz, the first 3 steps (timed with it)")
    p.add_argument("--switch-interval", type=float, default=0.0, help="sys.setswitchinterval (s) in each row")
    p.add_argument("--optimizer-state", default="fp32", choices=["fp32", "bf16", "8bit"],
                   help="zerofit rows: precision.optimizer_state")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one method, print JSON
    args = p.parse_args()
    if args.vocab is None:
        args.vocab = 32000 if args.model == "llama" else 50257
    if args.one:
        if args.switch_interval:
            sys.setswitchinterval(args.switch_interval)
        print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return
    rows = []
    passthrough = [a for a in sys.argv[1:] if not a.startswith("--methods")]
    for m in args.methods:
        cmd = [sys.executable, __file__, "--one", m] + [a for a in passthrough if a not in args.methods]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rows.append({"method": m, "error": f"timed out after {args.timeout}s"})
            print(f"{m}: timed out", file=sys.stderr)
            continue
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            rows.append({"method": m, "error": (proc.stderr or proc.stdout)[-3000:]})
            print(f"{m}: FAILED\n{rows[-1]['error']}", file=sys.stderr)
            continue
        rows.append(json.loads(line[7:]))
    table = tables(rows)
    print("\n".join(table))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"workload": vars(args), "environment": environment(), "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write("\n".join(table) + "\n")


PEERS = {"zerofit-s2": ["deepspeed-s2"], "zerofit-s2-offload": ["deepspeed-s2-offload"],
         "zerofit-s3-offload": ["deepspeed-s3-offload", "fsdp2-offload"],
         "zerofit-s2-offload-host": ["deepspeed-s2-offload"], "zerofit-s3-offload-host": ["deepspeed-s3-offload"],
         "zerofit-auto": ["deepspeed-s3-offload", "deepspeed-s2-offload"]}
PHASES = ["forward", "backward", "step_call", "stream_issue", "wait_stream_issue", "host_optimizer", "host_publish",
          "wait_host_step", "wait_grad_download", "copy_to_host", "copy_to_gpu"]


def tables(rows: list[dict]) -> list[str]:
    """The markdown: one row per method with its speed against plain PyTorch and against the peers
    measured in the same run, then the per-step breakdown of zerofit's rows."""
    by = {r["method"]: r for r in rows if "error" not in r}
    base = by.get("torch")
    out = ["| method | s / step | tokens / s | vs plain PyTorch | zerofit's speed-up over peers | GPU peak GiB | "
           "host RSS GiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['method']} | failed | | | | | |")
            continue
        ratio = f"{base['s_per_step'] / r['s_per_step']:.3f}x" if base else "-"
        peers = ", ".join(f"{by[p]['s_per_step'] / r['s_per_step']:.2f}x {p}" for p in PEERS.get(r["method"], [])
                          if p in by)
        name = f"{r['method']} ({r['planned']})" if "planned" in r else r["method"]
        out.append(f"| {name} | {r['s_per_step']:.3f} | {r['tokens_per_s']:,.0f} | {ratio} | {peers} | "
                   f"{r['gpu_peak_gib']:.1f} | {r['host_rss_gib']:.1f} |")
    broken = [r for r in rows if "breakdown_s" in r]
    if broken:
        out += ["", "Per-step breakdown, seconds (GPU timeline: forward, backward, step_call; host threads: the "
                "rest; copies: CUDA profiler):", "",
                "| method | " + " | ".join(PHASES) + " |", "|---|" + "---|" * len(PHASES)]
        for r in broken:
            out.append(f"| {r['method']} | " + " | ".join(f"{r['breakdown_s'].get(k, 0.0):.3f}" for k in PHASES) + " |")
    return out


if __name__ == "__main__":
    main()

"""`zerofit estimate --model SPEC`: GPU and host memory of every setting for one model, offline, in seconds.

The model is built without data (see `zerofit.plan.sources`); activations come from running one
micro-step on fake tensors (`zerofit.plan.activations`); every engine buffer from the engine's own
layout (`zerofit.plan.memory`). One row per setting, fastest first, with whether it fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from zerofit.cli.flags import add_flag

_PRECISIONS = ("bf16", "fp16", "no")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "estimate", allow_abbrev=False, help="memory per ZeRO stage / offload / checkpointing setting (offline)",
        description=__doc__.splitlines()[0],
        epilog="examples:\n"
               "  zerofit estimate --model GPT2Config:n_layer=48,n_embd=1600,n_head=25 --micro_batch 16 --seq 128\n"
               "  zerofit estimate --model ./my-model/config.json --num_processes 8 --gpu_memory_gib 80 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flag(p, "--model", required=True, help="config.json, a saved model directory, a config class with sizes "
             "(LlamaConfig:hidden_size=2048,num_hidden_layers=16), or a cached model name")
    add_flag(p, "--task", default="causal-lm", choices=("causal-lm", "classification"),
             help="which head to build (default causal-lm)")
    add_flag(p, "--num_processes", aliases=("--num_gpus",), type=int, default=1,
             help="ranks (GPUs) the model is sharded over (default 1)")
    add_flag(p, "--gpu_memory_gib", aliases=("--gpu_memory",), type=float, default=None,
             help="GiB per GPU (default: this machine's first GPU)")
    add_flag(p, "--host_memory_gib", aliases=("--host_memory",), type=float, default=None,
             help="GiB of host memory (default: this machine's)")
    add_flag(p, "--gpus_per_host", type=int, default=None,
             help="ranks sharing one host's memory, cores and offload rates (default: --num_processes, one machine)")
    add_flag(p, "--micro_batch", type=int, default=1, help="samples per GPU per micro-step (default 1)")
    add_flag(p, "--seq", type=int, default=512, help="tokens per sample (default 512)")
    add_flag(p, "--gradient_accumulation_steps", type=int, default=1, help="micro-steps per optimizer step")
    add_flag(p, "--mixed_precision", default="bf16", choices=_PRECISIONS, help="compute dtype (default bf16)")
    add_flag(p, "--state_tensors", type=int, default=2, aliases=("--optimizer_states",),
             help="state tensors per parameter: 2 for Adam/AdamW (default), 1 SGD+momentum, 0 SGD")
    add_flag(p, "--optimizer_state", default="fp32", choices=("fp32", "bf16", "8bit"),
             help="how those tensors are stored (precision.optimizer_state): fp32 (default, 4 bytes an element), "
                  "bf16 (2) or 8bit (1.25)")
    add_flag(p, "--checkpointing", default="both", choices=("both", "on", "off"),
             help="activation checkpointing rows to show (default both)")
    add_flag(p, "--offload_ratio", type=_ratio, default="auto",
             help="share of the optimizer state the offloading rows put on the host, whole units from the "
                  "last one backwards (zero_optimization.offload_optimizer.ratio); auto (default): each row "
                  "offloads the least that fits the GPU, as stage: auto does (1.0 when the GPU memory is unknown)")
    add_flag(p, "--step_on", default="auto", choices=("auto", "host", "device"),
             help="where the offloading rows step the state (offload_optimizer.step_on); auto (default): "
                  "device when there is a GPU (this machine's or --gpu_memory_gib), else host")
    add_flag(p, "--host_share", type=_ratio, default=0.0,
             help="share of the GPU-stepped state the offloading rows step on the host at the same time "
                  "(offload_optimizer.host_share; default 0); auto: the share this machine's measured offload "
                  "rates favour (zerofit env --probe), none without them")
    add_flag(p, "--nvme", action="store_true", help="also list ZeRO-3 with the optimizer state on NVMe")
    add_flag(p, "--headroom", type=float, default=0.10, help="fraction of memory kept free (default 0.10)")
    add_flag(p, "--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _ratio(text: str) -> float | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1] or auto (got {text!r})") from None


def _check(args: argparse.Namespace) -> None:
    from zerofit.errors import ZerofitError

    class UsageError(ZerofitError, ValueError):
        pass

    for flag in ("num_processes", "micro_batch", "seq", "gradient_accumulation_steps"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be at least 1 (got {getattr(args, flag)})")
    for flag in ("gpu_memory_gib", "host_memory_gib"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise UsageError(f"--{flag} must be a positive number of GiB (got {value})")
    if args.gpus_per_host is not None and not 1 <= args.gpus_per_host <= args.num_processes:
        raise UsageError(f"--gpus_per_host must be between 1 and --num_processes ({args.num_processes}) (got "
                         f"{args.gpus_per_host})")
    if args.state_tensors < 0:
        raise UsageError(f"--state_tensors must be 0 or more (got {args.state_tensors})")
    if args.offload_ratio != "auto" and not 0 < args.offload_ratio <= 1:
        raise UsageError(f"--offload_ratio must be in (0, 1] (got {args.offload_ratio}): 1.0 offloads all of the "
                         "optimizer state")
    if args.host_share != "auto" and not 0 <= args.host_share <= 1:
        raise UsageError(f"--host_share must be in [0, 1] (got {args.host_share})")
    if not 0 <= args.headroom < 1:
        raise UsageError(f"--headroom must be in [0, 1) (got {args.headroom})")


def run(args: argparse.Namespace) -> int:
    _check(args)
    import torch

    from zerofit.engine.policy import step_on_for
    from zerofit.plan import bandwidth
    from zerofit.plan.choose import machine_budget, plan, traces_for
    from zerofit.plan.memory import ModelCounts, Workload, all_settings
    from zerofit.plan.sharing import shared_rates
    from zerofit.plan.sources import ModelSpecError, build_fake_model

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}[args.mixed_precision]
    fake = build_fake_model(args.model, dtype=dtype, task=args.task)
    work = Workload(world=args.num_processes, mixed_precision=args.mixed_precision, micro_batch=args.micro_batch,
                    seq=args.seq, optimizer_states=args.state_tensors, optimizer_state=args.optimizer_state,
                    gradient_accumulation_steps=args.gradient_accumulation_steps)
    ck = {"both": (False, True), "on": (True,), "off": (False,)}[args.checkpointing]
    budget = machine_budget(gpu_memory_gib=args.gpu_memory_gib, host_memory_gib=args.host_memory_gib,
                            ranks_per_host=args.gpus_per_host or args.num_processes, headroom=args.headroom,
                            host_override="--host_memory_gib")
    counts = ModelCounts.of(fake.model)
    traces = traces_for(fake, work, ck)
    if not traces:
        raise ModelSpecError(f"--model {args.model!r} does not support activation checkpointing: use "
                             "--checkpointing off")
    gpu = budget.gpu_bytes is not None
    step_on = step_on_for(args.step_on, cuda=gpu, nvme=False)
    open_ratio = args.offload_ratio == "auto" and gpu
    ratio = 1.0 if args.offload_ratio == "auto" else args.offload_ratio
    rates = bandwidth.cached() if torch.cuda.is_available() else None
    share = args.host_share
    if share == "auto":
        share = 0.0 if rates is None else bandwidth.best_host_share(
            shared_rates(rates, budget.ranks_per_host), 10**9, param_bytes=_BYTES[args.mixed_precision],
            state_tensors=args.state_tensors)
    shares = [share, 0.0] if share and step_on == "device" else [share if step_on == "device" else 0.0]
    settings = [s for h in shares for s in all_settings(work.world, checkpointing=tuple(traces), nvme=args.nvme,
                                                         offload_ratio=ratio, step_on=step_on, host_share=h)]
    result = plan(counts, work, budget, traces, open_ratio=open_ratio, settings=list(dict.fromkeys(settings)),
                  rates=rates)
    if not gpu:
        # Without a GPU size only the host side can be checked: a choice would treat host memory as the
        # GPU's, so none is made until the user says which GPU the plan is for.
        result = dataclasses.replace(result, choice=None, reason=NO_GPU)
    seconds = result.seconds or {}
    if args.json:
        print(json.dumps(_as_json(args, counts, work, budget, result, seconds), indent=1))
    else:
        print(_as_table(args, counts, budget, result, seconds))
    return 0


_BYTES = {"bf16": 2, "fp16": 2, "no": 4}
NO_GPU = ("none: this machine has no GPU and --gpu_memory_gib was not given, so only host memory is checked; "
          "pass the size of the GPU the run is for, e.g. --gpu_memory_gib 80")


def _row(e, budget, seconds: dict) -> dict:
    return {"added_seconds": seconds.get(e.setting), "host_share": e.setting.host_share, "setting": e.setting.label,
            "stage": e.setting.stage, "offload_optimizer": e.setting.offload_optimizer,
            "offload_param": e.setting.offload_param, "offload_ratio": e.setting.offload_ratio,
            "step_on": e.setting.step_on,
            "checkpointing": e.setting.checkpointing,
            "gpu_bytes": {"params": e.params, "grads": e.grads, "optimizer": e.optimizer,
                          "activations": e.activations, "buffers": e.buffers, "total": e.gpu_total},
            "gpu_bytes_kept_while_generating": e.kept_gathered,  # not in the total: released by training
            "host_bytes": {"params": e.host_params, "grads": e.host_grads, "optimizer": e.host_optimizer,
                           "buffers": e.host_buffers, "total": e.host_total},
            "nvme_bytes": e.nvme, "gpu_fits": budget.gpu_fits(e), "host_fits": budget.host_fits(e),
            "fits": budget.fits(e)}


def _as_json(args, counts, work, budget, result, seconds: dict) -> dict:
    return {"model": args.model, "parameters": counts.numel, "units": len(counts.units),
            "workload": {"num_gpus": work.world, "micro_batch": work.micro_batch, "seq": work.seq,
                         "mixed_precision": work.mixed_precision, "optimizer_states": work.optimizer_states,
                         "optimizer_state": work.optimizer_state,
                         "gradient_accumulation_steps": work.gradient_accumulation_steps},
            "budget": {"gpu_bytes": budget.gpu_bytes, "host_bytes": budget.host_bytes, "headroom": budget.headroom},
            "settings": [_row(e, budget, seconds) for e in result.estimates],
            "choice": result.choice.setting.label if result.choice else None, "reason": result.reason}


def count_said(n: int) -> str:
    """A parameter count in the unit that shows its digits: 1.500 B, 124.4 M, 54.3 k."""
    for scale, unit, digits in ((1e9, "B", 3), (1e6, "M", 1), (1e3, "k", 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return str(n)


def _unit(result) -> tuple[str, int]:
    """GiB, or MiB when every total would round to 0.0x GiB (a tiny model would show only zeros)."""
    largest = max((max(e.gpu_total, e.host_total) for e in result.estimates), default=0)
    return ("GiB", 2**30) if largest >= 2**30 // 10 else ("MiB", 2**20)


def _as_table(args, counts, budget, result, seconds: dict) -> str:
    unit, size = _unit(result)
    gpus = f"{args.num_processes} GPU(s)"
    if budget.gpu_bytes is None:
        gpus += " of unknown size (no GPU here)"
    head = (f"{args.model}: {count_said(counts.numel)} parameters in {len(counts.units)} units; "
            f"{gpus}, micro-batch {args.micro_batch} x {args.seq}, {args.mixed_precision}"
            f"{'' if args.optimizer_state == 'fp32' else f', {args.optimizer_state} optimizer state'}; {unit} per rank")

    def _mem(n: int) -> str:
        return f"{n / size:.2f}"
    cols = ["setting", "params", "grads", "optim", "activ", "buffers", "GPU total", "host pinned", "fits"]
    if seconds:
        cols.append("added s")
    rows = []
    for e in result.estimates:
        fits = {True: "yes", False: "no", None: "?"}
        verdict = fits[budget.fits(e)] if budget.gpu_bytes or budget.host_bytes else "?"
        if budget.gpu_fits(e) is False:
            verdict += " (GPU)"
        elif budget.host_fits(e) is False:
            verdict += " (host)"
        if budget.gpu_bytes is None and budget.host_fits(e):
            verdict = "host ok"  # the GPU side is unknown (see NO_GPU)
        rows.append([e.setting.label, _mem(e.params), _mem(e.grads), _mem(e.optimizer), _mem(e.activations),
                     _mem(e.buffers), _mem(e.gpu_total), _mem(e.host_total), verdict])
        if seconds:
            rows[-1].append("?" if seconds[e.setting] is None else f"{seconds[e.setting]:.3f}")
    widths = [max(len(str(r[i])) for r in [cols, *rows]) for i in range(len(cols))]
    def line(r: list) -> str:
        return "  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in enumerate(zip(r, widths)))

    out = [head, line(cols), line(["-" * w for w in widths]), *map(line, rows), "", f"choice: {result.reason}"]
    kept = max((e.kept_gathered for e in result.estimates), default=0)
    if kept:
        out.append(f"generation at ZeRO-3 keeps {kept / size:.2f} {unit} of gathered weights per rank: generate() and "
                   "evaluation under no_grad between steps keep every unit gathered until the next training "
                   "forward (not in GPU total; zero.max_live_parameters caps it)")
    if seconds:
        out.append("added s: what the setting adds to an optimizer step on this machine's measured rates "
                   "(zerofit env): offloaded state's update, parameter uploads, recomputed forward; "
                   "the fastest that fits is chosen")
    return "\n".join(out)

"""`zerofit bench`: largest batch and epoch time of three fine-tuning workloads, DDP vs zerofit vs DeepSpeed vs FSDP2.

The workloads are the three tables of the Accelerate + DeepSpeed ZeRO blog (DeBERTa-v2-xlarge
classification, BlenderBot-400M seq2seq, GPT-2 XL causal LM), on this machine's hardware.

Every method of every table runs in processes of its own (see `zerofit.bench`): an equal-batch run
from the same weights, the largest batch by doubling and bisection with out-of-memory caught, then
fixed steps at that batch. Writes tables.md, results.json (configs, versions, hardware) and one PNG
per table (with matplotlib: `pip install zerofit[bench]`) under --out.
"""

from __future__ import annotations

import argparse
import sys
import time

from zerofit.cli.flags import add_flag

_TABLES = ("cls", "seq2seq", "clm")
"""The default tables: the blog's three (`llama7b` is the several-GPU scaling workload, asked for by name)."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", allow_abbrev=False, help="largest batch and epoch time: DDP vs zerofit vs DeepSpeed vs FSDP2",
        description=__doc__.splitlines()[0],
        epilog="examples:\n  zerofit bench --gpu_memory_gib 24 --out out/bench\n"
               "  zerofit bench --tables cls --methods ddp zerofit-s2 deepspeed-s2 --steps 3\n"
               "  zerofit bench --tiny --cpu --out /tmp/bench        # the harness on toy models, on CPU\n"
               "  zerofit bench --num_processes 8 --tables clm llama7b --equal_only --equal_batch 8   # step rate\n"
               "  zerofit bench --report out/bench   # tables and plots again from results.json\n"
               "  zerofit bench --merge run1 run2 --out joined       # tables run in pieces, as one\n"
               "  zerofit bench --tables clm --equal_only --budget 450 --timeout 240   # within one 8-minute call\n"
               "  zerofit bench --tables clm --equal_only --methods ddp ddp-compiled zerofit-s3 zerofit-s3-compiled",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flag(p, "--tables", nargs="+", default=list(_TABLES),
             help="which tables: cls (1, DeBERTa-v2-xlarge), seq2seq (2, BlenderBot-400M), clm (3, GPT-2 XL); "
                  "llama7b (4, Llama-2-7B architecture: scaling runs, not in the default list)")
    add_flag(p, "--methods", nargs="+", default=None,
             help="rows (default: each table's own list): ddp, zerofit-sN[-offload], deepspeed-sN[-offload], "
                  "fsdp2[-offload]; a -compiled suffix (not on deepspeed) compiles the row's model as its users do "
                  "(torch.compile around DDP / FSDP2, Accelerator(dynamo_backend=...) for zerofit)")
    add_flag(p, "--compile_backend", default="inductor",
             help="torch.compile backend of the -compiled rows (default inductor; aot_eager compiles fast, for tests)")
    add_flag(p, "--num_processes", aliases=("--nproc",), type=int, default=1,
             help="processes (GPUs) per row; >1 runs each row under torchrun")
    add_flag(p, "--gpu_memory_gib", type=float, default=None,
             help="cap each process's GPU memory (24 stands in for the blog's 24 GB Titan RTX cards)")
    add_flag(p, "--steps", type=int, default=5, help="timed training steps per measurement (default 5)")
    add_flag(p, "--eval_steps", type=int, default=3,
             help="timed eval steps per measurement (default 3; 0 with --equal_only: no eval)")
    add_flag(p, "--warmup", type=int, default=2,
             help="untimed steps before each timed run (default 2: offload rows settle on the second)")
    add_flag(p, "--max_batch", type=int, default=None, help="stop the search here (default 1024; --tiny 16)")
    add_flag(p, "--equal_batch", type=int, default=None, help="the equal-batch column's batch (default: per table)")
    add_flag(p, "--equal_only", action="store_true",
             help="only the equal-batch run: every method at --equal_batch for --warmup + --steps steps from the "
                  "same weights; reports step time, tokens/s, GPU peak and each row's largest loss gap to DDP "
                  "(scaling and parity: --mixed_precision no --warmup 0 --steps 20)")
    add_flag(p, "--mixed_precision", aliases=("--precision",), choices=("bf16", "no"), default=None,
             help="default bf16 on GPU, no (fp32) on CPU")
    add_flag(p, "--clip", type=float, default=1.0, help="gradient clipping for every row (0: none)")
    add_flag(p, "--tiny", action="store_true", help="toy sizes of the same architectures (tests the harness)")
    add_flag(p, "--cpu", action="store_true", help="run on CPU (gloo) even where CUDA is present")
    add_flag(p, "--timeout", type=float, default=900, help="seconds per process before it is stopped")
    add_flag(p, "--budget", type=float, metavar="SECONDS", default=None,
             help="seconds for the whole command: no process runs past them (each one's --timeout is cut to what "
                  "is left) and rows with no time left are recorded as skipped (default: no limit)")
    add_flag(p, "--process_group_timeout", type=float, metavar="SECONDS", default=None,
             help="seconds a collective waits for a hung peer before it raises, in every row (default: torch's "
                  "for DDP, DeepSpeed and FSDP2; launch.process_group_timeout's for zerofit)")
    add_flag(p, "--out", default=None, help="directory for tables.md, results.json and the plots")
    add_flag(p, "--report", metavar="DIR", default=None,
             help="only render tables.md and plots again from DIR/results.json")
    add_flag(p, "--merge", nargs="+", metavar="DIR", default=None,
             help="join the results.json of several runs (tables run in pieces) into --out")
    add_flag(p, "--simulate_oom_above", type=int, default=None, help=argparse.SUPPRESS)  # tests: fake OOMs
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    import os

    from zerofit.bench import report

    if args.merge:
        if not args.out:
            print("zerofit bench: error: --merge needs --out DIR for the joined results", file=sys.stderr)
            return 2
        records = []
        for d in args.merge:
            with open(os.path.join(d, "results.json")) as f:
                records.append(json.load(f))
        for path in report.write(report.merge(records), args.out):
            print(path)
        return 0
    if args.report:
        with open(os.path.join(args.report, "results.json")) as f:
            record = json.load(f)
        for path in report.write(record, args.report):
            print(path)
        return 0
    import torch

    from zerofit.bench.methods import parse
    from zerofit.bench.run import run_row
    from zerofit.bench.workloads import TINY_METHODS, resolve_tables

    try:
        tables = resolve_tables(args.tables)
        for m in args.methods or ():
            parse(m)
    except ValueError as e:
        print(f"zerofit bench: error: {e}", file=sys.stderr)
        return 2
    if args.eval_steps < 1 and not args.equal_only:
        print(f"zerofit bench: error: --eval_steps {args.eval_steps}: the tables' eval column needs at least 1 "
              "timed eval step (0 is for --equal_only runs, which report no eval time)", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available() and not args.cpu
    nproc = args.num_processes
    if nproc > 1 and cuda and torch.cuda.device_count() < nproc:
        print(f"zerofit bench: error: --num_processes {nproc} needs {nproc} GPUs, this machine has "
              f"{torch.cuda.device_count()}: lower --num_processes or add --cpu", file=sys.stderr)
        return 2
    opts = {"device": "cuda" if cuda else "cpu", "precision": args.mixed_precision or ("bf16" if cuda else "no"),
            "clip": args.clip, "steps": args.steps, "eval_steps": args.eval_steps, "warmup": args.warmup,
            "max_batch": args.max_batch or (16 if args.tiny else 1024), "gpu_memory_gib": args.gpu_memory_gib,
            "equal_batch": args.equal_batch or (2 if args.tiny else None), "tiny": args.tiny,
            "simulate_oom_above": args.simulate_oom_above, "nproc": nproc, "equal_only": args.equal_only,
            "process_group_timeout": args.process_group_timeout, "compile_backend": args.compile_backend}
    record = {"command": "zerofit bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None,
              "options": opts, "environment": report.environment(), "tables": []}
    started = time.time()
    deadline = None if args.budget is None else time.monotonic() + args.budget
    for w in tables:
        methods = args.methods or (TINY_METHODS if args.tiny else w.methods)
        print(f"table {w.table} ({w.key}): {', '.join(methods)}", file=sys.stderr, flush=True)
        table = table_record(w, args.tiny, opts["equal_batch"]) | {"rows": []}
        record["tables"].append(table)
        for m in methods:
            table["rows"].append(run_row(w, m, opts, nproc=nproc, timeout=args.timeout,
                                         deadline=deadline).as_record())
            record["seconds"] = round(time.time() - started, 1)
            if args.out:  # after every row: a run stopped half-way keeps what it measured
                written = report.write(record, args.out)
    print("\n".join(report.markdown(record)))
    if args.out:
        print("\n".join(written), file=sys.stderr)
    failed = [f"{t['key']}/{r['method']}" for t in record["tables"] for r in t["rows"] if r["error"]]
    if failed:
        print(f"zerofit bench: {len(failed)} row(s) failed: {', '.join(failed)} (errors in results.json)",
              file=sys.stderr)
    return 1 if failed else 0


def table_record(w, tiny: bool, equal_batch: int | None) -> dict:
    """The workload's description for the record (and the parameter count, from a model on meta)."""
    model = w.build_model(tiny, "meta")
    fields = {k: getattr(w, k) for k in ("key", "table", "title", "task", "train_examples", "eval_examples",
                                         "epoch_note", "equal_batch", "search_eval_batch", "seed_result")}
    return fields | {"equal_batch": equal_batch or w.equal_batch, "seq": w.sequence_length(tiny),
                     "tokens_per_sample": w.tokens_per_sample(tiny), "tiny": tiny,
                     "params": sum(p.numel() for p in model.parameters()),
                     "model_config": w.build_config(tiny).to_dict()}

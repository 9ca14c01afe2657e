"""The tables, the JSON record and the plots of a `zerofit bench` run.

Per row, from the worker's measurements: the largest batch, the train and eval time of one epoch
projected from the median step time over the table's epoch size (`Workload.train_examples`), tokens
per second, peak GPU memory; the speed-up over DDP (epoch time) and over the matching peers; and the
equal-batch columns (every method at the same batch from the same weights: step time and first loss).
A `--equal-only` run (scaling and parity) has only those: step time, tokens per second and GPU peak at
the one batch, the speed against DDP and the peers, and how far each row's losses stray from DDP's.

MFU is the progress line's: [Note: model FLOPs] (`zerofit.plan.flops`, 6 N per token, every parameter
trained) of one GPU's tokens a second against the bf16 matmul rate the planner's probe cached for this
GPU (`zerofit env --probe` measures it); "-" on CPU or where this GPU was never probed. A table with
`-compiled` rows also shows each row's first step apart (the compile is in it; the timed steps come after
`--warmup` steps, so they are free of it) and each compiled row's speed against its eager row.
"""

from __future__ import annotations

import json
import math
import os
import platform
from typing import Any

from zerofit.bench.methods import split_compiled
from zerofit.bench.workloads import BLOG
from zerofit.plan.flops import mfu, train_flops_per_token

# zerofit row -> the peers running the same setting
PEERS = {"zerofit-s1": ("deepspeed-s1",), "zerofit-s2": ("deepspeed-s2",),
         "zerofit-s2-offload": ("deepspeed-s2-offload",),
         "zerofit-s3": ("deepspeed-s3", "fsdp2"), "zerofit-s3-offload": ("deepspeed-s3-offload", "fsdp2-offload")}


def derive(row: dict[str, Any], table: dict[str, Any], world: int, peak_tflops: float | None = None) -> dict[str, Any]:
    """The table's numbers for one row (None where the row has no such measurement); `peak_tflops`: the GPU's
    measured bf16 matmul rate, for MFU (None: no MFU)."""
    t, e = row.get("timing"), row.get("evaluation")
    out: dict[str, Any] = {"status": status(row)}
    if t and e:
        steps = math.ceil(table["train_examples"] / (t["train_batch"] * world))
        eval_steps = math.ceil(table["eval_examples"] / (e["eval_batch"] * world))
        out.update(train_batch=t["train_batch"], eval_batch=e["eval_batch"], train_epoch_s=t["train_s"] * steps,
                   eval_epoch_s=e["eval_s"] * eval_steps,
                   tokens_per_s=t["train_batch"] * world * table["tokens_per_sample"] / t["train_s"],
                   gpu_peak_gib=t.get("gpu_peak_gib"), host_rss_gib=t.get("host_rss_gib"),
                   capped=bool(row.get("done", {}).get("capped")))
        out["mfu"] = _mfu(out["tokens_per_s"] / world, table, peak_tflops)
    eq = row.get("equal")
    out["equal_fits"] = None if eq is None else bool(eq["fits"])
    if out["equal_fits"]:
        out.update(equal_s=eq["train_s"], first_loss=eq["losses"][0], losses=eq["losses"],
                   equal_tokens_per_s=eq["batch"] * world * table["tokens_per_sample"] / eq["train_s"],
                   equal_peak_gib=eq.get("gpu_peak_gib"), first_s=eq.get("first_s"))
        out["equal_mfu"] = _mfu(out["equal_tokens_per_s"] / world, table, peak_tflops)
    return out


def _mfu(tokens_per_s_per_gpu: float, table: dict[str, Any], peak_tflops: float | None) -> float | None:
    """One GPU's model FLOPs utilisation, as the progress line computes it (None without a measured rate)."""
    if not peak_tflops:
        return None
    params = table["params"]
    return mfu(train_flops_per_token(params, params), tokens_per_s_per_gpu, peak_tflops)


def has_compiled(table: dict[str, Any]) -> bool:
    return any(split_compiled(r["method"])[1] for r in table["rows"])


def vs_eager(method: str, d: dict[str, dict[str, Any]], key: str) -> str:
    """A compiled row's speed against its eager row ("1.25x": 1.25 times as fast), "-" where not both ran."""
    base, compiled = split_compiled(method)
    if not compiled or not d.get(base, {}).get(key) or not d[method].get(key):
        return "-"
    return f"{d[base][key] / d[method][key]:.2f}x"


def status(row: dict[str, Any]) -> str:
    if row.get("skipped"):
        return f"skipped: {row['skipped']}"
    if row.get("error"):
        return "timed out" if row["error"].startswith("timed out") else "failed"
    if row.get("done") and row["done"].get("train_batch") == 0:
        return "out of memory at batch 1"
    if row.get("done") and row["done"].get("equal_only") and row.get("equal"):
        return "ok" if row["equal"]["fits"] else f"out of memory at batch {row['equal']['batch']}"
    return "ok" if row.get("evaluation") else "incomplete"


def markdown(record: dict[str, Any]) -> list[str]:
    world = record["options"]["nproc"]
    cap = record["options"].get("gpu_memory_gib")
    hw = record["environment"]
    where = f"{world} x {hw.get('gpu') or 'CPU'}" + (f", capped at {cap:g} GiB each" if cap else "")
    lines = [f"Hardware: {where}; {hw.get('cpus')} CPU cores; torch {hw.get('torch')}, transformers "
             f"{hw.get('transformers')}, DeepSpeed {hw.get('deepspeed') or '-'}; precision "
             f"{record['options']['precision']}, AdamW, clipping {record['options']['clip']:g}; median of "
             f"{record['options']['steps']} steps after {record['options'].get('warmup', 1)} warm-up step(s).", ""]
    if len(record.get("sources", ())) > 1:
        lines += [f"Merged from {len(record['sources'])} runs (`sources` in results.json; timed steps per run: "
                  + ", ".join(str(src["options"]["steps"]) for src in record["sources"]) + ").", ""]
    peak = hw.get("gpu_bf16_tflops") if record["options"].get("device") == "cuda" else None
    if any(has_compiled(t) for t in record["tables"]):
        backend = record["options"].get("compile_backend") or "inductor"
        warm = "the timed steps come after the warm-up step(s)" if record["options"].get("warmup", 1) else \
            "with --warmup 0 it is also the first timed step (the median keeps it out from 3 steps on)"
        lines += [f"Compiled rows: backend {backend}; the first step (compile included) is its own column; {warm}; "
                  "vs eager is the eager row's step time over the compiled row's.", ""]
    lines += [f"MFU: 6 N FLOPs per token against this GPU's measured bf16 matmul rate, {peak:.0f} TFLOP/s "
              "(`zerofit env`)." if peak else "MFU: - (no measured bf16 matmul rate for this GPU: "
              "`zerofit env --probe` measures one; none on CPU).", ""]
    for table in record["tables"]:
        lines += table_markdown(table, world, equal_only=bool(record["options"].get("equal_only")),
                                peak_tflops=peak) + [""]
    return lines


def table_markdown(table: dict[str, Any], world: int, *, equal_only: bool = False,
                   peak_tflops: float | None = None) -> list[str]:
    if equal_only:
        return equal_markdown(table, world, peak_tflops)
    rows = {r["method"]: r for r in table["rows"]}
    d = {m: derive(r, table, world, peak_tflops) for m, r in rows.items()}
    compiled = has_compiled(table)
    base = d.get("ddp", {})
    eval_col = table["search_eval_batch"]
    head = ["method", "largest train batch"] + (["largest eval batch"] if eval_col else []) + [
        "train s / epoch", "eval s / epoch", "tokens / s", "MFU", "GPU peak GiB", "host RSS GiB", "epoch vs DDP",
        "zerofit vs peers", f"s / step at batch {table['equal_batch']}", "first loss"] + (
        ["1st step s", "vs eager"] if compiled else [])
    size = "toy sizes of the " if table.get("tiny") else ""
    out = [f"### Table {table['table']}: {size}{table['title']} ({_millions(table['params'])} parameters)", "",
           f"{table['epoch_note']}; {published(table['seed_result'])}.", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, x in d.items():
        extra = [_num(x.get("first_s"), "{:.2f}"), vs_eager(m, d, "train_epoch_s")] if compiled else []
        if "train_batch" not in x:
            cells = [m, x["status"]] + [""] * (len(head) - 4 - len(extra)) + _equal_cells(x) + extra
            out.append("| " + " | ".join(cells) + " |")
            continue
        batch = f"{'>= ' if x['capped'] else ''}{x['train_batch']}"
        vs_ddp = f"{base['train_epoch_s'] / x['train_epoch_s']:.2f}x" if "train_epoch_s" in base else "-"
        peers = ", ".join(f"{d[p]['train_epoch_s'] / x['train_epoch_s']:.2f}x {p}" for p in PEERS.get(m, ())
                          if "train_epoch_s" in d.get(p, {}))
        cells = [m, batch] + ([str(x["eval_batch"])] if eval_col else []) + [
            f"{x['train_epoch_s']:.1f}", f"{x['eval_epoch_s']:.1f}", f"{x['tokens_per_s']:,.0f}", _pct(x["mfu"]),
            _num(x["gpu_peak_gib"]), _num(x["host_rss_gib"]), vs_ddp, peers or "-"] + _equal_cells(x) + extra
        out.append("| " + " | ".join(cells) + " |")
    return out


def loss_gap(x: dict[str, Any], base: dict[str, Any]) -> float | None:
    """Largest |loss - DDP's loss| over the steps both rows ran (None without both)."""
    if not x.get("losses") or not base.get("losses"):
        return None
    return max(abs(a - b) for a, b in zip(x["losses"], base["losses"]))


def equal_markdown(table: dict[str, Any], world: int, peak_tflops: float | None = None) -> list[str]:
    """Every method at one batch: speed, memory and the loss gap to DDP (scaling and parity runs)."""
    d = {r["method"]: derive(r, table, world, peak_tflops) for r in table["rows"]}
    compiled = has_compiled(table)
    base = d.get("ddp", {})
    steps = len(base.get("losses") or next((x["losses"] for x in d.values() if x.get("losses")), []))
    batch = table["equal_batch"]
    head = ["method", f"s / step at batch {batch} per rank", "tokens / s", "MFU", "GPU peak GiB", "step vs DDP",
            "zerofit vs peers", "first loss", f"max \\|loss - DDP\\| over {steps} steps"] + (
        ["1st step s", "vs eager", "max \\|loss - eager\\|"] if compiled else [])
    size = "toy sizes of the " if table.get("tiny") else ""
    out = [f"### Table {table['table']}: {size}{table['title']} ({_millions(table['params'])} parameters), "
           f"{world} rank(s) at batch {batch} each", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, x in d.items():
        if not x.get("equal_fits"):
            out.append("| " + " | ".join([m, x["status"]] + [""] * (len(head) - 2)) + " |")
            continue
        vs_ddp = f"{base['equal_s'] / x['equal_s']:.2f}x" if "equal_s" in base else "-"
        peers = ", ".join(f"{d[p]['equal_s'] / x['equal_s']:.2f}x {p}" for p in PEERS.get(m, ())
                          if "equal_s" in d.get(p, {}))
        gap = loss_gap(x, base)
        extra = []
        if compiled:
            eager = split_compiled(m)
            eager_gap = loss_gap(x, d.get(eager[0], {})) if eager[1] else None
            extra = [_num(x.get("first_s"), "{:.2f}"), vs_eager(m, d, "equal_s"),
                     "-" if eager_gap is None else f"{eager_gap:.2e}"]
        out.append("| " + " | ".join([m, f"{x['equal_s']:.3f}", f"{x['equal_tokens_per_s']:,.0f}",
                                      _pct(x["equal_mfu"]), _num(x["equal_peak_gib"]), vs_ddp, peers or "-",
                                      f"{x['first_loss']:.4f}", "-" if gap is None else f"{gap:.2e}"] + extra) + " |")
    return out


def _equal_cells(x: dict[str, Any]) -> list[str]:
    if not x["equal_fits"]:
        return ["out of memory" if x["equal_fits"] is False else "", ""]
    return [f"{x['equal_s']:.3f}", f"{x['first_loss']:.4f}"]


def published(text: str) -> str:
    """The blog's numbers as a reader is told them; records written before this wording said "seed, 2 x 24 GB:"."""
    old = "seed, 2 x 24 GB:"
    return text.replace(old, f"{BLOG}:", 1) if text.startswith(old) else text


def _millions(n: int) -> str:
    return f"{n / 1e6:,.0f} M" if n >= 10**7 else f"{n / 1e6:.2f} M"


def _num(v: float | None, form: str = "{:.1f}") -> str:
    return "-" if v is None else form.format(v)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def plots(record: dict[str, Any], out_dir: str) -> list[str]:
    """One PNG per table: train time per epoch and largest batch per method. [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    world = record["options"]["nproc"]
    panels = (("train_epoch_s", "train seconds per epoch (lower is better)"),
              ("train_batch", "largest train batch (higher is better)"))
    if record["options"].get("equal_only"):
        panels = (("equal_s", "seconds per step (lower is better)"), ("equal_tokens_per_s", "tokens per second"))
    written = []
    for table in record["tables"]:
        d = {r["method"]: derive(r, table, world) for r in table["rows"]}
        methods = list(d)
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 0.5 * len(methods) + 1.8))
        for ax, (key, label) in zip((a, b), panels):
            values = [d[m].get(key) or 0 for m in methods]
            ax.barh(methods, values, color=["#c44" if m.startswith("zerofit") else "#888" for m in methods])
            ax.invert_yaxis()
            ax.set_xlabel(label)
            for i, v in enumerate(values):
                ax.text(v, i, f" {v:,.1f}" if isinstance(v, float) else f" {v}" if v else " n/a", va="center")
        hw = record["environment"].get("gpu") or "CPU"
        cap = record["options"].get("gpu_memory_gib")
        fig.suptitle(f"Table {table['table']}: {table['title']}\n{world} x {hw}"
                     + (f", {cap:g} GiB cap" if cap else ""), fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"table{table['table']}_{table['key']}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def environment() -> dict[str, Any]:
    import torch

    import zerofit
    from zerofit.plan.host_memory import meminfo

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "zerofit": zerofit.__version__, "cuda": torch.version.cuda, "cpus": os.cpu_count(),
                           "platform": platform.platform()}
    for name in ("transformers", "deepspeed"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - absent or broken: the record says so
            env[name] = None
    if torch.cuda.is_available():
        from zerofit.plan import bandwidth

        props = torch.cuda.get_device_properties(0)
        rates = bandwidth.cached(0)  # the probe's rate, as the progress line reads it (None: never probed)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   gpus=torch.cuda.device_count(), gpu_bf16_tflops=None if rates is None else rates.gpu_tflops)
    total = meminfo().get("MemTotal")
    if total is not None:
        env["host_memory_gib"] = round(total / 2**30, 1)
    return env


def merge(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from several runs (tables run in pieces): rows join their table in run order, a later
    run's row replaces an earlier one of the same method in its place; each row keeps the index of its run in `sources`
    (a record that is itself merged contributes all its runs)."""
    out = {"options": records[0]["options"], "environment": records[0]["environment"], "tables": [], "sources": []}
    tables: dict[str, dict[str, Any]] = {}
    for record in records:
        first = len(out["sources"])  # a merged record brings its own sources along, rows keep pointing at theirs
        out["sources"] += (record.get("sources")
                           or [{k: record.get(k) for k in ("command", "options", "seconds", "note")}])
        if record["options"]["nproc"] != out["options"]["nproc"]:
            raise ValueError(f"cannot merge runs with {out['options']['nproc']} and {record['options']['nproc']} "
                             "processes per row into one table")
        for table in record["tables"]:
            if table["key"] not in tables:
                tables[table["key"]] = table | {"rows": []}
                out["tables"].append(tables[table["key"]])
            rows = tables[table["key"]]["rows"]
            for row in table["rows"]:
                new = row | {"source": first + row.get("source", 0)}
                at = next((i for i, r in enumerate(rows) if r["method"] == row["method"]), None)
                if at is None:
                    rows.append(new)
                else:
                    rows[at] = new  # a later run of a row replaces it in its place
    out["tables"].sort(key=lambda t: t["table"])
    return out


def write(record: dict[str, Any], out_dir: str) -> list[str]:
    """results.json, tables.md and the plots under `out_dir`; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "results.json"), os.path.join(out_dir, "tables.md")]
    with open(paths[0], "w") as f:
        json.dump(record, f, indent=1)
    with open(paths[1], "w") as f:
        f.write("\n".join(markdown(record)) + "\n")
    return paths + plots(record, out_dir)

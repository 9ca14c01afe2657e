"""The report of benchmarks/state_quality.py: summary.md and the PNG of the loss curves, from the rows' JSON records.

Gap of a row to its reference (its own regime's fp32-state row, `reference` in the record): both training-loss
curves smoothed with a trailing mean over `window` steps, then max over steps >= `gap_from` (past the warm-up) of
|smoothed row - smoothed reference| / smoothed reference, over the steps both rows ran.
"""

from __future__ import annotations

import glob
import json
import os

ORDER = ["zerofit-fp32", "zerofit-bf16", "zerofit-8bit", "torch-adamw", "torchao-8bit"]
LIMIT = 0.01
"""Issue #39's bar: bf16 and 8-bit state within 1 % of fp32 state after warm-up."""


def load(folder: str) -> dict[str, dict]:
    rows = {}
    for path in glob.glob(os.path.join(folder, "*.json")):
        if path.endswith(".failed.json"):  # a failed row's first record, kept beside its rerun's
            continue
        with open(path) as f:
            record = json.load(f)
        if isinstance(record, dict) and "row" in record:
            rows[record["row"]] = record
    return dict(sorted(rows.items(), key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER)))


def smooth(losses: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, x in enumerate(losses):
        total += x
        if i >= window:
            total -= losses[i - window]
        out.append(total / min(i + 1, window))
    return out


def relative(row: dict, ref: dict) -> list[float]:
    """(smoothed row - smoothed reference) / smoothed reference per step both ran (step k at index k - 1)."""
    w = row["config"]["window"]
    a, b = smooth(row["train_loss"], w), smooth(ref["train_loss"], w)
    return [(x - y) / y for x, y in zip(a, b)]


def max_gap(row: dict, ref: dict) -> tuple[float, int] | None:
    """(largest |relative difference| over steps >= gap_from, its step), None when the rows share no such step."""
    rel = relative(row, ref)
    start = row["config"]["gap_from"]
    tail = [(abs(r), k + 1) for k, r in enumerate(rel) if k + 1 >= start]
    return max(tail) if tail else None


def final_train(row: dict) -> float:
    """Mean training loss of the last 50 steps (all of them when fewer ran)."""
    tail = row["train_loss"][-50:]
    return sum(tail) / len(tail)


def _ran(row: dict | None) -> bool:
    return bool(row) and "skipped" not in row and bool(row.get("train_loss"))


def write_summary(folder: str) -> str:
    """Write folder/summary.md (and folder/state_quality.png where matplotlib imports); return the markdown."""
    rows = load(folder)
    text = summary(rows)
    with open(os.path.join(folder, "summary.md"), "w") as f:
        f.write(text + "\n")
    try:
        plot(folder, os.path.join(folder, "state_quality.png"))
    except ImportError as e:
        text += f"\n\n(no plot: {e}; run `python benchmarks/state_quality.py --plot {folder}` where matplotlib is)"
    return text


def summary(rows: dict[str, dict]) -> str:
    ran = {k: r for k, r in rows.items() if _ran(r)}
    if not ran:
        return "# Optimizer state quality\n\nNo row ran: " + "; ".join(f"{k}: {r.get('skipped', 'no steps')}"
                                                                        for k, r in rows.items())
    any_row = next(iter(ran.values()))
    c, env, corpus = any_row["config"], any_row["environment"], any_row.get("corpus", {})
    out = ["# Optimizer state in fewer bits: loss curves (issue #39)", "",
           f"GPT-2 architecture n_embd {c['n_embd']}, {c['n_layer']} layers, {c['n_head']} heads, byte vocabulary, "
           f"random init; batch {c['batch']} x {c['seq']}, {c['steps']} steps, AdamW lr {c['lr']} (warm-up "
           f"{c['warmup']}, cosine to 0.1x), clip {c['clip']}; {env['device']}, torch {env['torch']}, "
           f"transformers {env['transformers']}" + (f", torchao {env['torchao']}" if "torchao" in env else "")
           + f"; corpus {corpus.get('files')} files, sha256 {str(corpus.get('sha256'))[:16]}, data order "
           f"{any_row.get('data_sha')}.", "",
           f"Gap: trailing mean over {c['window']} steps, max over steps >= {c['gap_from']} of |row - reference| / "
           "reference (reference: the fp32-state row of the same precision regime).", "",
           "| row | steps | final train loss (mean of last 50) | held-out loss | reference | max gap | at step | "
           "final train vs reference | held-out vs reference | clipped after warm-up | train s (wall) | "
           "GPU peak GiB (reserved) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        if not _ran(row):
            out.append(f"| {name} | skipped: {row.get('skipped', 'no steps')} |||||||||| ")
            continue
        ref = ran.get(row.get("reference") or "")
        gap = max_gap(row, ref) if ref else None
        ended = " (stopped early)" if row.get("stopped_early") else " (failed)" if row.get("error") else ""
        cells = [name, str(len(row["train_loss"])) + ended,
                 f"{final_train(row):.4f}", f"{row['eval'][-1][1]:.4f}", row.get("reference") or "-",
                 f"{gap[0]:.2%}" if gap else "-", str(gap[1]) if gap else "-",
                 f"{final_train(row) / final_train(ref) - 1:+.2%}" if ref else "-",
                 f"{row['eval'][-1][1] / ref['eval'][-1][1] - 1:+.2%}" if ref else "-",
                 clipped_share(row),
                 f"{row.get('train_s', 0):.0f}",
                 f"{row['gpu_peak_gib']:.1f} ({row['gpu_reserved_gib']:.1f})" if "gpu_peak_gib" in row else "-"]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", *verdicts(ran), "", "Rows may have shared the GPU two at a time (benchmarks/state_quality_gpu.sh): "
            "the wall times are not speeds."]
    return "\n".join(out)


def clipped_share(row: dict) -> str:
    """Steps after warm-up whose gradient norm exceeded the clip (the share a step speculating that clipping does
    not bite would redo; see [Note: clipping and the overlapped step] in zerofit.engine.offload.early)."""
    norms = row.get("grad_norm", [])[row["config"]["warmup"]:]
    if not norms:
        return "-"
    return f"{sum(n > row['config']['clip'] for n in norms) / len(norms):.0%} of {len(norms)}"


def verdicts(ran: dict[str, dict]) -> list[str]:
    out = []
    for name in ("zerofit-bf16", "zerofit-8bit"):
        row, ref = ran.get(name), ran.get("zerofit-fp32")
        gap = max_gap(row, ref) if row and ref else None
        if gap:
            out.append(f"- {name} within {LIMIT:.0%} of zerofit-fp32 after warm-up: "
                       f"{'yes' if gap[0] <= LIMIT else 'NO'} (max gap {gap[0]:.2%} at step {gap[1]})")
    ours, theirs = ran.get("zerofit-8bit"), ran.get("torchao-8bit")
    if ours and theirs and "zerofit-fp32" in ran and "torch-adamw" in ran:
        g_ours, g_theirs = max_gap(ours, ran["zerofit-fp32"]), max_gap(theirs, ran["torch-adamw"])
        e_ours = ours["eval"][-1][1] / ran["zerofit-fp32"]["eval"][-1][1] - 1
        e_theirs = theirs["eval"][-1][1] / ran["torch-adamw"]["eval"][-1][1] - 1
        if g_ours and g_theirs:
            # A held-out loss below the row's own fp32 row is no loss of quality: only the excess over it counts.
            worse = [w for w, bad in (("max gap", g_ours[0] > g_theirs[0]),
                                      ("held-out excess over fp32", max(e_ours, 0) > max(e_theirs, 0))) if bad]
            out.append(f"- zerofit-8bit vs torchao-8bit, each against its own fp32 row: max gap {g_ours[0]:.2%} vs "
                       f"{g_theirs[0]:.2%}, final held-out {e_ours:+.2%} vs {e_theirs:+.2%}: "
                       + ("no worse" if not worse else "worse on " + " and ".join(worse)))
    else:
        out.append("- zerofit-8bit vs torchao-8bit: not compared (a row is missing)")
    return out


def plot(folder: str, png: str) -> None:
    """Two panels: the smoothed training loss of every row (held-out losses as dots), and each narrow row's
    relative difference to its own fp32 row (the +-1 % band shaded; the warm-up's end as a vertical line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {k: r for k, r in load(folder).items() if _ran(r)}
    if not ran:
        raise SystemExit(f"--plot {folder}: no row with a curve there")
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    spread = 2.0  # % shown either side of zero: at least the 1 % band, at most what the curves need past warm-up
    for name, row in ran.items():
        w = row["config"]["window"]
        style = "-" if name.startswith("zerofit") else "--"
        (line,) = left.plot(range(1, len(row["train_loss"]) + 1), smooth(row["train_loss"], w), style, label=name,
                            linewidth=1.2)
        left.plot(*zip(*row["eval"]), "o", color=line.get_color(), markersize=3)
        ref = ran.get(row.get("reference") or "")
        if ref and name != "zerofit-fp32":
            rel = [100 * r for r in relative(row, ref)]
            spread = max([spread, *map(abs, rel[row["config"]["gap_from"] - 1:])])
            right.plot(range(1, len(rel) + 1), rel, style, color=line.get_color(),
                       label=f"{name} vs {row['reference']}", linewidth=1.2)
    c = next(iter(ran.values()))["config"]
    left.set(xlabel="step", ylabel=f"training loss (trailing mean of {c['window']}); dots: held-out",
             title="Loss per optimizer-state setting")
    left.set_ylim(top=min(left.get_ylim()[1], 6.0))
    right.axhspan(-100 * LIMIT, 100 * LIMIT, color="0.9")
    right.axvline(c["gap_from"], color="0.6", linewidth=0.8)
    right.set(xlabel="step", ylabel="% difference to the fp32-state row", title="Narrow state vs fp32 state",
              ylim=(-1.1 * spread, 1.1 * spread))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)

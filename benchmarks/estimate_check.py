"""`zerofit estimate` against measured GPU peaks: three models, several settings, one GPU.

    python benchmarks/estimate_check.py --out results/estimate      # on a GPU, about 3-4 minutes on an H200
    python benchmarks/estimate_check.py --tiny --out /tmp/est        # CPU, tiny models: the script end to end

For each (model, setting) a fresh process builds the model from its config (random init, no hub),
hands it to zerofit's engine in bf16 with AdamW and clipping 1.0, runs `--steps` steps, and reports
`torch.cuda.max_memory_allocated()` (reset after the build) and the process's resident memory. The
estimate for the same model and setting comes from `zerofit.plan` in the parent. On CPU (--tiny)
there is no allocator peak to read: the rows carry the estimate and the measured host memory only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

MODELS = {
    # name: (config class, sizes, task, micro-batch, sequence)
    "gpt2-xl": ("GPT2Config", "n_layer=48,n_embd=1600,n_head=25,n_positions=1024", "causal-lm", 16, 128),
    "llama-1b": ("LlamaConfig", "hidden_size=2048,intermediate_size=5504,num_hidden_layers=16,num_attention_heads=16,"
                 "num_key_value_heads=16,vocab_size=32000,max_position_embeddings=1024", "causal-lm", 8, 512),
    "bert-large-cls": ("BertConfig", "hidden_size=1024,num_hidden_layers=24,num_attention_heads=16,"
                       "intermediate_size=4096,num_labels=2", "classification", 32, 128),
}
TINY = {
    "gpt2-tiny": ("GPT2Config", "n_layer=2,n_embd=64,n_head=4,vocab_size=128,n_positions=64", "causal-lm", 4, 32),
    "bert-tiny-cls": ("BertConfig", "hidden_size=64,num_hidden_layers=2,num_attention_heads=4,intermediate_size=128,"
                      "vocab_size=128,num_labels=2", "classification", 4, 32),
}
# setting name: (stage, offload_optimizer, offload_param, checkpointing)
SETTINGS = {
    "s0": (0, "none", "none", False),
    "s0-ckpt": (0, "none", "none", True),
    "s2-offload": (2, "cpu", "none", False),
    "s3-offload": (3, "cpu", "cpu", False),
    "s3-offload-ckpt": (3, "cpu", "cpu", True),
}
PLAN = {"gpt2-xl": ["s0", "s0-ckpt", "s2-offload", "s3-offload"], "llama-1b": ["s0", "s3-offload-ckpt"],
        "bert-large-cls": ["s0", "s2-offload"]}


def _spec(entry) -> str:
    cls, sizes, *_ = entry
    return f"{cls}:{sizes}"


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(entry, setting: str, steps: int, device_name: str) -> dict:
    """Build, train `steps` steps, report peaks (runs in its own process)."""
    import torch
    import transformers

    from zerofit.config.schema import OffloadConfig, PrecisionConfig, ZeroConfig
    from zerofit.engine import ZeroEngine
    from zerofit.plan.sources import load_hf_config

    cls, sizes, task, batch, seq = entry
    stage, opt_dev, param_dev, ckpt = SETTINGS[setting]
    config = load_hf_config(f"{cls}:{sizes}")
    config.use_cache = False
    auto = transformers.AutoModelForSequenceClassification if task == "classification" \
        else transformers.AutoModelForCausalLM
    device = torch.device(device_name)
    torch.manual_seed(0)
    with device:
        model = auto.from_config(config)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    zero = ZeroConfig(stage=stage, offload_optimizer=OffloadConfig(device=opt_dev),
                      offload_param=OffloadConfig(device=param_dev))
    engine = ZeroEngine(model, opt, zero=zero, precision=PrecisionConfig(mixed_precision="bf16"),
                        gradient_clipping=1.0, device=device)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    labels = torch.randint(0, config.num_labels, (batch,), device=device) if task == "classification" else ids
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
    engine.settle()
    if cuda:
        torch.cuda.synchronize()
    return {"gpu_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None, "host_rss_bytes": _rss_bytes(),
            "s_per_step": (time.perf_counter() - t0) / steps, "loss": float(loss)}


def estimate_for(entry, setting: str) -> dict:
    import torch

    from zerofit.plan.activations import trace_step
    from zerofit.plan.choose import HOST_BASELINE_BYTES
    from zerofit.plan.memory import ModelCounts, Setting, Workload, estimate
    from zerofit.plan.sources import build_fake_model

    _, _, task, batch, seq = entry
    stage, opt_dev, param_dev, ckpt = SETTINGS[setting]
    fake = build_fake_model(_spec(entry), dtype=torch.bfloat16, task=task)
    work = Workload(micro_batch=batch, seq=seq)
    est = estimate(ModelCounts.of(fake.model), Setting(stage=stage, offload_optimizer=opt_dev,
                                                       offload_param=param_dev, checkpointing=ckpt),
                   work, trace_step(fake, batch=batch, seq=seq, checkpointing=ckpt))
    return {"gpu_bytes": est.gpu_total, "activation_bytes": est.activations,
            "host_bytes": est.host_total + HOST_BASELINE_BYTES}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="directory for estimate_check.json and estimate_check.md")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny models on CPU (checks the script, measures no GPU)")
    p.add_argument("--models", nargs="+", default=None, help="subset of the models")
    p.add_argument("--settings", nargs="+", default=None, choices=sorted(SETTINGS),
                   help="only these settings (of each model's list)")
    p.add_argument("--timeout", type=float, default=150, help="seconds per (model, setting) process")
    p.add_argument("--one", nargs=2, default=None, help=argparse.SUPPRESS)  # internal: model setting
    args = p.parse_args()
    models = TINY if args.tiny else MODELS
    device = "cpu" if args.tiny else "cuda"
    if args.one:
        print("RESULT " + json.dumps(measure(models[args.one[0]], args.one[1], args.steps, device)), flush=True)
        return
    plan = {m: ["s0", "s0-ckpt", "s2-offload", "s3-offload"] for m in models} if args.tiny else PLAN
    rows = []
    for name in args.models or list(models):
        for setting in [s for s in plan[name] if args.settings is None or s in args.settings]:
            row = {"model": name, "setting": setting, **estimate_for(models[name], setting)}
            cmd = [sys.executable, __file__, "--one", name, setting, "--steps", str(args.steps)] + (
                ["--tiny"] if args.tiny else [])
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    row["error"] = (proc.stderr or proc.stdout)[-2000:]
                else:
                    row.update(json.loads(line[7:]))
            except subprocess.TimeoutExpired:
                row["error"] = f"timed out after {args.timeout}s"
            if row.get("gpu_peak_bytes"):
                row["gpu_error_pct"] = 100 * (row["gpu_bytes"] - row["gpu_peak_bytes"]) / row["gpu_peak_bytes"]
            if row.get("host_rss_bytes"):
                row["host_error_pct"] = 100 * (row["host_bytes"] - row["host_rss_bytes"]) / row["host_rss_bytes"]
            rows.append(row)
            print(_line(row), flush=True)
    table = ["| model | setting | GPU estimate GiB | GPU measured GiB | error % | host estimate GiB | "
             "host RSS GiB | error % |", "|---|---|---|---|---|---|---|---|"] + [_line(r) for r in rows]
    print("\n".join(table))
    if args.out:
        import torch
        import transformers

        os.makedirs(args.out, exist_ok=True)
        env = {"python": platform.python_version(), "torch": torch.__version__,
               "transformers": transformers.__version__,
               "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
        with open(os.path.join(args.out, "estimate_check.json"), "w") as f:
            json.dump({"environment": env, "steps": args.steps, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "estimate_check.md"), "w") as f:
            f.write("\n".join(table) + "\n")


def _line(r: dict) -> str:
    def gib(key):
        return f"{r[key] / 2**30:.2f}" if r.get(key) is not None else "-"

    def pct(key):
        return f"{r[key]:+.1f}" if r.get(key) is not None else "-"
    if "error" in r:
        return f"| {r['model']} | {r['setting']} | {gib('gpu_bytes')} | failed: {r['error'][-200:]!r} | | | | |"
    return (f"| {r['model']} | {r['setting']} | {gib('gpu_bytes')} | {gib('gpu_peak_bytes')} | "
            f"{pct('gpu_error_pct')} | {gib('host_bytes')} | {gib('host_rss_bytes')} | {pct('host_error_pct')} |")


if __name__ == "__main__":
    main()

"""Muon beside AdamW on a pretrained checkpoint, as torch documents them, under zerofit and under plain PyTorch.

    python benchmarks/trainer_clm.py --make_checkpoint DIR --hidden 1536 --layers 16 --heads 12 --intermediate 4096
    python benchmarks/muon.py --model DIR --result torch.json                              # plain PyTorch, one process
    zerofit launch --config_file s2_gpu_stepped.yaml benchmarks/muon.py --model DIR --zerofit --result s2.json

The script is a user's: `AutoModelForCausalLM.from_pretrained(DIR)`, `torch.optim.Muon` over the 2-D weights of
the decoder layers, `torch.optim.AdamW` over everything else (embeddings, head, norms), both stepped every
step after `clip_grad_norm_(1.0)`, on a fixed synthetic token batch. With `--zerofit` it runs through
`zerofit.Accelerator` (the two optimizers prepared with the model); without, as plain PyTorch on one
device (fp32 master weights; `--bf16` computes under `torch.autocast`, zerofit under its bf16 setting).
Rank 0 writes one JSON record (losses, step times and their median after `--warmup`, GPU peak) to
`--result` and prints it on one line starting `muon:`.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import records
import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--zerofit", action="store_true", help="train through zerofit.Accelerator (under zerofit launch)")
    p.add_argument("--bf16", action="store_true", help="bf16 compute (plain PyTorch: autocast)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--result", default=None)
    return p.parse_args(argv)


def optimizers(model: torch.nn.Module):
    """Muon over the decoder layers' matrices, AdamW over the rest (torch's documented split)."""
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and ".layers." in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and ".layers." in n)]
    return torch.optim.Muon(matrices, lr=2e-3, weight_decay=0.1), torch.optim.AdamW(rest, lr=2e-4, weight_decay=0.1)


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    acc = None
    if args.zerofit:
        from zerofit import Accelerator

        acc = Accelerator()
        device = acc.device
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if acc is None:
        model.to(device)
    muon, adamw = optimizers(model)
    if acc is not None:
        model, muon, adamw = acc.prepare(model, muon, adamw)
    model.train()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    batch = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
    rank = acc.process_index if acc is not None else 0
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 and acc is None
                else contextlib.nullcontext())
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        start = time.perf_counter()
        with autocast:
            loss = model(input_ids=batch, labels=batch).loss
        if acc is not None:
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    record = {"run": "zerofit" if acc is not None else "torch", "losses": losses, "times": times,
              "median_s": records.median_after(times, args.warmup),
              "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
              "params": sum(p.numel() for p in model.parameters()) if acc is None else None}
    if acc is not None:
        from zerofit.frontend.banner import describe_engine

        record["setting"] = describe_engine(acc._prepared.engine_of(model), num_processes=acc.num_processes,
                                            backend=None)
    if rank == 0:
        records.emit(record, args.result, "muon", indent=None)


if __name__ == "__main__":
    main()

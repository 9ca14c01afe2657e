"""The README's main job: a tiny character-level transformer trained with zerofit on shipped text.

    zerofit demo                      # = zerofit launch --cpu --num_processes 2 -m zerofit.demo.train
    zerofit demo --stage 3 --steps 40 --mixed_precision bf16

Each rank reads its own slice of every global batch; the ZeRO stage comes from the launcher's config
(`--config_file`) unless `--stage` is given. Rank 0 prints the loss of every step and a summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from importlib import resources

import torch
import torch.distributed as dist
from torch import nn

from zerofit import runtime
from zerofit.engine import ZeroEngine


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyCharLM(nn.Module):
    def __init__(self, vocab: int, dim: int = 64, layers: int = 4, heads: int = 4, context: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)  # tied to the head: keep the first logits small

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def load_corpus() -> tuple[torch.Tensor, int]:
    text = resources.files("zerofit.demo").joinpath("corpus.txt").read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), len(chars)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=None, help="ZeRO stage (default: config)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch_size", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mixed_precision", choices=["no", "bf16", "fp16"], default=None)
    args = p.parse_args(argv)

    config = runtime.current_config()
    dist.init_process_group(runtime.backend(config))
    rank, world = dist.get_rank(), dist.get_world_size()
    zero = config.zero if args.stage is None else dataclasses.replace(config.zero, stage=args.stage)
    precision = config.precision
    if args.mixed_precision is not None or not isinstance(precision.mixed_precision, str):
        precision = dataclasses.replace(precision, mixed_precision=args.mixed_precision or "no")
    if args.batch_size % world:
        raise SystemExit(f"--batch_size {args.batch_size} must be divisible by the {world} processes")

    data, vocab = load_corpus()
    torch.manual_seed(0)
    model = TinyCharLM(vocab, context=args.context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    engine = ZeroEngine(model, optimizer, zero=zero, precision=precision, gradient_clipping=1.0,
                        device=runtime.device(config))
    if rank == 0:
        n = sum(g.numel for g in engine.groups)
        print(f"zerofit demo: {n:,} parameters in {len(engine.units)} units, ZeRO stage {zero.stage}, "
              f"{world} processes ({runtime.backend(config)}), precision {precision.mixed_precision}")

    gen = torch.Generator().manual_seed(1)
    micro = args.batch_size // world
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.context - 1, (args.batch_size,), generator=gen)
        mine = starts[rank * micro:(rank + 1) * micro]
        x = torch.stack([data[s:s + args.context] for s in mine]).to(engine.device)
        y = torch.stack([data[s + 1:s + 1 + args.context] for s in mine]).to(engine.device)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    if rank == 0:
        took = time.perf_counter() - start
        print(f"done: loss {losses[0]:.3f} -> {losses[-1]:.3f} (uniform guess {math.log(vocab):.3f}) "
              f"in {took:.1f}s, {args.steps * args.batch_size * args.context / took:,.0f} tokens/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

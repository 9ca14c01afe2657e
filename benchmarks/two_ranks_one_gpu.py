"""Two ranks on one GPU through gloo (NCCL refuses two ranks on one device): stages 1-3, with and
without GPU-stepped and host-stepped offload, each against the same run on CPU. It exercises the
engine's stream and event paths with more than one rank, which CPU runs never do.

    PYTHONPATH=src:tests python benchmarks/two_ranks_one_gpu.py
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch  # noqa: E402
from engine_cases import Case, run_engine  # noqa: E402

from zerofit.testing.distributed import run_distributed  # noqa: E402

CASES = [Case(stage=s, gas=g, clip=0.05, steps=6) for s in (1, 2, 3) for g in (1, 2)]
CASES += [dataclasses.replace(c, offload="cpu", step_on=on) for c in CASES[:] for on in ("device", "host")]
CASES += [dataclasses.replace(c, offload_param="cpu") for c in CASES if c.stage == 3 and c.offload == "cpu"]


def _ranks(rank, world, device):
    torch.backends.cuda.matmul.allow_tf32 = False
    out = []
    for c in CASES:
        try:
            r = run_engine(rank, world, c, record_grads=False, device=device)
            out.append({"params": r["params"], "losses": r["losses"]})
        except Exception as e:  # noqa: BLE001 - reported per case
            out.append({"error": f"{type(e).__name__}: {str(e)[:300]}"})
    return out


def main() -> None:
    cuda = run_distributed(_ranks, 2, "cuda", timeout=500)[0]
    cpu = run_distributed(_ranks, 2, "cpu", timeout=500)[0]
    print("| case | result | max param diff vs CPU |")
    print("|---|---|---|")
    for c, g, h in zip(CASES, cuda, cpu):
        name = f"stage {c.stage} gas {c.gas} offload {c.offload}/{c.step_on} param {c.offload_param}"
        if "error" in g or "error" in h:
            print(f"| {name} | {g.get('error') or h.get('error')} | |")
            continue
        diff = max((g["params"][k] - h["params"][k]).abs().max().item() for k in g["params"])
        print(f"| {name} | ran | {diff:.2e} |")


if __name__ == "__main__":
    main()

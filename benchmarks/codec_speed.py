"""The optimizer step's elementwise plumbing on the device, per 16 M-element chunk (a GPU-stepped slot): the
state codec's encode and decode (bf16 and 8-bit, against the fp32 copy they replace) and the split master's
split and join, each with the fused kernels ([Note: fused kernels] in zerofit.engine.fused_kernels) and with
torch's ops. Prints one line per case."""

from __future__ import annotations

import torch

from zerofit.engine import fused_kernels
from zerofit.engine.offload import master_split
from zerofit.engine.state_codec import Codec


def _ms(fn, *args, reps: int = 20) -> float:
    for _ in range(3):
        fn(*args)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(reps):
        fn(*args)
    ev[1].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) / reps


def main() -> None:
    dev = torch.device("cuda")
    n = 1 << 24
    x = torch.randn(n, device=dev) * 1e-3
    out = torch.empty_like(x)
    param = x.to(torch.bfloat16)
    packed = torch.empty(master_split.packed_bytes(n), dtype=torch.uint8, device=dev)
    scratch = torch.empty(master_split.scratch_bytes(n), dtype=torch.uint8, device=dev)
    for fused in (True, False):
        fused_kernels.ENABLED = fused
        path = "fused" if fused else "torch"
        for kind in ("fp32", "bf16", "8bit"):
            codec = Codec(kind)
            stored = codec.empty(n, dev)
            for key in ("exp_avg", "exp_avg_sq"):
                src = x.abs() if key == "exp_avg_sq" else x
                enc = _ms(codec.encode, src, stored, key)
                dec = _ms(codec.decode, stored, out, key)
                err = ((out - src).abs().max() / src.abs().max()).item()
                print(f"codec {path} {kind:5s} {key:10s} encode {enc:.3f} ms  decode {dec:.3f} ms per 16M elements  "
                      f"stored {stored.nbytes / n:.3f} B/elem  max err {err:.2e} of max")
        split = _ms(master_split.split, x, param, packed, scratch)
        join = _ms(master_split.join, packed, param, out, scratch)
        print(f"split master {path}: split {split:.3f} ms  join {join:.3f} ms per 16M elements  "
              f"exact {torch.equal(out, x)}")
    fused_kernels.ENABLED = True


if __name__ == "__main__":
    main()

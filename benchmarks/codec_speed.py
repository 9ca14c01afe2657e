"""The optimizer-state codec's speed on the device: encode and decode of one 16 M-element chunk (a GPU-stepped
slot), bf16 and 8-bit, against the fp32 copy it replaces. Prints one line per codec."""

from __future__ import annotations

import torch

from zerofit.engine.state_codec import Codec


def main() -> None:
    dev = torch.device("cuda")
    n = 1 << 24
    x = torch.randn(n, device=dev) * 1e-3
    out = torch.empty_like(x)
    for kind in ("fp32", "bf16", "8bit"):
        codec = Codec(kind)
        stored = codec.empty(n, dev)
        for key in ("exp_avg", "exp_avg_sq"):
            src = x.abs() if key == "exp_avg_sq" else x
            for _ in range(3):
                codec.encode(src, stored, key)
                codec.decode(stored, out, key)
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record()
            for _ in range(20):
                codec.encode(src, stored, key)
            ev[1].record()
            for _ in range(20):
                codec.decode(stored, out, key)
            ev[2].record()
            torch.cuda.synchronize()
            err = ((out - src).abs().max() / src.abs().max()).item()
            print(f"codec {kind:5s} {key:10s} encode {ev[0].elapsed_time(ev[1]) / 20:.3f} ms  decode "
                  f"{ev[1].elapsed_time(ev[2]) / 20:.3f} ms per 16M elements  stored {stored.nbytes / n:.3f} B/elem  "
                  f"max err {err:.2e} of max")


if __name__ == "__main__":
    main()

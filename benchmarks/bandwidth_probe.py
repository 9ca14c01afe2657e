"""Measure this machine's offload rates on its GPU, cache them, and print them with what the model makes of them.

    PYTHONPATH=src python benchmarks/bandwidth_probe.py [--repeat N] [--numel N]

Prints one JSON object: `rates` (the cached measurement, `zerofit.plan.bandwidth.Rates`), `cache_file` and
whether it was written, `seconds` (wall time of each measurement: the probe should take under 5 s on an
H200 box), `repeats` (the rates of any further measurements, to see their spread), and `model`: for
`--numel` offloaded AdamW parameters, the seconds of GPU-stepping them, host-stepping them (alone and
beside copies) and of the best split, with the host share it picks for fp32 and bf16 gradients.
"""

from __future__ import annotations

import argparse
import json
import time

from zerofit.plan import bandwidth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="measurements to make (the first is cached)")
    parser.add_argument("--numel", type=int, default=10**9, help="offloaded parameters the model is asked about")
    args = parser.parse_args()

    start = time.perf_counter()
    rates = bandwidth.probe(refresh=True)
    seconds = [time.perf_counter() - start]
    repeats = []
    for _ in range(args.repeat - 1):
        start = time.perf_counter()
        repeats.append(bandwidth.measure().to_json())
        seconds.append(time.perf_counter() - start)

    n = args.numel
    model = {"numel": n, "streamed_s": bandwidth.streamed_seconds(rates, n),
             "host_s": bandwidth.host_seconds(rates, n), "host_busy_s": bandwidth.host_seconds(rates, n, busy=True)}
    for name, grad_bytes in (("fp32_grad", 4), ("bf16_grad", 2)):
        share = bandwidth.best_host_share(rates, n, grad_bytes=grad_bytes)
        host = round(n * share)
        model[name] = {"best_host_share": share,
                       "split_s": bandwidth.offload_seconds(rates, n - host, host, grad_bytes=grad_bytes)}
    print(json.dumps({"rates": rates.to_json(), "summary": rates.summary(),
                      "cache_file": str(bandwidth.cache_path()), "cached": bandwidth.cached() == rates,
                      "seconds": [round(s, 3) for s in seconds], "repeats": repeats, "model": model}, indent=1))


if __name__ == "__main__":
    main()

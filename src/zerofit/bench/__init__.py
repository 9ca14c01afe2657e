"""`zerofit bench`: the Accelerate + DeepSpeed ZeRO blog's three benchmark tables, regenerated on the hardware at hand.

    zerofit bench --gpu-memory-gib 24 --out benchmarks/results/seed_tables_h200   # the three tables on one GPU
    zerofit bench --tiny --cpu --out /tmp/bench                               # the harness on tiny models

Layout: `workloads` (the tables: model, synthetic batches, epoch sizes, methods), `methods` (one
training set-up per method: plain PyTorch / DDP, zerofit, DeepSpeed, FSDP2), `search` (largest batch
by doubling then bisection), `worker` (one row in one process: equal-batch timing, search, timing),
`run` (the rows' processes, relaunched where an out-of-memory left one unusable) and `report`
(markdown, JSON, PNG plots).
"""

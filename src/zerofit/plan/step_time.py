"""What a setting adds to a training step, in seconds, on this machine's measured rates.

The planner ranks the settings that fit by this figure where the rates are known (`zerofit.plan.choose`),
so it can weigh offloading more optimizer state against recomputing activations; without rates it
keeps the fixed order of [Note: speed order].

[Note: step time model]
Per optimizer step, for one rank, with K micro-steps (gradient accumulation), n_s / n_h the offloaded
parameters GPU-stepped / host-stepped on this rank (its shard of the offloaded units), n_p this rank's
parameter shard when parameters are offloaded, P the compute dtype's bytes, L the parameters of the
layers activation checkpointing recomputes (every unit but the root: embeddings and head are not
checkpointed) and T the tokens of one micro-step:

    added = offload(n_s, n_h)  +  K * (2 P n_p / h2d  +  2 L T / F)

- offload: `bandwidth.offload_seconds` (or `host_seconds` for host stepping): once per optimizer step, the
  master's bytes split where it travels so (bf16 parameters on the GPU, zerofit.engine.offload.master_split);
- parameter offload: the shard is uploaded for the forward's and again for the backward's gather, every
  micro-step;
- checkpointing: a second forward of the layers, 2 FLOPs per parameter and token (`flops.forward_flops`),
  at F = the measured bf16 matmul rate (`Rates.gpu_tflops`) times `RECOMPUTE_EFFICIENCY`.
Settings that add nothing (no offload, no checkpointing) tie at 0 and keep the fixed order (stage 0
before sharding). Left out, on purpose: the overlap of a GPU-stepped update with the next forward
(which flatters no setting more than another of the same kind) and communication between ranks (the
fixed order already puts fewer collectives first).
"""

from __future__ import annotations

from zerofit.engine.state_codec import Codec
from zerofit.plan import bandwidth
from zerofit.plan.flops import forward_flops
from zerofit.plan.memory import (
    DTYPE_BYTES,
    ModelCounts,
    Setting,
    Workload,
    master_travels_split,
    offloaded_split,
)

RECOMPUTE_EFFICIENCY = 0.5
"""A model's forward reaches about this share of the probe's matmul rate (smaller products, attention,
normalisation and launches in between)."""


def recomputed_params(counts: ModelCounts) -> int:
    """Parameters activation checkpointing runs forward twice: every unit's but the root's."""
    return sum(t + f for _, t, f in counts.units[1:])


def added_seconds(rates: bandwidth.Rates, counts: ModelCounts, setting: Setting, work: Workload) -> float | None:
    """Seconds `setting` adds to one optimizer step (see [Note: step time model]); None where it cannot be
    priced (checkpointing without a measured matmul rate)."""
    world = max(1, work.world)
    param_bytes = DTYPE_BYTES.get(work.mixed_precision, 4)
    seconds = 0.0
    if setting.offload_optimizer == "cpu":
        streamed, hosted = offloaded_split(counts, setting)
        streamed, hosted = streamed // world, hosted // world
        if setting.step_on == "host":
            seconds += bandwidth.host_seconds(rates, hosted, param_bytes=param_bytes)
        else:
            split = master_travels_split(setting, work)
            # split under parameter offload: the host's bf16 parameter goes up beside the packed master
            master = bandwidth.SPLIT_MASTER_BYTES + (param_bytes if setting.offload_param == "cpu" else 0)
            seconds += bandwidth.offload_seconds(rates, streamed, hosted, param_bytes=param_bytes,
                                                 state_tensors=work.optimizer_states,
                                                 master_bytes=master if split else 4,
                                                 state_bytes=Codec(work.optimizer_state).bytes_per_element())
    elif setting.offload_optimizer == "nvme":
        return None  # bound by the disk, which the probe does not measure
    per_micro = 0.0
    if setting.offload_param == "cpu":
        per_micro += 2 * param_bytes * (counts.numel // world) / (rates.h2d_gbs * bandwidth.GB)
    if setting.checkpointing:
        if rates.gpu_tflops is None:
            return None
        flops = forward_flops(recomputed_params(counts), work.micro_batch * work.seq)
        per_micro += flops / (rates.gpu_tflops * 1e12 * RECOMPUTE_EFFICIENCY)
    return seconds + max(1, work.gradient_accumulation_steps) * per_micro

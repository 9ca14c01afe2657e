"""The offload rates one process of several on a host may count on.

[Note: rates shared on one host]
The machine's offload rates (`zerofit.plan.bandwidth.Rates`) are measured by one process that has the
host to itself: rank 0 while the other ranks wait (`zerofit.frontend.planning.auto_plan.machine_rates`), its CPU
AdamW on every usable CPU (`bandwidth.measure`). In the run, the N processes of one host step and copy
at the same time and share what the probe had alone, so every price of host work is taken at one
process's share (`shared_rates`), one rule for the planner's ranking (`zerofit.plan.choose.plan`) and
for the host/GPU split of offloaded state (`best_host_share`'s callers):
- CPU AdamW: the launcher gives each process cpus // N threads (`zerofit.cli.launch`), and a fused step
  over state far past the caches waits mostly on host memory, which the N share too; each process
  steps at 1/N of the measured rate.
- host memory: every pinned copy reads or writes host memory. The host's bandwidth is the most traffic
  the probe saw (`host_memory_gbs`: a CPU copy on every usable CPU, the link both ways, CPU AdamW, or
  the link beside CPU AdamW), and each process has 1/N of it.
- PCIe: each GPU has its own link, so a process keeps the link rates measured, but no more than its
  share of host memory carries (both directions at once: half the share each way).
- The GPU's own rates (the fused CUDA AdamW kernel, the matrix product) are per GPU and stay.
The traffic one process can draw is a lower bound of the host's bandwidth: on a host with far more,
offload is priced slower than it runs, which errs towards offloading less (the cost of an error the
other way is a step that stalls on the host). Two GPUs behind one PCIe switch
are not seen either: their links are counted as if each were alone. With one process per host the
rates are the measured ones.
"""

from __future__ import annotations

import dataclasses

from zerofit.plan.bandwidth import Rates

CPU_ADAM_BYTES = 28
"""Host memory bytes fused CPU AdamW moves per fp32 parameter: it reads the parameter, its gradient and
the two moments (16) and writes the parameter and the moments back (12)."""


def host_memory_gbs(rates: Rates) -> float:
    """The most host memory traffic, GB/s, the one-process probe saw: a CPU copy on every usable CPU (rates
    measured by an older zerofit lack it), the link both ways at once, CPU AdamW alone, or the last two side
    by side (from the two measurements of each beside the other, where both were taken). A lower bound of
    the host's memory bandwidth."""
    seen = [2 * rates.both_gbs, CPU_ADAM_BYTES / rates.cpu_adam_s, rates.host_copy_gbs or 0.0]
    if rates.both_busy_gbs is not None and rates.cpu_adam_busy_s is not None:
        seen.append(2 * rates.both_busy_gbs + CPU_ADAM_BYTES / rates.cpu_adam_busy_s)
    return max(seen)


def shared_rates(rates: Rates, processes_per_host: int) -> Rates:
    """`rates` as each of `processes_per_host` processes on one host may count on them (see [Note: rates
    shared on one host]): CPU AdamW N times slower, each link rate capped at 1/N of the host memory
    traffic the probe saw (half that each way where both directions run at once); `rates` itself for one."""
    n = processes_per_host
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"processes_per_host must be an integer >= 1 (got {n!r}): the processes of this run on "
                         "one host (LOCAL_WORLD_SIZE)")
    if n == 1:
        return rates
    share = host_memory_gbs(rates) / n

    def each_way(gbs: float | None) -> float | None:
        return None if gbs is None else min(gbs, share / 2)

    return dataclasses.replace(
        rates, cpu_adam_s=rates.cpu_adam_s * n,
        cpu_adam_busy_s=None if rates.cpu_adam_busy_s is None else rates.cpu_adam_busy_s * n,
        h2d_gbs=min(rates.h2d_gbs, share), d2h_gbs=min(rates.d2h_gbs, share),
        both_gbs=each_way(rates.both_gbs), both_busy_gbs=each_way(rates.both_busy_gbs))


def sharing_said(own: Rates, processes_per_host: int) -> str:
    """How the plan's text says its seconds were priced: on the rates as measured, or, with several
    processes per host, on one process's share of them (`own`, from `shared_rates`: its CPU AdamW and link
    rates named)."""
    if processes_per_host <= 1:
        return "on this machine's measured rates"
    return (f"on this machine's measured rates shared by {processes_per_host} processes per host (each: CPU AdamW "
            f"{own.cpu_adam_s:.2f} s per 1e9 params, link {own.both_gbs:.1f} GB/s each way)")

"""What the steps between two progress lines did: samples and tokens a second, MFU, the GPU memory peak.

[Note: throughput without a sync]
The progress line's rates (`logging.throughput`, on by default) cost the step no device synchronisation:
- samples and tokens are counted on the host, from the shapes of the model's training forwards (a forward
  pre-hook on the prepared model, for a forward with gradients on in training mode): `input_ids`, else
  the first 2-D integer tensor, gives samples x tokens (`first_batch.batch_shape`); a forward without
  token ids (images, `inputs_embeds`) counts the first tensor's first dimension as samples and no tokens.
  So the count is the same with or without a prepared DataLoader, and micro-steps of an accumulation
  window, replayed windows (the out-of-memory back-off) and skipped fp16 steps count as the work they were;
- time is the host clock (`time.perf_counter`) read once per line, at the end of the optimizer step that
  prints it. The host runs ahead of the GPU by at most the queue of work it issued (less where the step
  synchronises already: fp16's overflow check, a script's `loss.item()`), so over a window of steps the
  rate is the GPU's to within that queue; the first window starts at the end of the first optimizer step
  this process took (the step that allocates the optimizer state and warms the kernels is not counted).
  The window's time includes whatever the loop did between the steps (evaluation, saving);
- the GPU memory peak is the caching allocator's host-side counter (`torch.cuda.max_memory_allocated`,
  since the start or since the planner's probe reset it at `prepare()`), of the main process;
- MFU is [Note: model FLOPs] (`zerofit.plan.flops`) of the main process's tokens, against the bf16 matmul
  rate the planner's probe cached for this GPU (`bandwidth.cached`, read once here; no rates are measured
  for it): absent on CPU and on a machine never probed.
Samples and tokens a second are the whole run's: the main process's count times the number of processes
(ranks see batches of one size: a prepared DataLoader makes them even), as DeepSpeed and Trainer count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zerofit.engine import ZeroEngine
from zerofit.frontend.planning.first_batch import batch_shape
from zerofit.plan import bandwidth
from zerofit.plan.flops import mfu, train_flops_per_token


@dataclass(frozen=True)
class Window:
    """The rates of one window of optimizer steps (None: not known for this run)."""

    seconds: float
    samples_per_s: float | None
    """The whole run's (see [Note: throughput without a sync]); None where no training forward was seen."""
    tokens_per_s: float | None
    """The whole run's; None where no forward had token ids."""
    mfu: float | None
    """Model FLOPs utilisation of one GPU, 0 to 1; None without tokens or a measured matmul rate."""


def forward_sizes(args: tuple, kwargs: dict) -> tuple[int, int | None] | None:
    """(samples, tokens or None) of one forward's inputs; None where it has no tensor input."""
    shape = batch_shape(args, kwargs)
    if shape is not None:
        return shape[0], shape[0] * shape[1]
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() >= 1), None)
    return None if first is None else (int(first.shape[0]), None)


class Throughput:
    """Counts the samples and tokens of training forwards, and times windows of optimizer steps (see the note)."""

    def __init__(self, *, world: int = 1, flops_per_token: int | None = None, peak_tflops: float | None = None,
                 memory_peak: Callable[[], int] | None = None, clock: Callable[[], float] = time.perf_counter):
        """`flops_per_token`: the model's ([Note: model FLOPs]); `peak_tflops`: the GPU's measured bf16 matmul
        rate (None: no MFU); `memory_peak`: peak device bytes (None: not a CUDA run); `clock`: seconds."""
        self.world, self.flops_per_token, self.peak_tflops = world, flops_per_token, peak_tflops
        self.memory_peak, self.clock = memory_peak, clock
        self.samples = 0
        self.tokens = 0
        self.forwards_with_tokens = 0
        self.forwards = 0
        self._since: float | None = None
        """When the window began (the end of a step); None until the first `lap`."""

    @classmethod
    def for_engine(cls, engine: ZeroEngine, *, world: int, device: torch.device) -> Throughput:
        """A Throughput counting `engine`'s model (its forward pre-hook installed), with this GPU's cached rate."""
        params = sum(sum(g.layout.numels) for g in engine.groups)
        trainable = sum(sum(g.layout.numels) for g in engine.trainable_groups)
        cuda = device.type == "cuda"
        rates = bandwidth.cached(device) if cuda else None  # a file read, once; None when never probed
        out = cls(world=world, flops_per_token=train_flops_per_token(params, trainable),
                  peak_tflops=None if rates is None else rates.gpu_tflops,
                  memory_peak=(lambda: torch.cuda.max_memory_allocated(device)) if cuda else None)
        out.install(engine.model)
        return out

    def install(self, model: nn.Module) -> None:
        """Count `model`'s training forwards, for as long as the model lives."""
        model.register_forward_pre_hook(self._on_forward, with_kwargs=True)

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training and torch.is_grad_enabled():  # a training forward: evaluation is not throughput
            self.count(args, kwargs)

    def count(self, args: tuple, kwargs: dict) -> None:
        """Add one training forward's samples and tokens (shapes only: host-side)."""
        sizes = forward_sizes(args, kwargs)
        if sizes is None:
            return
        self.forwards += 1
        self.samples += sizes[0]
        if sizes[1] is not None:
            self.tokens += sizes[1]
            self.forwards_with_tokens += 1

    @property
    def running(self) -> bool:
        """A window has begun (`lap` was called once)."""
        return self._since is not None

    def lap(self) -> Window | None:
        """The rates since the last lap, and a new window from now; None at the first lap (nothing timed yet)."""
        now = self.clock()
        since, self._since = self._since, now
        samples, tokens = self.samples, self.tokens
        any_forward, all_tokens = self.forwards > 0, self.forwards_with_tokens == self.forwards > 0
        self.samples = self.tokens = self.forwards = self.forwards_with_tokens = 0
        if since is None or now <= since:
            return None
        seconds = now - since
        tokens_local = tokens / seconds if all_tokens else None  # tokens of some forwards only: not a rate
        utilisation = None
        if tokens_local is not None and self.flops_per_token is not None and self.peak_tflops is not None:
            utilisation = mfu(self.flops_per_token, tokens_local, self.peak_tflops)
        return Window(seconds=seconds,
                      samples_per_s=samples * self.world / seconds if any_forward else None,
                      tokens_per_s=None if tokens_local is None else tokens_local * self.world,
                      mfu=utilisation)

    def peak_bytes(self) -> int | None:
        """The GPU memory peak of this process (None off CUDA): a host-side counter, no sync."""
        return None if self.memory_peak is None else int(self.memory_peak())

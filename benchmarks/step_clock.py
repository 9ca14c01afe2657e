"""The step clock the Trainer benchmarks share (grpo_bench.py, trainer_clm.py): a `TrainerCallback` that marks
the wall time when training starts and at each step's end, after a CUDA sync so the step's work is done, and
resets the GPU peak when training starts so a peak leaves out loading and setup. Each script subclasses it for
what it measures besides (spans inside a step, the peak in training)."""

from __future__ import annotations

import time

import torch
import transformers


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the clock's only host syncs: the work before the mark is done


class StepClock(transformers.TrainerCallback):
    def __init__(self):
        self.marks: list[float] = []

    def _mark(self) -> None:
        sync()
        self.marks.append(time.perf_counter())

    def on_train_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._mark()

    def on_step_end(self, args, state, control, **kwargs):
        self._mark()

    @property
    def step_s(self) -> list[float]:
        """Each step's wall seconds (between consecutive marks)."""
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

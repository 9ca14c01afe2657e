"""What a script asks about the processes of its run, with Accelerate's names: `PartialState` and the
methods it shares with `Accelerator` (who runs a function, which slice of the inputs is this process's,
a flag any process can raise).

`PartialState()` can be built before (or without) an `Accelerator`, as in Accelerate: it joins the
run's process group once (see `ProcessState.create`) and every later `PartialState()` sees the same
state. Both classes provide `process` (a `ProcessState`); the methods here read only that.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from zerofit.distributed import runtime
from zerofit.distributed.failures import named
from zerofit.frontend.state import DistributedType, ProcessState


class ProcessMethods:
    """Accelerate's process helpers over `self.process` (mixed into `PartialState` and `Accelerator`)."""

    process: ProcessState
    _trigger: torch.Tensor | None = None

    # --- who and where --------------------------------------------------------------------------
    device = property(lambda self: self.process.device)
    process_index = property(lambda self: self.process.process_index)
    local_process_index = property(lambda self: self.process.local_process_index)
    num_processes = property(lambda self: self.process.num_processes)
    is_main_process = property(lambda self: self.process.is_main_process)
    is_local_main_process = property(lambda self: self.process.is_local_main_process)

    def _data_parallel_type(self) -> DistributedType:
        """NO on one process, MULTI_CPU / MULTI_GPU on several (what a run that does not shard reports)."""
        if not self.use_distributed:
            return DistributedType.NO
        return DistributedType.MULTI_GPU if self.process.device.type == "cuda" else DistributedType.MULTI_CPU

    @property
    def use_distributed(self) -> bool:
        """More than one process runs the script."""
        return self.process.num_processes > 1

    @property
    def is_last_process(self) -> bool:
        return self.process.process_index == self.process.num_processes - 1

    def wait_for_everyone(self) -> None:
        self.process.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the local main process only."""
        if self.process.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first, then the others."""
        if not self.process.is_main_process:
            self.wait_for_everyone()
        yield
        if self.process.is_main_process:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        if not self.process.is_local_main_process:
            self.wait_for_everyone()
        yield
        if self.process.is_local_main_process:
            self.wait_for_everyone()

    # --- who runs a function ---------------------------------------------------------------------
    def on_main_process(self, function: Callable | None = None) -> Callable:
        """Decorator: `function` runs on the main process only (elsewhere the call returns None)."""
        return self._only_where(function, lambda: self.process.is_main_process)

    def on_local_main_process(self, function: Callable | None = None) -> Callable:
        """Decorator: `function` runs on each machine's local main process only."""
        return self._only_where(function, lambda: self.process.is_local_main_process)

    def on_last_process(self, function: Callable | None = None) -> Callable:
        """Decorator: `function` runs on the last process only."""
        return self._only_where(function, lambda: self.is_last_process)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        """Decorator: `function` runs on process `process_index` only."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        if process_index is None:
            raise ValueError("on_process needs process_index=: the index of the process that runs the function")
        return self._only_where(function, lambda: self.process.process_index == process_index)

    def _only_where(self, function: Callable | None, here: Callable[[], bool]) -> Callable:
        if function is None:  # used as @on_main_process() with parentheses
            return lambda f: self._only_where(f, here)

        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            if here() or not self.use_distributed:
                return function(*args, **kwargs)
            return None

        return run

    # --- which inputs are this process's ---------------------------------------------------------
    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of `inputs` (a list, tuple, tensor, or dict of them): the
        first `len % num_processes` processes get one more. `apply_padding` repeats the last element so
        every process gets the same count (then `gather` gives whole, equal rows)."""
        yield _share(inputs, self.process.process_index, self.process.num_processes, apply_padding)

    # --- a flag any process can raise ------------------------------------------------------------
    def set_trigger(self) -> None:
        """Raise this process's flag; `check_trigger` then returns True on every process (e.g. to stop early)."""
        self._trigger = torch.ones((), device=self.process.device)

    def check_trigger(self) -> bool:
        """True on every process when any process called `set_trigger` since the last check (collective)."""
        flag = self._trigger if self._trigger is not None else torch.zeros((), device=self.process.device)
        if self.use_distributed:
            flag = flag.clone()
            with named("check_trigger", self.process.process_index):
                dist.all_reduce(flag)
        if flag.item() >= 1:  # host sync on purpose: the answer decides the script's control flow
            self._trigger = None
            return True
        return False


def _share(inputs: Any, index: int, world: int, pad: bool) -> Any:
    if world == 1:
        return inputs
    if isinstance(inputs, dict):
        return {k: _share(v, index, world, pad) for k, v in inputs.items()}
    n = len(inputs)
    per, extra = divmod(n, world)
    start = index * per + min(index, extra)
    end = start + per + (1 if index < extra else 0)
    part = inputs[start:end]
    if pad and extra:
        want = math.ceil(n / world)
        missing = want - (end - start)
        if missing:
            last = inputs[-1:] if n else inputs[:0]
            if isinstance(part, torch.Tensor):
                part = torch.cat([part] + [last] * missing)
            else:
                part = part + type(part)(list(last) * missing)
    return part


_SHARED: ProcessState | None = None


class PartialState(ProcessMethods):
    """Accelerate's `PartialState`: this process's place in the run, without the training machinery.

    Built on first use from the run's config (`zerofit launch`, or a world of one); later instances
    share it. `cpu=True` keeps the process on the CPU (gloo).
    """

    def __init__(self, cpu: bool = False, **kwargs: Any):
        global _SHARED
        if _SHARED is None:
            _SHARED = ProcessState.create(runtime.current_config(), cpu=cpu)
        self.process = _SHARED

    backend = property(lambda self: self.process.backend)

    @property
    def distributed_type(self) -> DistributedType:
        """NO on one process, MULTI_CPU / MULTI_GPU on several (the ZeRO stage is the Accelerator's to know)."""
        return self._data_parallel_type()

    def destroy_process_group(self, group: Any = None) -> None:
        """End the process group this state joined (what Accelerate's `PartialState` offers at exit)."""
        global _SHARED
        if dist.is_initialized() and self.process.initialized_here:
            dist.destroy_process_group(group)
            _SHARED = None

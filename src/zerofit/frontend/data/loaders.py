"""Dataloaders sharded over processes, with even batches and an exact `gather_for_metrics`.

[Note: even batches]
Every process must run the same number of forward/backward steps, or the ZeRO collectives hang.
`prepare()` therefore cuts each epoch into global batches of `batch_size * num_processes` samples,
taken in the epoch's order: process r gets rows r*batch_size .. (r+1)*batch_size - 1 of each
global batch, so global batch g holds exactly the samples a single process with a batch of
`batch_size * num_processes` would see at step g. The last global batch, when short, is filled up
with samples from the start of the epoch. The loader remembers how many of its samples are real,
and `gather_for_metrics` drops the repeats (rows are gathered in rank order, so the repeats are the
last rows). With `drop_last=True` the short global batch is dropped instead. A single process has
nothing to keep in step, so its last batch stays short, as a plain DataLoader's does. With
`split_batches`, the script's batch is the global batch and each process gets a slice of it.
Accelerate's `BatchSamplerShard` deals batches out and fills the last one the same way. The
epoch's order is also Accelerate's ([Note: the same order as Accelerate] in
zerofit.frontend.data.sampling), so at every step each rank sees the samples it would see under
Accelerate.
Iterable datasets are read whole by every process, which keeps its slice of every group of
`batch_size * num_processes` samples (the same rule, on the stream), read and collated in the main
process (the script's `num_workers` is not used for them).

[Note: the draws of an epoch start]
torch's DataLoader draws one int64 from its `generator` each time it starts an iterator: the base
seed of its workers. With no generator, the draw comes from the global torch RNG. Accelerate's
prepared loader iterates a plain DataLoader, so each epoch (and each evaluation pass) moves the
global RNG by that draw. With persistent workers the draw happens only once, at epoch 0. A fresh
epoch here takes the same draw, so dropout masks and collator randomness follow the same stream as
under Accelerate. The workers themselves are seeded from zerofit's own generator (`seed` + epoch),
so a resumed epoch seeds them the same way. An epoch resumed mid-way draws nothing: the checkpoint
restored the global RNG to a point after those draws. Iterable datasets take no draw (Accelerate
reads them on rank 0 only and sends out the batches; zerofit does not copy that).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from zerofit.frontend.data.sampling import EpochOrder, OwnOrder, SeededOrder, restored
from zerofit.frontend.ops import send_to_device
from zerofit.frontend.planning.backoff import BatchSplitter
from zerofit.frontend.state import GradientState


class ShardedBatchSampler(Sampler[list[int]]):
    """This process's batches of the epoch, cut from the epoch's order as the module note says."""

    def __init__(self, sampler: Sampler, batch_size: int, drop_last: bool, *, rank: int, world: int,
                 split_batches: bool, order: EpochOrder | None = None):
        if split_batches and batch_size % world:
            raise ValueError(f"split_batches needs the DataLoader batch_size ({batch_size}) to be a multiple of "
                             f"the number of processes ({world}): change batch_size or turn split_batches off")
        self.sampler = sampler
        self.order: EpochOrder = order if order is not None else OwnOrder(sampler)
        self.per_rank = batch_size // world if split_batches else batch_size
        self.drop_last = drop_last
        self.rank, self.world = rank, world
        self.epoch = 0
        self.skip = 0
        """Batches to leave out at the start of the next epoch (resuming mid-epoch)."""

    @property
    def global_batch(self) -> int:
        return self.per_rank * self.world

    def num_samples(self) -> int:
        return len(self.sampler)

    def real_in_last(self) -> int:
        """Real samples in the last global batch of an epoch; -1 when it is full (nothing repeated)."""
        n = self.num_samples()
        if self.drop_last or n % self.global_batch == 0 or self.world == 1:
            return -1
        return n % self.global_batch

    def __len__(self) -> int:
        n = self.num_samples()
        return n // self.global_batch if self.drop_last else math.ceil(n / self.global_batch)

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip = self.skip, 0
        indices = self.order.indices(self.epoch, resumed=skip > 0)
        count = len(indices) // self.global_batch if self.drop_last else math.ceil(len(indices) / self.global_batch)
        need = count * self.global_batch if self.world > 1 else 0
        while len(indices) < need:  # fill the last global batch from the start of the epoch
            indices += indices[: need - len(indices)]
        for g in range(skip, count):
            start = g * self.global_batch + self.rank * self.per_rank
            yield indices[start:start + self.per_rank]


class IterableShard(IterableDataset):
    """This process's samples of an iterable dataset: its slice of every `per_rank * world` samples.

    Over several processes the last, short group is filled up with the epoch's first samples and
    `on_padded(real)` says how many of it were real (the module note). Every process reads the whole stream.
    """

    def __init__(self, dataset: IterableDataset, *, per_rank: int, rank: int, world: int, drop_last: bool,
                 on_padded: Any):
        self.dataset, self.per_rank, self.rank, self.world = dataset, per_rank, rank, world
        self.drop_last, self.on_padded = drop_last, on_padded

    def __iter__(self) -> Iterator[Any]:
        size = self.per_rank * self.world
        mine = slice(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        first: list[Any] = []
        group: list[Any] = []
        for sample in self.dataset:
            if len(first) < size:
                first.append(sample)
            group.append(sample)
            if len(group) == size:
                yield from group[mine]
                group = []
        if group and not self.drop_last:
            if self.world > 1:  # one process keeps its short last batch (the module note)
                real = len(group)
                while len(group) < size:
                    group += first[: size - len(group)]
                self.on_padded(real)
            yield from group[mine]


class ShardedDataLoader:
    """A script's DataLoader seen through one process's shard, yielding batches on the accelerator.

    Iterating it tells the shared `GradientState` when the last batch is being processed, which
    closes an accumulation window early (`accumulate()`) and lets `gather_for_metrics` drop repeats.
    """

    def __init__(self, loader: DataLoader, *, gradient_state: GradientState, device: torch.device | None,
                 rank: int, world: int, split_batches: bool, seed: int,
                 order: Callable[[Sampler], EpochOrder] | None = None):
        """`seed` seeds the workers (plus the epoch); `order(sampler)` gives the epochs' order (default: the
        sampler's own, `OwnOrder`), built by `prepare()` as zerofit.frontend.data.sampling says."""
        self.base = loader
        self.gradient_state = gradient_state
        self.device = device
        self.rank, self.world = rank, world
        self.split_batches = split_batches
        self.at_last_batch = False
        self.remainder = -1
        self.iteration = 0
        """Completed epochs."""
        self.batches_yielded = 0
        """Batches of the current epoch handed to the script so far, the current one included (the resume position)."""
        self.resume_position = 0
        """`batches_yielded` of the checkpoint last loaded (pass it to `skip_first_batches`)."""
        self._skip_next = 0
        self.splitter = BatchSplitter()
        """Cuts batches smaller after an out-of-memory back-off (see zerofit.frontend.planning.backoff)."""
        self.batch_sampler: ShardedBatchSampler | None = None
        # The workers' generator, our own: a resumed epoch must seed its workers as the uninterrupted one
        # did ([Note: the draws of an epoch start]).
        self._generator = torch.Generator()
        self._seed = seed
        self._base_seed_taken = False
        """Whether persistent workers took their one base-seed draw ([Note: the draws of an epoch start])."""
        self._per_rank: int | None = None
        if isinstance(loader.dataset, IterableDataset):
            if loader.batch_size is None:
                raise ValueError("prepare() shards an IterableDataset's DataLoader by samples and needs its "
                                 "batch_size: build the DataLoader with batch_size=...")
            per_rank = loader.batch_size // world if split_batches else loader.batch_size
            self._per_rank = per_rank
            shard = IterableShard(loader.dataset, per_rank=per_rank, rank=rank, world=world,
                                  drop_last=loader.drop_last, on_padded=self._set_remainder)
            self._loader = DataLoader(shard, batch_size=per_rank, collate_fn=loader.collate_fn,
                                      pin_memory=loader.pin_memory, generator=self._generator)
        else:
            batch_size, drop_last = loader.batch_size, loader.drop_last
            if batch_size is None:  # the script built its own batch sampler
                inner = loader.batch_sampler
                batch_size = getattr(inner, "batch_size", None)
                drop_last = getattr(inner, "drop_last", False)
                if batch_size is None or not isinstance(inner, BatchSampler):
                    raise ValueError(f"prepare() shards DataLoaders with a batch_size or a BatchSampler; this one "
                                     f"has batch_sampler {type(inner).__name__}: build the DataLoader with "
                                     "batch_size=... (and sampler=... for a custom order)")
                sampler = inner.sampler
            else:
                sampler = loader.sampler
            self.batch_sampler = ShardedBatchSampler(sampler, batch_size, drop_last, rank=rank, world=world,
                                                     split_batches=split_batches,
                                                     order=order(sampler) if order is not None else None)
            self._loader = DataLoader(
                loader.dataset, batch_sampler=self.batch_sampler, num_workers=loader.num_workers,
                collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
                worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
                prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
                persistent_workers=loader.persistent_workers, generator=self._generator)

    # --- what scripts read --------------------------------------------------------------------
    @property
    def dataset(self) -> Any:
        return self.base.dataset

    @property
    def batch_size(self) -> int | None:
        if self.batch_sampler is not None:
            return self.batch_sampler.per_rank
        return self._per_rank

    def _set_remainder(self, real: int) -> None:
        self.remainder = real

    @property
    def seed(self) -> int | None:
        """The workers' seed, the same on every process (checkpoints save it: a resumed epoch seeds them the same)."""
        return self._seed if self.batch_sampler is not None else None

    @seed.setter
    def seed(self, value: int | None) -> None:
        if self.batch_sampler is not None and value is not None:
            self._seed = value

    @property
    def order(self) -> EpochOrder | None:
        """How the epochs' indices are drawn (checkpoints save its `state_dict()`); None for an iterable dataset."""
        return self.batch_sampler.order if self.batch_sampler is not None else None

    def load_order_state(self, state: dict[str, Any]) -> None:
        """Put back a checkpoint's `order.state_dict()` (of another kind too: `sampling.restored`)."""
        if self.batch_sampler is not None and state:
            self.batch_sampler.order = restored(self.batch_sampler.order, state)

    @property
    def total_batch_size(self) -> int | None:
        return None if self.batch_size is None else self.batch_size * self.world

    @property
    def total_dataset_length(self) -> int:
        return len(self.base.dataset)

    def __len__(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        return math.ceil(len(self.base.dataset) / (self._per_rank * self.world))  # iterable with a length

    def __getattr__(self, name: str) -> Any:
        if name in ("base", "_loader", "_per_rank"):
            raise AttributeError(name)
        return getattr(self.base, name)

    def set_epoch(self, epoch: int) -> None:
        self.iteration = epoch
        self._tell_epoch(epoch)

    def _tell_epoch(self, epoch: int) -> None:
        """Hand `epoch` to the script's sampler, else to its dataset, as Accelerate's loaders do (when the
        script sets the epoch and again at each epoch start)."""
        sampler = self.batch_sampler.sampler if self.batch_sampler is not None else None
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        elif not isinstance(self.order, SeededOrder) and hasattr(self.base.dataset, "set_epoch"):
            self.base.dataset.set_epoch(epoch)  # a SeedableRandomSampler would have taken it instead

    def skip_batches(self, count: int) -> None:
        """Leave out the first `count` batches of the next epoch (for resuming mid-epoch)."""
        self._skip_next = count

    # --- iteration ----------------------------------------------------------------------------
    def _take_base_seed(self) -> None:
        """The draw torch's DataLoader takes as it starts an iterator ([Note: the draws of an epoch start])."""
        generator = self.base.generator
        if generator is not None and generator is self.batch_sampler.order.replays:
            return  # the order's own replay takes it
        if self.base.persistent_workers and self.base.num_workers > 0:
            if self._base_seed_taken or self.iteration > 0:  # the workers started once, at epoch 0
                return
            self._base_seed_taken = True
        torch.empty((), dtype=torch.int64).random_(generator=generator)

    def _batches(self, skip: int) -> Iterator[Any]:
        self._tell_epoch(self.iteration)
        if self.batch_sampler is not None:
            if skip == 0:
                self._take_base_seed()
            self.batch_sampler.epoch = self.iteration
            self._generator.manual_seed(self._seed + self.iteration)
            self.batch_sampler.skip = skip
            self.remainder = self.batch_sampler.real_in_last()
            return iter(self._loader)
        self.remainder = -1
        return iter(self._loader)

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip_next = self._skip_next, 0
        self.batches_yielded = skip
        it = self._batches(skip)
        if self.batch_sampler is None:  # iterable: skipping means reading past them
            for _ in range(skip):
                next(it, None)
        self.gradient_state.begin(self)
        self.at_last_batch = False
        try:
            current = next(it, _END)
            while current is not _END:
                following = next(it, _END)  # one ahead: the script must know when a batch is the last
                self.at_last_batch = following is _END
                self.batches_yielded += 1  # counted before the script sees it: a save inside the loop body
                batch = current if self.device is None else send_to_device(current, self.device)  # resumes after it
                yield from self.splitter.deliver(batch, last=self.at_last_batch, loader=self)
                current = following
            self.iteration += 1
            self.batches_yielded = 0
        finally:
            self.at_last_batch = False
            self.gradient_state.end(self)


_END = object()

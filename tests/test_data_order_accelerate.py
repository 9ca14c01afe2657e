"""Prepared dataloaders give each rank the samples Accelerate's `prepare_data_loader` gives it, step by step.

See [Note: the same order as Accelerate] in zerofit.frontend.data.sampling and [Note: the draws of an
epoch start] in zerofit.frontend.data. Each rank of a world of two is computed in this one
process: the rank and world are passed to both libraries, and the global RNG is seeded the same
before each "rank", as `set_seed` does on every rank of a real run. Accelerate's own sync of rank
0's generator (`rng_types`) is left out here. It needs a process group, and it copies a state that
is already the same on every rank.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler, SubsetRandomSampler

from zerofit import Accelerator
from zerofit.checkpoint import loop_state
from zerofit.frontend.data.loaders import ShardedDataLoader
from zerofit.frontend.data.sampling import order_for
from zerofit.frontend.plugins import DataLoaderConfiguration
from zerofit.frontend.state import GradientState

accelerate_data = pytest.importorskip("accelerate.data_loader")

SEED = 42
DATA = list(range(21))  # 21 samples: the last global batch of 2 x 4 is short


@pytest.fixture(autouse=True, scope="module")
def _forget_accelerate_state():
    yield
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


# --- the loaders scripts and transformers' Trainer build --------------------------------------------
def trainer_train(drop_last: bool) -> DataLoader:
    """Trainer._get_dataloader for training: a RandomSampler without a generator."""
    return DataLoader(DATA, batch_size=4, sampler=RandomSampler(DATA), drop_last=drop_last)


def trainer_eval(drop_last: bool) -> DataLoader:
    """Trainer._get_eval_sampler gives no sampler over several processes: the DataLoader's own
    SequentialSampler."""
    return DataLoader(DATA, batch_size=4, drop_last=drop_last)


def shuffled(drop_last: bool) -> DataLoader:
    """A no_trainer script's `shuffle=True`."""
    return DataLoader(DATA, batch_size=4, shuffle=True, drop_last=drop_last)


def shuffled_with_generator(drop_last: bool) -> DataLoader:
    """`shuffle=True` with the script's generator, which the DataLoader also draws its base seed from."""
    return DataLoader(DATA, batch_size=4, shuffle=True, drop_last=drop_last,
                      generator=torch.Generator().manual_seed(5))


def subset(drop_last: bool) -> DataLoader:
    """A sampler that is not a RandomSampler but has a generator attribute."""
    return DataLoader(DATA, batch_size=4, sampler=SubsetRandomSampler(DATA[3:]), drop_last=drop_last)


class EpochSamples(Dataset):
    """A map-style dataset with `set_epoch`, whose samples change with the epoch (as augmenting
    datasets' do)."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(DATA)

    def __getitem__(self, i):
        return i + 100 * self.epoch


class RotatingSampler(Sampler):
    """A custom sampler whose order follows `set_epoch`, as DistributedSampler's does."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.n

    def __iter__(self):
        start = self.epoch % self.n
        return iter(list(range(start, self.n)) + list(range(start)))


def _epochs(loader, epochs: int, set_epoch: bool = True) -> list:
    """Per epoch: the batches, and the global RNG state after them (the draws an epoch start takes)."""
    out = []
    for epoch in range(epochs):
        if set_epoch:
            loader.set_epoch(epoch)  # as Trainer._run_epoch does
        out.append(([b.tolist() for b in loader], torch.get_rng_state()))
    return out


def accelerate_run(make, drop_last, rank, world, *, seedable, data_seed=None, epochs=2, split_batches=False,
                   set_epoch=True):
    torch.manual_seed(SEED)
    prepared = accelerate_data.prepare_data_loader(make(drop_last), num_processes=world, process_index=rank,
                                                   split_batches=split_batches, use_seedable_sampler=seedable,
                                                   data_seed=data_seed)
    return torch.get_rng_state(), _epochs(prepared, epochs, set_epoch)


def sharded(loader, rank, world, *, seedable, data_seed=None, split_batches=False) -> ShardedDataLoader:
    """`loader` wired as `prepare()` wires it on `rank`, with rank 0's values shared as they are."""
    order = functools.partial(order_for, loader_generator=loader.generator, seedable=seedable,
                              data_seed=data_seed, world=world, share=lambda value: value)
    return ShardedDataLoader(loader, gradient_state=GradientState(1), device=None, rank=rank, world=world,
                             split_batches=split_batches, seed=0, order=order)


def zerofit_run(make, drop_last, rank, world, *, seedable, data_seed=None, epochs=2, split_batches=False,
                set_epoch=True):
    torch.manual_seed(SEED)
    ours = sharded(make(drop_last), rank, world, seedable=seedable, data_seed=data_seed,
                   split_batches=split_batches)
    return torch.get_rng_state(), _epochs(ours, epochs, set_epoch)


def _same(ours, theirs):
    (ours_prepared, ours_epochs), (theirs_prepared, theirs_epochs) = ours, theirs
    assert torch.equal(ours_prepared, theirs_prepared), "prepare() moved the global RNG differently"
    for epoch, ((ours_batches, ours_rng), (theirs_batches, theirs_rng)) in enumerate(
            zip(ours_epochs, theirs_epochs)):
        assert ours_batches == theirs_batches, f"epoch {epoch}"
        assert torch.equal(ours_rng, theirs_rng), f"epoch {epoch} moved the global RNG differently"
    assert len(ours_epochs) == len(theirs_epochs)


# --- the same samples, step by step ------------------------------------------------------------------
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize(("make", "seedable", "data_seed"), [
    (trainer_train, True, None), (trainer_train, True, 1234), (trainer_eval, True, None),
    (shuffled, False, None), (shuffled_with_generator, False, None), (subset, False, None),
    (shuffled_with_generator, True, None)])
def test_two_ranks_see_accelerates_samples_every_step_of_every_epoch(make, seedable, data_seed, rank,
                                                                      drop_last):
    _same(zerofit_run(make, drop_last, rank, 2, seedable=seedable, data_seed=data_seed, epochs=3),
          accelerate_run(make, drop_last, rank, 2, seedable=seedable, data_seed=data_seed, epochs=3))


@pytest.mark.parametrize("make", [trainer_train, shuffled, shuffled_with_generator, trainer_eval])
@pytest.mark.parametrize("seedable", [False, True])
def test_one_process_sees_what_a_plain_dataloader_gives(make, seedable):
    _same(zerofit_run(make, False, 0, 1, seedable=seedable),
          accelerate_run(make, False, 0, 1, seedable=seedable))


def epoch_samples_in_order(drop_last: bool) -> DataLoader:
    return DataLoader(EpochSamples(), batch_size=4, drop_last=drop_last)


def epoch_samples_shuffled(drop_last: bool) -> DataLoader:
    return DataLoader(EpochSamples(), batch_size=4, shuffle=True, drop_last=drop_last)


def rotating(drop_last: bool) -> DataLoader:
    return DataLoader(DATA, batch_size=4, sampler=RotatingSampler(len(DATA)), drop_last=drop_last)


@pytest.mark.parametrize("set_epoch", [False, True], ids=["loop-only", "set_epoch"])
@pytest.mark.parametrize(("make", "seedable"), [
    (epoch_samples_in_order, True), (epoch_samples_shuffled, False), (epoch_samples_shuffled, True),
    (rotating, False)])
def test_the_epoch_reaches_the_sampler_or_dataset_as_under_accelerate(make, seedable, set_epoch):
    for rank in (0, 1):
        _same(zerofit_run(make, False, rank, 2, seedable=seedable, epochs=3, set_epoch=set_epoch),
              accelerate_run(make, False, rank, 2, seedable=seedable, epochs=3, set_epoch=set_epoch))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
def test_split_batches_slices_accelerates_global_batch(rank, drop_last):
    def global_batches(drop_last):
        return DataLoader(DATA, batch_size=8, sampler=RandomSampler(DATA), drop_last=drop_last)

    _same(zerofit_run(global_batches, drop_last, rank, 2, seedable=True, split_batches=True),
          accelerate_run(global_batches, drop_last, rank, 2, seedable=True, split_batches=True))


def test_the_accelerator_reads_use_seedable_sampler_and_data_seed_from_dataloader_config():
    torch.manual_seed(SEED)
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=1234))
    assert acc.use_seedable_sampler
    ours = (torch.get_rng_state(), _epochs(acc.prepare(trainer_train(False)), 2))
    _same(ours, accelerate_run(trainer_train, False, 0, 1, seedable=True, data_seed=1234))


# --- resuming mid-epoch stays exact -------------------------------------------------------------------
@pytest.mark.parametrize(("make", "seedable", "world"), [
    (trainer_train, True, 2), (shuffled, False, 2), (shuffled_with_generator, False, 2), (shuffled, False, 1),
    (trainer_eval, False, 1)])
def test_a_resumed_epoch_gives_the_remaining_batches_and_leaves_the_rng_as_the_straight_run_does(
        make, seedable, world):
    def fresh():
        torch.manual_seed(SEED)
        return sharded(make(False), 0, world, seedable=seedable)

    straight = fresh()
    list(straight)  # a whole epoch first: the generator-carrying order must replay it
    second = iter(straight)
    head = [next(second).tolist() for _ in range(2)]
    saved = loop_state.collect(schedulers=[], optimizers=[], dataloaders=[straight], custom=[], iteration=0)
    tail = [b.tolist() for b in second]
    rng_after = torch.get_rng_state()

    resumed = fresh()
    torch.manual_seed(999)  # whatever the new process did before loading the checkpoint
    loop_state.restore(saved, schedulers=[], optimizers=[], dataloaders=[resumed], custom=[])
    resumed.skip_batches(resumed.resume_position)  # as load_state does
    assert [b.tolist() for b in resumed] == tail and len(head + tail) == len(straight)
    assert torch.equal(torch.get_rng_state(), rng_after)


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_take_the_base_seed_draw_once_per_epoch_or_once_when_persistent(persistent):
    def with_workers(drop_last):
        return DataLoader(DATA, batch_size=4, shuffle=True, num_workers=1, persistent_workers=persistent)

    _same(zerofit_run(with_workers, False, 0, 2, seedable=False, epochs=3),
          accelerate_run(with_workers, False, 0, 2, seedable=False, epochs=3))


def test_a_run_resumed_at_another_world_size_carries_on_the_saved_runs_order():
    """Saved at 2 ranks (shuffle=True: a generator carried on), resumed in one process (its own kind
    would draw from the global RNG): the resumed epoch gives the rest of the saved run's epoch."""
    ranks = []
    for rank in range(2):
        torch.manual_seed(SEED)  # as on every rank of a real run
        ranks.append(sharded(shuffled(False), rank, 2, seedable=False))
    for loader in ranks:
        list(loader)  # epoch 0
    iters = [iter(loader) for loader in ranks]
    for it in iters:
        next(it)  # one step of epoch 1, then the checkpoint
    saved = loop_state.collect(schedulers=[], optimizers=[], dataloaders=[ranks[0]], custom=[], iteration=0)
    straight = [a.tolist() + b.tolist() for a, b in zip(*iters)]  # each remaining global batch, rank 0's rows first
    straight[-1] = straight[-1][:len(DATA) % 8]  # 2 x 4 over 21 samples: the last global batch holds 5 real ones

    one = sharded(DataLoader(DATA, batch_size=8, shuffle=True), 0, 1, seedable=False)
    loop_state.restore(saved, schedulers=[], optimizers=[], dataloaders=[one], custom=[])
    one.skip_batches(one.resume_position)
    assert [b.tolist() for b in one] == straight

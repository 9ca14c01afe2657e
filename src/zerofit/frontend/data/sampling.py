"""The order in which each epoch of a prepared dataloader visits its sampler's indices.

[Note: the same order as Accelerate]
A prepared dataloader cuts each epoch's indices into global batches ([Note: even batches] in
zerofit.frontend.data.loaders). Which indices come in which order is decided as
`accelerate.data_loader.prepare_data_loader` decides it (Accelerate 1.x), so a script, or
transformers' Trainer, gets the same samples on every rank at every step under zerofit as under
Accelerate with DDP. The rules, by kind of sampler:
- `use_seedable_sampler` (`DataLoaderConfiguration`; the Trainer turns it on) and a `RandomSampler`
  (`SeededOrder`): epoch e is a permutation from a new generator seeded with `seed + e`. `seed` is
  `data_seed`, or `torch.initial_seed()` when the loader is prepared (the value `set_seed` set).
  This is Accelerate's `SeedableRandomSampler`.
- Several processes and a sampler with a `generator` attribute (`StreamOrder`, the default for
  `shuffle=True`): one generator carries on from epoch to epoch, so epoch e starts where epoch e-1
  stopped. It is the sampler's own generator as it was when the loader was prepared. If the sampler
  has none, it is a new generator seeded with an integer drawn from the global torch RNG at
  `prepare()`. Accelerate draws at the same place, so the global RNG moves by the same draw.
  A sampler with its own generator keeps that generator in one process too, as torch does.
- Anything else (`OwnOrder`: a `SequentialSampler`, a custom sampler, a `shuffle=True` loader in
  one process): the sampler's own iteration, run on this process's global RNG as torch runs it.
Every process uses rank 0's seed or generator state; Accelerate copies rank 0's generator to the
other ranks at each epoch.

Resuming stays exact. `SeededOrder` and `StreamOrder` compute an epoch's order from their start
and the epoch number. `OwnOrder` keeps the global RNG state from before its epoch's draws, and
checkpoints save that state. An epoch resumed mid-way replays the draws under the saved state
(`indices(..., resumed=True)`) and leaves the live RNG alone: the checkpoint already restored the
live RNG to a point after those draws. A run resumed at another world size can find a saved order
of another kind (`shuffle=True` is a `StreamOrder` over several processes and an `OwnOrder` in one).
It then takes up the saved kind (`restored`), so its epochs carry on the saved run's order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils.data import RandomSampler, Sampler


class EpochOrder(Protocol):
    """The indices of one epoch of a sampler; the strategies are described in the module note."""

    sampler: Sampler
    replays: torch.Generator | None
    """The script's generator this order draws from in its own replay (as the dataloader's base-seed
    draw); the dataloader then must not draw from it a second time. None for the other orders."""

    def indices(self, epoch: int, *, resumed: bool) -> list[int]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class OwnOrder:
    """The sampler's own iteration on the global torch RNG.

    A resumed epoch replays it under the RNG state it began with."""

    replays = None

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.rng_before: torch.Tensor | None = None
        """The global torch RNG state just before the current epoch's indices were drawn."""

    def indices(self, epoch: int, *, resumed: bool) -> list[int]:
        if resumed and self.rng_before is not None:
            with torch.random.fork_rng(devices=[]):  # the live RNG is already past these draws
                torch.set_rng_state(self.rng_before)
                return list(self.sampler)
        self.rng_before = torch.get_rng_state()
        return list(self.sampler)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "own"} | ({} if self.rng_before is None else {"rng_before": self.rng_before})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng_before = state.get("rng_before", self.rng_before)


class SeededOrder:
    """Accelerate's `SeedableRandomSampler`: epoch e is a `RandomSampler` pass from a generator seeded with
    seed + e."""

    replays = None

    def __init__(self, sampler: RandomSampler, seed: int):
        self.sampler = sampler
        self.seed = seed

    def indices(self, epoch: int, *, resumed: bool) -> list[int]:
        generator = torch.Generator().manual_seed((self.seed + epoch) % 2**64)
        s = self.sampler  # a plain RandomSampler over the same data, as Accelerate's replacement is
        return list(RandomSampler(s.data_source, replacement=s.replacement, num_samples=s._num_samples,
                                  generator=generator))

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "seeded", "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state.get("seed", self.seed))


class StreamOrder:
    """One generator carried on from epoch to epoch: epoch e is the (e+1)-th pass of the sampler from `start`.

    With `replays` set, each pass begins with the int64 draw that torch's DataLoader takes from
    that generator for its workers' base seed. This happens when the loader and its sampler share
    one generator, `DataLoader(shuffle=True, generator=g)`.
    """

    def __init__(self, sampler: Sampler, start: torch.Tensor, *, replays: torch.Generator | None = None):
        self.sampler = sampler
        self.replays = replays
        self.device = sampler.generator.device if sampler.generator is not None else torch.device("cpu")
        self._reset(start)

    def _reset(self, start: torch.Tensor) -> None:
        self.start = start.clone()
        self._next: tuple[int, torch.Tensor] = (0, self.start)
        """(epoch, the generator's state when that epoch begins): epoch after epoch costs one pass each."""

    def indices(self, epoch: int, *, resumed: bool) -> list[int]:
        first, state = self._next if self._next[0] <= epoch else (0, self.start)
        generator = torch.Generator(device=self.device)
        generator.set_state(state)
        for _ in range(first, epoch):
            self._pass(generator)
        out = self._pass(generator)
        self._next = (epoch + 1, generator.get_state())
        return out

    def _pass(self, generator: torch.Generator) -> list[int]:
        if self.replays is not None:
            torch.empty((), dtype=torch.int64).random_(generator=generator)
        own = self.sampler.generator
        self.sampler.generator = generator  # the script's sampler, iterated with the stream's generator
        try:
            return list(self.sampler)
        finally:
            self.sampler.generator = own

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "stream", "start": self.start, "replays": self.replays is not None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "start" in state:
            self._reset(state["start"])


_NO_ATTRIBUTE = object()


def order_for(sampler: Sampler, *, loader_generator: torch.Generator | None, seedable: bool,
              data_seed: int | None, world: int, share: Callable[[Any], Any]) -> EpochOrder:
    """The order of `sampler`'s epochs, as the module note says.

    `share` hands rank 0's value to every rank. It is a collective, so call this on every rank.
    """
    if seedable and isinstance(sampler, RandomSampler):
        return SeededOrder(sampler, int(share(data_seed if data_seed is not None else torch.initial_seed())))
    own = getattr(sampler, "generator", _NO_ATTRIBUTE)
    if own is _NO_ATTRIBUTE or (own is None and world == 1):
        return OwnOrder(sampler)
    if own is None:  # Accelerate gives the sampler a generator, seeded from the global RNG
        seed = int(share(int(torch.empty((), dtype=torch.int64).random_().item())))
        return StreamOrder(sampler, torch.Generator().manual_seed(seed).get_state())
    return StreamOrder(sampler, share(own.get_state()),
                       replays=own if loader_generator is own else None)


def restored(order: EpochOrder, state: dict[str, Any]) -> EpochOrder:
    """`order` with a checkpoint's `state` loaded, or the saved kind of order when it differs (the module note)."""
    kind = state.get("kind")
    sampler = order.sampler
    if kind == "seeded" and not isinstance(order, SeededOrder):
        order = SeededOrder(sampler, int(state["seed"]))
    elif kind == "stream" and not isinstance(order, StreamOrder):
        order = StreamOrder(sampler, state["start"], replays=sampler.generator if state["replays"] else None)
    elif kind == "own" and not isinstance(order, OwnOrder):
        order = OwnOrder(sampler)
    order.load_state_dict(state)
    return order

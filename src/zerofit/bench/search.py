"""Largest batch that fits: double until a try runs out of memory, then bisect the gap.

The search is a pure record of what was tried (`BatchSearch`); who runs the tries - one process
that recovers from each out-of-memory, or a fresh process per failure - only feeds it results.
It stops when the gap between the largest batch that fit and the smallest that did not is at most
`tolerance` of the former (1/16: about 6 %, the precision a batch-size column needs; exact below 16),
or at `max_batch`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class BatchSearch:
    max_batch: int
    fits: int = 0
    """Largest batch that ran (0: none yet)."""
    fails: int | None = None
    """Smallest batch that ran out of memory (None: none yet)."""
    start: int = 1
    tolerance: float = 1 / 16

    def next(self) -> int | None:
        """The next batch to try, or None when the search is over."""
        if self.fails is None:  # no failure yet: start, then double up to the cap
            if self.fits == 0:
                return min(self.start, self.max_batch)
            return None if self.fits >= self.max_batch else min(2 * self.fits, self.max_batch)
        if self.fits == 0:  # the start did not fit: halve down to 1
            return None if self.fails <= 1 else self.fails // 2
        if self.fails - self.fits <= max(1, int(self.fits * self.tolerance)):
            return None
        return (self.fits + self.fails) // 2

    def record(self, batch: int, fits: bool) -> None:
        if fits:
            self.fits = max(self.fits, batch)
        else:
            self.fails = batch if self.fails is None else min(self.fails, batch)
        if self.fails is not None and self.fits >= self.fails:
            raise ValueError(f"batch {self.fits} fit after batch {self.fails} ran out of memory: memory use is not "
                             "monotonic in the batch here, so the search cannot bisect")

    @property
    def none_fit(self) -> bool:
        """Even batch 1 ran out of memory."""
        return self.fits == 0 and self.fails == 1

    @property
    def capped(self) -> bool:
        """The search reached `max_batch` without running out of memory."""
        return self.fails is None and self.fits >= self.max_batch

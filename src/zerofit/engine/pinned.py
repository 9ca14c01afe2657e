"""Page-locked host tensors of exactly the size asked for.

torch's pinned allocator (`pin_memory=True`) caches blocks whose sizes are rounded up to a power of
two, so a 0.8 GB shard of a 7 B model's block costs 1 GiB of locked memory - a third more host
memory for the offloaded master and gradients, which are most of what a big run keeps in host
memory. Instead, offloaded state is allocated as ordinary host memory of the exact size and then
registered (page-locked) with CUDA, which makes host<->GPU copies of it asynchronous all the same.

[Note: registered lifetime]
A registered range must be unregistered before its memory goes back to the C allocator. The
finalizer below runs when the tensor returned here dies, and holds the storage until it has
unregistered it. Views do not end the registration early: a view keeps its base tensor (`_base`)
alive, so the finalizer runs only once the last view is gone (tests/test_engine_pinned.py).
"""

from __future__ import annotations

import weakref

import torch

_CUDA_SUCCESS = 0


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D host tensor, page-locked for the CUDA device when there is one."""
    t = torch.empty(numel, dtype=dtype)
    if numel == 0 or not torch.cuda.is_available():
        return t
    storage = t.untyped_storage()
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(storage.data_ptr(), storage.nbytes(), 0)) != _CUDA_SUCCESS:
        # e.g. the locked-memory limit: torch's allocator reports that clearly, let it
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    weakref.finalize(t, _unregister, storage)
    return t


def pinned_copy(src: torch.Tensor) -> torch.Tensor:
    out = pinned_empty(src.numel(), src.dtype).view(src.shape)
    out.copy_(src)
    return out


def _unregister(storage) -> None:
    torch.cuda.cudart().cudaHostUnregister(storage.data_ptr())

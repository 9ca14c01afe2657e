"""Exact-size page-locked host tensors (zerofit.engine.pinned)."""

from __future__ import annotations

import gc

import pytest
import torch

from zerofit.engine.pinned import pinned_copy, pinned_empty


def test_pinned_copy_has_the_values_shape_and_exact_size():
    src = torch.arange(12, dtype=torch.float32).view(3, 4)
    out = pinned_copy(src)
    assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()
    assert out.untyped_storage().nbytes() == 12 * 4  # never rounded up
    assert pinned_empty(0, torch.bfloat16).numel() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_registered_while_any_view_lives_and_copies_are_async():
    n = 3 * 2**20 + 5  # not a power of two
    view = pinned_empty(n, torch.float32)[1:]
    gc.collect()
    assert view.is_pinned()  # the base died as a Python name, but the view keeps it registered
    view.fill_(2.0)
    dev = view.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert float(dev.sum()) == 2.0 * (n - 1)
    ptr = view.untyped_storage().data_ptr()
    del view, dev
    gc.collect()
    again = torch.empty(n, dtype=torch.float32)
    # the range was unregistered before it was freed: registering it (or its reuse) again works
    if again.untyped_storage().data_ptr() == ptr:
        assert int(torch.cuda.cudart().cudaHostRegister(ptr, again.untyped_storage().nbytes(), 0)) == 0
        torch.cuda.cudart().cudaHostUnregister(ptr)

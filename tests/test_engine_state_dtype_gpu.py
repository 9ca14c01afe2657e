"""Optimizer state in bf16 or 8 bits on CUDA: kept on the GPU, GPU-stepped from host memory (whole and 64-element
chunks), with parameter offload - the same state and weights bit for bit, as on CPU
(tests/test_engine_state_dtype.py). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from test_engine_gpu import _train_offload, requires_cuda

pytestmark = pytest.mark.gpu


@requires_cuda
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["bf16", "no"])
@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_narrow_state_is_the_same_on_the_gpu_and_gpu_stepped(stage, precision, state):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_losses, ref, _ = _train_offload(stage, precision, "adamw", offload="none", state=state)
    fp32_losses, _, _ = _train_offload(stage, precision, "adamw", offload="none")
    assert fp32_losses != ref_losses  # the state really is stored narrow
    # ratio 0.5: the first units' state stays on the GPU and steps in the stream's slot of its own, issued among the
    # offloaded units' chunks ([Note: resident chunks]); at stage 3 their parameters are offloaded too
    off = "cpu" if stage == 3 else "none"
    for chunk, param, ratio in ((0, "none", 1.0), (64, "none", 1.0), (64, off, 1.0), (64, off, 0.5)):
        losses, got, _ = _train_offload(stage, precision, "adamw", offload="cpu", offload_param=param, chunk=chunk,
                                        state=state, ratio=ratio)
        assert losses == ref_losses, (chunk, param, ratio)
        assert all(torch.equal(ref[k], got[k]) for k in ref), (chunk, param, ratio)


@requires_cuda
@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_narrow_state_gpu_stepped_from_nvme_is_the_same_as_on_the_gpu(tmp_path, state):
    """The files and pinned slots hold codes and block scales; the chunks upload them from the slot."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_losses, ref, _ = _train_offload(3, "bf16", "adamw", offload="none", state=state)
    losses, got, streamed = _train_offload(3, "bf16", "adamw", offload="nvme", nvme_path=str(tmp_path), chunk=64,
                                           buffer_count=2, state=state)
    assert streamed > 0 and _train_offload.pinned_slots
    assert losses == ref_losses
    assert all(torch.equal(ref[k], got[k]) for k in ref)


@requires_cuda
@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_narrow_state_host_stepped_beside_gpu_stepped_trains_as_on_the_gpu(state):
    """The host part steps with the CPU's kernel (another rounding than the GPU's fused AdamW): close, not equal."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_losses, ref, _ = _train_offload(2, "bf16", "adamw", offload="none", state=state)
    losses, got, streamed = _train_offload(2, "bf16", "adamw", offload="cpu", host_share=0.5, state=state)
    assert streamed > 0 and _train_offload.hosted > 0
    assert losses == pytest.approx(ref_losses, rel=1e-3)
    assert max((ref[k] - got[k]).abs().max().item() for k in ref) < 1e-2

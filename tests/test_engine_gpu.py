"""The engine on CUDA (side streams, NCCL-free world of one): same results as on CPU. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from engine_cases import DEFAULT_CHUNK, Case, batches, loss_fn, make_model_and_optim

from zerofit.config.schema import PrecisionConfig, ZeroConfig
from zerofit.engine import ZeroEngine

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _train(device: str, stage: int, precision: str = "no", gas: int = 2):
    case = Case(stage=stage, gas=gas, steps=6)
    model, opt = make_model_and_optim(case)
    engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=stage), device=torch.device(device),
                        precision=PrecisionConfig(mixed_precision=precision), gradient_accumulation_steps=gas,
                        gradient_clipping=0.5)
    losses = []
    micro = case.batch // gas
    for x, y in batches(case):
        for k in range(gas):
            loss = loss_fn(model(x[k * micro:(k + 1) * micro].to(device)), y[k * micro:(k + 1) * micro].to(device))
            engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, {k: v.cpu() for k, v in engine.named_full_tensors("master").items()}


@requires_cuda
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_cuda_matches_cpu_in_fp32(stage):
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu_losses, cpu_params = _train("cpu", stage)
    gpu_losses, gpu_params = _train("cuda", stage)
    assert max(abs(a - b) for a, b in zip(cpu_losses, gpu_losses)) < 1e-4
    assert max((cpu_params[k] - gpu_params[k]).abs().max().item() for k in cpu_params) < 1e-4


@requires_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_low_precision_trains(precision):
    losses, _ = _train("cuda", 3, precision)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def _train_offload(stage: int, precision: str, optim: str, *, offload: str, offload_param: str = "none",
                   chunk: int = 0, gas: int = 1, clip: float = 0.5, host_share: float | None = None,
                   nvme_path: str | None = None, buffer_count: int = 4, state: str = "fp32", ratio: float = 1.0):
    """One GPU: `offload` "none" (state on the GPU), "cpu" (GPU-stepped from host memory, step_on auto) or
    "nvme" (GPU-stepped from files under `nvme_path`, step_on device)."""
    from zerofit.config.schema import LossScaleConfig, OffloadConfig
    from zerofit.engine.offload import gpu

    case = Case(stage=stage, gas=gas, steps=6, optim=optim)
    model, opt = make_model_and_optim(case)
    gpu.STREAM_CHUNK = chunk or DEFAULT_CHUNK
    step_on = "device" if offload == "nvme" else "auto"
    zero = ZeroConfig(stage=stage, offload_optimizer=OffloadConfig(device=offload, host_share=host_share,
                                                                   nvme_path=nvme_path, step_on=step_on,
                                                                   buffer_count=buffer_count, ratio=ratio),
                      offload_param=OffloadConfig(device=offload_param),
                      # offloaded parameters: every unit's, however small (else the tiny model's stay on the GPU)
                      **({"param_persistence_threshold": 0} if offload_param != "none" else {}))
    try:
        engine = ZeroEngine(model, opt, zero=zero, device=torch.device("cuda"), gradient_accumulation_steps=gas,
                            precision=PrecisionConfig(mixed_precision=precision, optimizer_state=state,
                                                      loss_scale=LossScaleConfig(initial_scale_power=8)),
                            gradient_clipping=clip)
    finally:  # read once, as the step mode is built: later tests (the pool's byte count) see the default again
        gpu.STREAM_CHUNK = DEFAULT_CHUNK
    losses, micro = [], case.batch // gas
    for x, y in batches(case):
        for k in range(gas):
            loss = loss_fn(model(x[k * micro:(k + 1) * micro].cuda()), y[k * micro:(k + 1) * micro].cuda())
            engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    streamed = sum(g.placement.gpu_stepped for g in engine.groups)
    _train_offload.hosted = sum(g.placement.host_stepped for g in engine.groups)
    _train_offload.early = engine.times.gpu_steps_in_backward
    _train_offload.pinned_slots = engine.offload.swapper is not None and engine.offload.swapper.pool.pin
    return losses, {k: v.cpu() for k, v in engine.named_full_tensors("master").items()}, streamed


@requires_cuda
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision,optim", [("bf16", "adamw"), ("fp16", "adamw"), ("bf16", "sgd"), ("no", "adamw")])
def test_gpu_stepped_offload_is_bit_identical_to_state_on_the_gpu(stage, precision, optim):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_losses, ref, _ = _train_offload(stage, precision, optim, offload="none")
    for chunk, param in ((0, "none"), (64, "none"), (64, "cpu" if stage == 3 else "none")):
        losses, got, streamed = _train_offload(stage, precision, optim, offload="cpu", offload_param=param,
                                               chunk=chunk)
        assert streamed > 0
        assert losses == ref_losses, (chunk, param)
        assert all(torch.equal(ref[k], got[k]) for k in ref), (chunk, param)


@requires_cuda
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision,state", [("bf16", "fp32"), ("no", "fp32"), ("bf16", "8bit")])
def test_gpu_stepped_offload_streamed_during_backward_is_bit_identical(stage, precision, state):
    """No clipping: from the second step on, each unit's groups stream through the GPU while backward computes the
    units before it ([Note: updates during backward]); the update is the one the state on the GPU gets."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_losses, ref, _ = _train_offload(stage, precision, "adamw", offload="none", clip=0.0, state=state)
    for chunk, param in ((0, "none"), (64, "cpu" if stage == 3 else "none")):
        losses, got, streamed = _train_offload(stage, precision, "adamw", offload="cpu", offload_param=param,
                                               chunk=chunk, clip=0.0, state=state)
        assert streamed > 0 and _train_offload.early > 0
        assert losses == ref_losses, (chunk, param)
        assert all(torch.equal(ref[k], got[k]) for k in ref), (chunk, param)


@requires_cuda
@pytest.mark.parametrize("stage,precision,param", [(2, "bf16", "none"), (3, "fp16", "cpu"), (1, "no", "none")])
def test_a_split_between_host_and_gpu_steps_matches_state_on_the_gpu(stage, precision, param):
    """Half the offloaded units on the CPU optimizer, half streamed, in one step: the host half runs torch's
    fused CPU kernel instead of the CUDA one, so the results agree to rounding, not bit for bit."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_losses, ref, _ = _train_offload(stage, precision, "adamw", offload="none")
    losses, got, streamed = _train_offload(stage, precision, "adamw", offload="cpu", offload_param=param,
                                           chunk=64, host_share=0.5)
    assert streamed > 0 and _train_offload.hosted > 0
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-3
    assert max((ref[k] - got[k]).abs().max().item() for k in ref) < 1e-4


@requires_cuda
def test_gpu_stepped_offload_with_accumulation_matches():
    ref_losses, ref, _ = _train_offload(2, "bf16", "adamw", offload="none", gas=2)
    losses, got, _ = _train_offload(2, "bf16", "adamw", offload="cpu", gas=2, chunk=64)
    assert losses == ref_losses and all(torch.equal(ref[k], got[k]) for k in ref)


@requires_cuda
def test_gpu_stepped_offload_resumes_from_a_checkpoint_bit_for_bit(tmp_path):
    """The state a load puts in host memory (scalars on the CPU) is what the next streamed step uses."""
    from test_engine_gpu_step import _checkpoint_rank

    from zerofit.testing.distributed import run_distributed

    first, resumed = run_distributed(_checkpoint_rank, 1, str(tmp_path), "cuda")[0]
    assert all(torch.equal(first[k], resumed[k]) for k in first)


@requires_cuda
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["bf16", "no"])
def test_gpu_stepped_offload_from_nvme_is_bit_identical_to_state_on_the_gpu(stage, precision, tmp_path):
    """File -> pinned slot -> GPU chunks -> slot -> file, with clipping: the writes wait for the downloads
    (a write before them would store stale state, and the next step would differ)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_losses, ref, _ = _train_offload(stage, precision, "adamw", offload="none")
    for chunk, param, buffers in ((0, "none", 4), (64, "cpu" if stage == 3 else "none", 2)):
        losses, got, streamed = _train_offload(stage, precision, "adamw", offload="nvme", offload_param=param,
                                               chunk=chunk, nvme_path=str(tmp_path), buffer_count=buffers)
        assert streamed > 0 and _train_offload.hosted == 0 and _train_offload.pinned_slots
        assert losses == ref_losses, (chunk, param)
        assert all(torch.equal(ref[k], got[k]) for k in ref), (chunk, param)


@requires_cuda
def test_gpu_stepped_offload_from_nvme_resumes_from_a_checkpoint_bit_for_bit(tmp_path):
    from test_engine_gpu_step import _checkpoint_rank

    from zerofit.testing.distributed import run_distributed

    swap = tmp_path / "swap"
    swap.mkdir()
    first, resumed = run_distributed(_checkpoint_rank, 1, str(tmp_path), "cuda", str(swap))[0]
    assert all(torch.equal(first[k], resumed[k]) for k in first)

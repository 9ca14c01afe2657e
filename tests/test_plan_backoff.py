"""Out-of-memory back-off: a simulated CUDA OOM halves the micro-batch, doubles accumulation, and the run
ends where the run without OOM ends (world 1 and 2 gloo ranks, fp32).

Tolerance: 1e-6 on parameters - halving a micro-batch changes only the order of the sums.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from zerofit import Accelerator
from zerofit.config import load_config
from zerofit.config.schema import BatchConfig, OffloadConfig, RunConfig, ZeroConfig
from zerofit.errors import ConfigError, EngineError
from zerofit.frontend.planning.backoff import split_batch
from zerofit.testing.distributed import run_distributed

N, MICRO, GAS = 64, 8, 2


class Samples(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(N, 8, generator=g), torch.randn(N, generator=g)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "id": i}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x, y, id=None):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return SimpleNamespace(loss=((self.head(x).squeeze(-1) - y) ** 2).mean())


class OomAbove:
    """Raises torch.OutOfMemoryError from forward for batches larger than `limit`, from forward call `start` on."""

    def __init__(self, limit: int, start: int):
        self.limit, self.start, self.calls = limit, start, 0

    def __call__(self, _module, _args, kwargs):
        self.calls += 1
        if self.calls >= self.start and kwargs["x"].shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated by the test)")


def train(rank: int, world: int, stage: int, oom: tuple[int, int] | None, oom_rank: int = 0,
          offload: bool = False, after_backward: bool = False, backoff: bool = True, setup=None):
    torch.manual_seed(0)
    zero = ZeroConfig(stage=stage, offload_optimizer=OffloadConfig(device="cpu" if offload else "none"))
    acc = Accelerator(gradient_accumulation_steps=GAS,
                      config=RunConfig(zero=zero, batch=BatchConfig(oom_backoff=backoff)))
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, dl, sched = acc.prepare(model, opt, DataLoader(Samples(), batch_size=MICRO), sched)
    agreements, agree = [], acc._backoff._agree
    acc._backoff._agree = lambda failed: agreements.append(failed) or agree(failed)  # counts the all-reduces
    if setup is not None:
        setup(acc, model)
    if oom is not None and oom_rank in (rank, -1):
        hook = OomAbove(*oom)
        if after_backward:
            opt.optimizer.register_step_pre_hook(lambda *_: hook(None, (), {"x": torch.zeros(MICRO)}))
        else:
            model.register_forward_pre_hook(hook, with_kwargs=True)
    steps, committed, pending, accum = [], [], [], acc.gradient_accumulation_steps
    for batch in dl:
        if acc.gradient_accumulation_steps != accum:  # a back-off threw the window away: it is replayed
            pending, accum = [], acc.gradient_accumulation_steps
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            pending += batch["id"].tolist()
            opt.step()
            sched.step()
            opt.zero_grad()
            if acc.sync_gradients:
                committed.append(sorted(pending))
                pending = []
                steps.append(sched.get_last_lr()[0])
    params = acc._prepared.trained_engine().named_full_tensors("master")
    return {"params": params, "committed": committed, "lrs": steps, "accum": acc.gradient_accumulation_steps,
            "agreements": len(agreements)}


def _close(a, b):
    assert a["committed"] == b["committed"]  # same samples in the same optimizer steps: none lost or repeated
    assert a["lrs"] == b["lrs"]  # the scheduler followed the real optimizer steps
    for name, p in a["params"].items():
        torch.testing.assert_close(p, b["params"][name], atol=1e-6, rtol=0)


def test_split_batch_cuts_tensors_and_lists():
    batch = {"x": torch.arange(6).view(3, 2), "names": ["a", "b", "c"], "flag": True}
    halves = split_batch(batch, 2)
    assert [h["x"].shape[0] for h in halves] == [2, 1]
    assert halves[0]["names"] == ["a", "b"] and halves[1]["names"] == ["c"] and halves[1]["flag"] is True


def test_a_loop_without_accumulate_keeps_no_window():
    acc = Accelerator(config=RunConfig())
    dl = acc.prepare(DataLoader(Samples(), batch_size=MICRO))
    for _ in dl:
        pass
    assert dl.splitter.window == [] and not dl.splitter.recording


@pytest.mark.parametrize("start", [1, 4])
def test_one_rank_backs_off_and_matches(capfd, start):
    ref = train(0, 1, 0, None)
    # OOM at the 1st forward, or at the 4th: the second micro-step of the second window (a seen batch replays)
    got = train(0, 1, 0, (MICRO // 2, start))
    assert "backing off 1/4: micro-batch 8 -> 4, gradient accumulation 2 -> 4" in capfd.readouterr().err
    assert got["accum"] == 2 * GAS
    _close(got, ref)


def test_bounded_tries_end_in_a_clear_error():
    with pytest.raises(EngineError, match=r"micro-batch is 1 and cannot be halved.*Estimate for this model"):
        train(0, 1, 0, (0, 1))


def test_oom_in_the_optimizer_step_is_not_recoverable():
    with pytest.raises(EngineError, match="out of memory in the optimizer step.*half updated|part of the parameters"):
        train(0, 1, 0, (0, 1), after_backward=True)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the block input needs no grad
def test_oom_in_backward_after_early_host_steps_is_not_recoverable():
    """With optimizer offload, the host step of a group starts as soon as its gradient is final in the
    window's last backward: an OOM later in that backward must not replay a window already partly applied."""

    def oom_in_backward(acc, model):
        calls = []

        def hook(*_):
            calls.append(1)
            engine = acc._prepared.trained_engine()
            if len(calls) == 2 * GAS and engine.update_started:  # the second window's closing backward
                raise torch.OutOfMemoryError("CUDA out of memory (simulated by the test)")

        model.blocks[0].register_full_backward_hook(hook)  # the first block's backward runs last

    with pytest.raises(EngineError, match="out of memory in backward.*part of the parameters"):
        train(0, 1, 2, None, offload=True, setup=oom_in_backward)


def _two_ranks(rank: int, world: int):
    ref = train(rank, world, 2, None)
    got = train(rank, world, 2, (MICRO // 2, 3), oom_rank=1)  # only rank 1 runs out of memory
    return ref, got


def test_two_ranks_agree_and_match():
    for ref, got in run_distributed(_two_ranks, 2, timeout=120):
        assert got["accum"] == 2 * GAS
        _close(got, ref)


def _offload_forward_oom(rank: int, world: int):
    try:
        train(rank, world, 2, (0, 1), oom_rank=-1, offload=True)
    except EngineError as e:
        return str(e)
    return None


def test_two_ranks_refuse_where_forward_communicates():
    # With optimizer offload on several ranks forward all-gathers updated parameters: no agreement is safe.
    for rank, message in enumerate(run_distributed(_offload_forward_oom, 2, timeout=120)):
        assert message is not None and f"rank {rank}: CUDA out of memory in forward" in message
        assert "parameter gathers between the ranks run in forward" in message


def _with_and_without_backoff(rank: int, world: int):
    return train(rank, world, 2, None), train(rank, world, 2, None, backoff=False)


def test_opting_out_removes_the_per_micro_step_agreement():
    for on, off in run_distributed(_with_and_without_backoff, 2, timeout=120):
        assert on["agreements"] == N // (MICRO * 2)  # one blocking all-reduce per micro-step of each rank
        assert off["agreements"] == 0
        _close(off, on)  # and the same training otherwise


def test_opted_out_an_oom_is_the_oom():
    with pytest.raises(torch.OutOfMemoryError, match="simulated by the test"):
        train(0, 1, 0, (MICRO // 2, 1), backoff=False)


def test_the_key_is_read_from_zerofit_yaml_and_checked(tmp_path):
    path = tmp_path / "z.yaml"
    path.write_text("batch:\n  oom_backoff: false\n")
    assert load_config(str(path)).batch.oom_backoff is False
    path.write_text("batch:\n  oom_backoff: sometimes\n")
    with pytest.raises(ConfigError, match=r"batch\.oom_backoff .*sometimes"):
        load_config(str(path))

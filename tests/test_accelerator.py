"""`Accelerator` on 2 gloo ranks against an unsharded single-process reference, and its prepare() rules.

The loop under test is the one every `*_no_trainer.py` script runs: `accumulate` + `backward` +
`clip_grad_norm_` + `optimizer.step()` + `scheduler.step()` + `zero_grad()`, called on every micro-step.
"""

from __future__ import annotations

import math

import pytest
import torch
from engine_cases import DIM, SEQ, VOCAB, TinyLM, loss_fn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from zerofit import Accelerator, DummyOptim, DummyScheduler
from zerofit.config.schema import AUTO, OptimizerConfig, RunConfig, SchedulerConfig, ZeroConfig
from zerofit.errors import ConfigError
from zerofit.frontend.data.loaders import ShardedDataLoader
from zerofit.frontend.optimizers import AcceleratedOptimizer
from zerofit.frontend.schedulers import AcceleratedScheduler
from zerofit.testing.distributed import run_distributed

MICRO, N_SAMPLES, CLIP, LR = 2, 48, 0.5, 1e-2


def _data():
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, VOCAB, (N_SAMPLES, SEQ), generator=g)
    return x, torch.roll(x, 1, dims=1)


def _model_and_optim():
    torch.manual_seed(0)
    model = TinyLM()
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=LR)
    return model, opt


def _lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.05 * step)


def reference(world: int, gas: int):
    """One process, the whole global batch per optimizer step; the scheduler steps `world` times per step
    (Accelerate's rule for a script-built scheduler without split_batches)."""
    model, opt = _model_and_optim()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    x, y = _data()
    per_step = MICRO * world * gas
    losses, norms = [], []
    for s in range(N_SAMPLES // per_step):
        xs, ys = x[s * per_step:(s + 1) * per_step], y[s * per_step:(s + 1) * per_step]
        loss = loss_fn(model(xs), ys)
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        for _ in range(world):
            sched.step()
        opt.zero_grad()
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_like_a_script(rank: int, world: int, cases: list[tuple[int, int]]):
    out = {}
    for stage, gas in cases:
        config = RunConfig(zero=ZeroConfig(stage=stage, param_persistence_threshold=0))
        acc = Accelerator(gradient_accumulation_steps=gas, config=config)
        model, opt = _model_and_optim()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
        real_steps = []
        opt.register_step_post_hook(lambda *_, seen=real_steps: seen.append(1))
        dl = DataLoader(TensorDataset(*_data()), batch_size=MICRO, shuffle=False)
        # any order: scheduler first, dataloader in the middle
        sched, model_p, dl, opt = acc.prepare(sched, model, dl, opt)
        assert model_p is model and acc.unwrap_model(model_p) is model
        micro_losses, norms, lrs, syncs = [], [], [], []
        for x, y in dl:
            with acc.accumulate(model):
                loss = loss_fn(model(x), y)
                acc.backward(loss)
                if acc.sync_gradients:
                    norms.append(acc.clip_grad_norm_(model.parameters(), CLIP).item())
                opt.step()
                sched.step()
                opt.zero_grad()
            micro_losses.append(acc.gather(loss.detach()).mean().item())
            lrs.append(sched.get_last_lr()[0])
            syncs.append(acc.sync_gradients)
        engine = acc._prepared.engines[id(model)]
        out[(stage, gas)] = {
            "losses": [sum(micro_losses[i:i + gas]) / gas for i in range(0, len(micro_losses), gas)],
            "norms": norms, "lrs": lrs, "syncs": syncs, "real_steps": len(real_steps),
            "params": engine.named_full_tensors("master"), "len": len(dl),
        }
    return out


CASES = [(0, 1), (0, 2), (3, 1), (3, 2)]


def test_script_loop_on_two_ranks_matches_the_unsharded_reference():
    results = run_distributed(train_like_a_script, 2, CASES, timeout=240)
    for stage, gas in CASES:
        ref_losses, ref_norms, ref_params = reference(2, gas)
        for rank_out in results:
            got = rank_out[(stage, gas)]
            steps = N_SAMPLES // (MICRO * 2 * gas)
            assert got["len"] == N_SAMPLES // (MICRO * 2)
            assert got["real_steps"] == steps  # optimizer.step() on every micro-step, real steps at boundaries
            assert got["syncs"] == [(i + 1) % gas == 0 for i in range(steps * gas)]
            # the scheduler moves only at boundaries, world (=2) scheduler steps per optimizer step
            expected_lrs = [LR * _lr_lambda(2 * ((i + 1) // gas)) for i in range(steps * gas)]
            assert got["lrs"] == pytest.approx(expected_lrs, rel=1e-12)
            assert got["losses"] == pytest.approx(ref_losses, abs=2e-6), (stage, gas)
            assert got["norms"] == pytest.approx(ref_norms, abs=2e-6), (stage, gas)
            assert max(ref_norms) > CLIP  # clipping really happened
            for name, ref in ref_params.items():
                torch.testing.assert_close(got["params"][name], ref, atol=2e-6, rtol=0, msg=f"{stage} {gas} {name}")


class Stream(IterableDataset):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter([(torch.tensor(i),) for i in range(self.n)])

    def __len__(self):
        return self.n


def gather_eval(rank: int, world: int, cases: list[tuple[int, int, bool]]):
    out = []
    for n, batch, stream in cases:
        acc = Accelerator()
        data = Stream(n) if stream else TensorDataset(torch.arange(n))
        dl = acc.prepare(DataLoader(data, batch_size=batch))
        seen, plain, last_flags = [], 0, []
        for (x,) in dl:
            seen.append(acc.gather_for_metrics(x))
            plain += acc.gather(x).numel()
            last_flags.append(acc.gradient_state.end_of_dataloader)
        out.append((torch.cat(seen).tolist(), plain, last_flags, len(dl)))
    acc = Accelerator()
    ragged = torch.full((rank + 1, 2), rank + 1)  # rank 0: 1 row, rank 1: 2 rows
    padded = acc.pad_across_processes(ragged, dim=0, pad_index=-1)
    labels = torch.tensor([rank, rank])  # one dimension: padding along dim 1 leaves it, as Trainer's eval needs
    extras = {"padded": acc.gather(padded).tolist(),
              "labels": acc.gather(acc.pad_across_processes(labels, dim=1, pad_index=-100)).tolist(),
              "sum": acc.reduce(torch.tensor([rank + 1.0])).item(),
              "mean": acc.reduce(torch.tensor([rank + 1.0]), reduction="mean").item(),
              "objects": acc.gather_for_metrics([f"r{rank}"], use_gather_object=True)}
    return out, extras


def test_gather_for_metrics_returns_exactly_the_dataset_when_the_last_batch_is_uneven():
    cases = [(11, 2, False), (8, 2, False), (5, 4, False), (3, 4, False), (11, 2, True), (8, 2, True)]
    results = run_distributed(gather_eval, 2, cases)
    for rank_out, extras in results:
        assert extras["padded"] == [[1, 1], [-1, -1], [2, 2], [2, 2]]
        assert extras["labels"] == [0, 0, 1, 1]
        assert (extras["sum"], extras["mean"], extras["objects"]) == (3.0, 1.5, ["r0", "r1"])
        for (n, batch, _), (seen, plain, last_flags, length) in zip(cases, rank_out):
            steps = math.ceil(n / (2 * batch))
            assert seen == list(range(n)), (n, batch)
            assert plain == steps * 2 * batch  # plain gather keeps the repeated samples
            assert length == steps and last_flags == [False] * (steps - 1) + [True]


def test_prepare_returns_the_same_count_in_the_same_order_for_any_subset():
    acc = Accelerator()
    model, opt = _model_and_optim()
    dl = DataLoader(TensorDataset(*_data()), batch_size=4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    assert isinstance(acc.prepare(dl), ShardedDataLoader)  # one object: not a tuple
    d2, s, m, o, other = acc.prepare(dl, sched, model, opt, "untouched")
    assert isinstance(d2, ShardedDataLoader) and isinstance(s, AcceleratedScheduler)
    assert m is model and isinstance(o, AcceleratedOptimizer) and o.optimizer is opt and other == "untouched"
    assert o.param_groups[0]["weight_decay"] == 0.1 and "state" in o.state_dict()
    assert acc.prepare(TinyLM()).emb.weight.shape == (VOCAB, DIM)  # a model alone: evaluation only


def test_optimizer_without_its_model_is_an_error():
    acc = Accelerator()
    model, opt = _model_and_optim()
    acc.prepare(model)
    with pytest.raises(ValueError, match="same prepare\\(\\) call"):
        acc.prepare(opt)


def _config_with(optimizer=None, scheduler=None) -> RunConfig:
    return RunConfig(optimizer=optimizer, scheduler=scheduler, source="ds.json", source_format="deepspeed")


def test_client_optimizer_with_a_config_optimizer_is_an_error():
    acc = Accelerator(config=_config_with(optimizer=OptimizerConfig(type="AdamW", params={"lr": 1e-3})))
    model, opt = _model_and_optim()
    with pytest.raises(ConfigError, match="passes its own optimizer \\(AdamW\\) and the config names one too.*"
                                          "pass zerofit.utils.DummyOptim\\(params"):  # the public spelling
        acc.prepare(model, opt)


def test_dummy_optim_without_a_config_optimizer_is_an_error():
    acc = Accelerator()
    model, _ = _model_and_optim()
    with pytest.raises(ConfigError, match="DummyOptim but the config has no optimizer section"):
        acc.prepare(model, DummyOptim(model.parameters(), lr=1e-3))


def test_dummy_scheduler_without_a_config_scheduler_is_an_error():
    acc = Accelerator(config=_config_with(optimizer=OptimizerConfig(type="AdamW", params={"lr": AUTO})))
    model, _ = _model_and_optim()
    opt = DummyOptim(model.parameters(), lr=1e-3)
    with pytest.raises(ConfigError, match="DummyScheduler but the config has no scheduler section"):
        acc.prepare(model, opt, DummyScheduler(opt, total_num_steps=10))


def test_client_scheduler_with_a_config_scheduler_is_an_error():
    acc = Accelerator(config=_config_with(scheduler=SchedulerConfig(type="WarmupLR", params={})))
    model, opt = _model_and_optim()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    with pytest.raises(ConfigError, match="passes its own scheduler \\(LambdaLR\\) and the config names one too"):
        acc.prepare(model, opt, sched)


def test_unknown_keyword_is_a_type_error_and_ignored_accelerate_keywords_warn():
    with pytest.raises(TypeError):
        Accelerator(not_an_argument=1)
    with pytest.warns(UserWarning, match=r"rng_types=\.\.\.\) is accepted for compatibility and ignored"):
        Accelerator(rng_types=["torch"])


def test_backward_under_no_sync_keeps_accumulating_and_the_optimizer_waits():
    acc = Accelerator()
    model, opt = _model_and_optim()
    model, opt = acc.prepare(model, opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = _data()
    with acc.no_sync(model):
        acc.backward(loss_fn(model(x[:2]), y[:2]))
    opt.zero_grad()  # mid-window: must not throw the accumulated gradient away
    acc.backward(loss_fn(model(x[2:4]), y[2:4]))
    norm = acc.clip_grad_norm_(model.parameters(), 1e9)
    ref, _ = _model_and_optim()
    (loss_fn(ref(x[:2]), y[:2]) + loss_fn(ref(x[2:4]), y[2:4])).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    assert norm.item() == pytest.approx(want.item(), rel=1e-5)
    opt.step()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_clip_grad_norm_off_a_boundary_warns_and_leaves_gradients():
    acc = Accelerator(gradient_accumulation_steps=2)
    model, opt = _model_and_optim()
    model, opt = acc.prepare(model, opt)
    x, y = _data()
    with acc.accumulate(model):
        acc.backward(loss_fn(model(x[:2]), y[:2]))
        with pytest.warns(UserWarning, match="does not close an accumulation window"):
            assert acc.clip_grad_norm_(model.parameters(), 1.0) is None
    with pytest.raises(ValueError, match="norm_type=2"):
        acc.clip_grad_norm_(model.parameters(), 1.0, norm_type=1)


# --- a scheduler built after prepare() on the prepared optimizer (what Trainer always does) ---------------
def _schedule_on(opt, kind: str, steps: int):
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    if kind == "linear_warmup":
        from transformers import get_linear_schedule_with_warmup

        return get_linear_schedule_with_warmup(opt, num_warmup_steps=3, num_training_steps=steps)
    # cycles AdamW's betas[0] too (cycle_momentum): a setting other than lr that must reach the engine
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=4 * LR, total_steps=steps)


def _trace_of_reference(kind: str, world: int, prepared: bool):
    """One unsharded process over the global batch; a prepared scheduler steps `world` times per step."""
    model, opt = _model_and_optim()
    x, y = _data()
    per_step, steps = MICRO * world, N_SAMPLES // (MICRO * world)
    calls = world if prepared else 1
    sched = _schedule_on(opt, kind, steps * calls)
    losses, lrs, betas = [], [], []
    for s in range(steps):
        loss = loss_fn(model(x[s * per_step:(s + 1) * per_step]), y[s * per_step:(s + 1) * per_step])
        loss.backward()
        opt.step()
        for _ in range(calls):
            sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        lrs.extend(g["lr"] for g in opt.param_groups)
        betas.append(opt.param_groups[0]["betas"][0])
    return losses, lrs, betas, {n: p.detach().clone() for n, p in model.named_parameters()}


def schedule_after_prepare(rank: int, world: int, cases: list[tuple[int, str, bool]]):
    import warnings

    out = {}
    for stage, kind, prepared in cases:
        acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=stage, param_persistence_threshold=0)))
        model, opt = _model_and_optim()
        dl = DataLoader(TensorDataset(*_data()), batch_size=MICRO, shuffle=False)
        model, opt, dl = acc.prepare(model, opt, dl)
        steps = len(dl) * (world if prepared else 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sched = _schedule_on(opt, kind, steps)
            if prepared:  # zerofit's wrapper around it: steps `world` times per optimizer step
                sched = acc.prepare(sched)
            losses, lrs, betas = [], [], []
            for x, y in dl:
                with acc.accumulate(model):
                    loss = loss_fn(model(x), y)
                    acc.backward(loss)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                losses.append(acc.gather(loss.detach()).mean().item())
                lrs.extend(g["lr"] for g in opt.param_groups)
                betas.append(opt.param_groups[0]["betas"][0])
        engine = acc._prepared.engines[id(model)]
        out[(stage, kind, prepared)] = {
            "is_optimizer": isinstance(opt, torch.optim.Optimizer),
            "shares_groups": opt.param_groups is opt.optimizer.param_groups and opt.state is opt.optimizer.state
                             and opt.defaults is opt.optimizer.defaults,
            "prepared_again": acc.prepare(opt) is opt,
            "warnings": [str(w.message) for w in caught if "optimizer.step()" in str(w.message)],
            "losses": losses, "lrs": lrs, "betas": betas, "steps_taken": opt.steps_taken,
            "params": engine.named_full_tensors("master"),
        }
    return out


SCHEDULE_CASES = [(3, "lambda", False), (3, "linear_warmup", False), (2, "one_cycle", False), (3, "lambda", True)]


def test_a_torch_scheduler_built_after_prepare_follows_its_schedule_on_two_ranks():
    pytest.importorskip("transformers")
    results = run_distributed(schedule_after_prepare, 2, SCHEDULE_CASES, timeout=240)
    for case in SCHEDULE_CASES:
        ref_losses, ref_lrs, ref_betas, ref_params = _trace_of_reference(case[1], 2, case[2])
        for got in (rank_out[case] for rank_out in results):
            assert got["is_optimizer"] and got["shares_groups"] and got["prepared_again"], case
            assert got["warnings"] == [], case  # torch's wrapper on optimizer.step saw every step
            assert got["steps_taken"] == len(ref_losses)
            assert got["lrs"] == pytest.approx(ref_lrs, rel=1e-12), case
            assert got["betas"] == pytest.approx(ref_betas, rel=1e-12), case
            # the scheduled lr (and OneCycle's beta) reached the engine's step: same training as plain torch
            assert got["losses"] == pytest.approx(ref_losses, abs=2e-6), case
            for name, ref in ref_params.items():
                torch.testing.assert_close(got["params"][name], ref, atol=2e-6, rtol=0, msg=f"{case} {name}")
        assert len(set(ref_lrs)) > len(ref_losses) // 2  # the schedule really moves the lr

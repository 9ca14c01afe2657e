"""Config-named optimizers and schedules through `DummyOptim` / `DummyScheduler`, with "auto" values,
and who wins when the config and the script disagree."""

from __future__ import annotations

import json
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from engine_cases import SEQ, VOCAB, TinyLM
from torch.utils.data import DataLoader, TensorDataset

from zerofit import Accelerator
from zerofit.config.schema import RunConfig
from zerofit.frontend.schedulers import WarmupDecayLR
from zerofit.testing.distributed import run_distributed
from zerofit.utils import DummyOptim, DummyScheduler

DS_AUTO = {
    "optimizer": {"type": "Adam", "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.8, 0.9],
                                             "torch_adam": True, "adam_w_mode": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


def dummy_from_deepspeed_json(rank: int, world: int, path: str):
    acc = Accelerator(gradient_accumulation_steps=2, config=path)
    torch.manual_seed(0)
    model = TinyLM()
    model.config = SimpleNamespace(hidden_size=16)  # what "auto" persistence thresholds are computed from
    opt = DummyOptim(model.parameters(), lr=0.02, weight_decay=0.05)
    sched = DummyScheduler(opt, total_num_steps=21, warmup_num_steps=3)
    x = torch.randint(0, VOCAB, (32, SEQ))
    dl = DataLoader(TensorDataset(x, x), batch_size=4)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    inner, cfg = sched.scheduler, acc.config
    lrs = []
    for xb, yb in dl:
        with acc.accumulate(model):
            loss = torch.nn.functional.cross_entropy(model(xb).reshape(-1, VOCAB), yb.reshape(-1))
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(opt.param_groups[0]["lr"])
    return {
        "optimizer": type(opt.optimizer).__name__, "lr": opt.defaults["lr"], "wd": opt.defaults["weight_decay"],
        "betas": opt.defaults["betas"], "scheduler": type(inner).__name__, "total": inner.total_num_steps,
        "warmup": inner.warmup_num_steps, "max_lr": inner.max_lrs[0], "min_lr": inner.min_lrs[0],
        "batch": (cfg.batch.train_batch_size, cfg.batch.train_micro_batch_size_per_gpu,
                  cfg.batch.gradient_accumulation_steps),
        "clip": cfg.gradient_clipping, "threshold": cfg.zero.param_persistence_threshold, "stage": cfg.zero.stage,
        "lrs": lrs, "distributed_type": acc.distributed_type.value,
        "plugin_has_optimizer": "optimizer" in acc.state.deepspeed_plugin.deepspeed_config,
    }


def test_dummy_optim_and_scheduler_are_replaced_by_the_deepspeed_json_with_auto_values(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS_AUTO))
    for got in run_distributed(dummy_from_deepspeed_json, 2, str(path)):
        assert got["optimizer"] == "AdamW"  # DeepSpeed's Adam with adam_w_mode is AdamW; torch_adam dropped
        assert (got["lr"], got["wd"], got["betas"]) == (0.02, 0.05, (0.8, 0.9))
        assert got["scheduler"] == "WarmupDecayLR"
        assert got["total"] == math.ceil(21 / 2)  # counted on unsharded data: divided by the processes
        assert (got["warmup"], got["max_lr"], got["min_lr"]) == (3, 0.02, 0.0)
        assert got["batch"] == (4 * 2 * 2, 4, 2)  # micro from the DataLoader, accumulation from the script
        assert got["clip"] == 1.0 and got["stage"] == 2 and got["threshold"] == 10 * 16
        # a config schedule steps once per optimizer step (2 steps: 32 samples / (4 * 2 ranks * 2 accum))
        ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.02)
        ref = WarmupDecayLR(ref_opt, total_num_steps=11,
                            warmup_min_lr=0.0, warmup_max_lr=0.02, warmup_num_steps=3)
        want = []
        for sync in (False, True, False, True):
            if sync:
                ref_opt.step()
                ref.step()
            want.append(ref.get_last_lr()[0])
        assert got["lrs"] == pytest.approx(want)
        assert got["distributed_type"] == "DEEPSPEED" and got["plugin_has_optimizer"]


def test_config_value_wins_over_a_different_script_value_with_one_warning(tmp_path):
    path = tmp_path / "zerofit.yaml"
    path.write_text("batch:\n  gradient_accumulation_steps: 4\nprecision:\n  mixed_precision: bf16\n")
    with pytest.warns(UserWarning) as record:
        acc = Accelerator(gradient_accumulation_steps=2, mixed_precision="no", config=str(path))
    messages = [str(w.message) for w in record]
    assert any("batch.gradient_accumulation_steps is 4" in m and '"auto"' in m for m in messages)
    assert any("precision.mixed_precision is 'bf16'" in m for m in messages)
    assert acc.gradient_accumulation_steps == 4 and acc.mixed_precision == "bf16"


def test_without_a_config_file_the_script_decides():
    acc = Accelerator(gradient_accumulation_steps=3, mixed_precision="bf16", config=RunConfig())
    assert acc.gradient_accumulation_steps == 3 and acc.mixed_precision == "bf16" and not acc.use_fp16
    assert acc.distributed_type.value == "NO" and acc.state.deepspeed_plugin is None


def test_a_config_file_that_leaves_accumulation_unset_takes_the_script_value(tmp_path):
    path = tmp_path / "zerofit.yaml"
    path.write_text("zero:\n  stage: 2\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no mismatch warning: the file did not choose
        acc = Accelerator(gradient_accumulation_steps=2, config=str(path))
    assert acc.gradient_accumulation_steps == 2

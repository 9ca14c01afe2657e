"""A micro-batch "auto" with no DataLoader to take it from (see [Note: a micro-batch "auto" with no DataLoader])."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from zerofit import Accelerator
from zerofit.config import load_config
from zerofit.errors import ConfigError


def _config(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return load_config(str(path))


def _ds(tmp_path, **batch):
    return _config(tmp_path, "ds.json", json.dumps({"zero_optimization": {"stage": 2}, **batch}))


def _step(acc, model, opt):
    acc.backward(model(torch.randn(2, 4)).sum())
    opt.step()
    opt.zero_grad()


def test_training_without_a_dataloader_names_the_key_and_both_fixes(tmp_path):
    acc = Accelerator(config=_ds(tmp_path, train_micro_batch_size_per_gpu="auto", train_batch_size="auto"), cpu=True)
    model = torch.nn.Linear(4, 4)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ConfigError, match=r'train_micro_batch_size_per_gpu is "auto", but training started and no '
                                          r"DataLoader with a batch size was passed to accelerator.prepare\(\).*"
                                          r"prepare the training DataLoader .*or write the per-GPU micro-batch size "
                                          r'instead of "auto" \(for example train_micro_batch_size_per_gpu: 8\)'):
        _step(acc, model, opt)


def test_zerofit_yaml_speaks_its_own_key(tmp_path):
    cfg = _config(tmp_path, "z.yaml", "zero:\n  stage: 0\nbatch:\n  train_micro_batch_size_per_gpu: auto\n")
    acc = Accelerator(config=cfg, cpu=True)
    model = torch.nn.Linear(4, 4)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ConfigError, match=r'batch\.train_micro_batch_size_per_gpu is "auto"'):
        _step(acc, model, opt)


def test_a_dataloader_prepared_after_the_model_still_fills_it(tmp_path):
    acc = Accelerator(config=_ds(tmp_path, train_micro_batch_size_per_gpu="auto"), cpu=True)
    model = torch.nn.Linear(4, 4)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    rows = torch.randn(8, 4)
    acc.prepare(DataLoader(rows, batch_sampler=BatchSampler(SequentialSampler(rows), 2, False)))  # batch_size=None
    _step(acc, model, opt)
    assert acc.config.batch.train_micro_batch_size_per_gpu == 2


@pytest.mark.parametrize("name", ["accelerate", "derived", "unwritten"])
def test_no_error_where_the_file_did_not_ask_for_it(tmp_path, name):
    """Accelerate's own default "auto", a train_batch_size to derive it from, or no key at all."""
    cfg = {"accelerate": lambda: _config(tmp_path, "a.yaml", "distributed_type: DEEPSPEED\n"
                                                            "deepspeed_config:\n  zero_stage: 2\n"),
           "derived": lambda: _ds(tmp_path, train_micro_batch_size_per_gpu="auto", train_batch_size=8),
           "unwritten": lambda: _ds(tmp_path)}[name]()
    acc = Accelerator(config=cfg, cpu=True)
    model = torch.nn.Linear(4, 4)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    _step(acc, model, opt)

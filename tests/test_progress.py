"""`logging.steps_per_print`: the main process prints one line every N optimizer steps, only when set."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from engine_cases import SEQ, VOCAB, TinyLM, loss_fn

from zerofit import Accelerator
from zerofit.config import config_from_dict
from zerofit.config.schema import LoggingConfig, RunConfig
from zerofit.frontend.progress import Progress, progress_line


def _run(config: RunConfig, steps: int) -> None:
    acc = Accelerator(config=config)
    torch.manual_seed(0)
    model = TinyLM()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        acc.backward(loss_fn(model(x), x))
        opt.step()
        opt.zero_grad()


def test_a_line_every_n_steps_when_set(capsys):
    _run(RunConfig(logging=LoggingConfig(steps_per_print=2)), steps=5)
    setting, *steps = capsys.readouterr().out.splitlines()  # prepare() says what runs first (frontend.banner)
    assert setting.startswith("zerofit: ZeRO-0")
    assert steps == ["zerofit: step 2 | lr 0.05", "zerofit: step 4 | lr 0.05"]


def test_quiet_unless_the_config_sets_it(capsys):
    assert config_from_dict({"train_batch_size": 8}).logging.steps_per_print is None  # not DeepSpeed's 10
    assert config_from_dict({"steps_per_print": "inf"}).logging.steps_per_print is None  # Accelerate's "never"
    _run(RunConfig(), steps=3)
    assert "zerofit: step" not in capsys.readouterr().out


def test_only_the_main_process_prints():
    assert Progress.for_process(10, is_main=False) is None
    assert Progress.for_process(None, is_main=True) is None
    assert Progress.for_process(10, is_main=True).every == 10


def test_fp16_lines_carry_the_loss_scale_and_the_skipped_steps(capsys):
    progress = Progress(2)
    scaler = SimpleNamespace(enabled=True, scale=32768.0)
    opt = SimpleNamespace(engine=SimpleNamespace(scaler=scaler), steps_taken=0, step_was_skipped=False,
                          optimizer=SimpleNamespace(param_groups=[{"lr": 2.5e-4}, {"lr": 1.0}]))
    for skipped in (True, False, True, False):
        opt.steps_taken += 1
        opt.step_was_skipped = skipped
        progress.after_step(opt)
    assert capsys.readouterr().out.splitlines() == [
        "zerofit: step 2 | lr 0.00025 | loss scale 32768 | skipped 1",
        "zerofit: step 4 | lr 0.00025 | loss scale 32768 | skipped 2",
    ]
    assert progress_line(7, torch.tensor(1e-3), None, 0) == "zerofit: step 7 | lr 0.001"

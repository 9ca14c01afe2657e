"""`logging.steps_per_print`: the main process prints one line every N optimizer steps, only when set; with
`logging.throughput` (on by default) the line carries the window's rates, and trackers get them under `zerofit/`."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from engine_cases import SEQ, VOCAB, TinyLM, loss_fn

from zerofit import Accelerator
from zerofit.config import config_from_dict, load_config
from zerofit.config.schema import LoggingConfig, RunConfig
from zerofit.errors import ConfigError
from zerofit.frontend.progress import Progress, progress_line
from zerofit.frontend.throughput import Throughput, forward_sizes
from zerofit.plan.flops import mfu, train_flops_per_token


def _run(config: RunConfig, steps: int, *, clock=None, tracker_dir=None, accumulate: int = 1) -> Accelerator:
    """`steps` optimizer steps of TinyLM on batches of 2 x SEQ tokens, an evaluation forward before each; `clock`
    replaces the progress line's (one reading per window)."""
    acc = Accelerator(config=config, log_with="jsonl" if tracker_dir else None, project_dir=tracker_dir,
                      gradient_accumulation_steps=accumulate)
    if tracker_dir:
        acc.init_trackers("run")
    torch.manual_seed(0)
    model = TinyLM()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    if clock is not None:
        opt.progress.throughput.clock = clock
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    for _ in range(steps * accumulate):
        model.eval()
        with torch.no_grad():
            model(x)  # evaluation: not counted
        model.train()
        with acc.accumulate(model):
            acc.backward(loss_fn(model(x), x))
            opt.step()
            opt.zero_grad()
    return acc


def _lines(out: str) -> list[str]:
    setting, *steps = out.splitlines()  # prepare() says what runs first (frontend.banner)
    assert setting.startswith("zerofit: ZeRO-0")
    return steps


def test_a_line_every_n_steps_with_the_window_rates(capsys):
    # window 1 ends at step 2 after 1 s (step 2's forward: 2 samples), window 2 at step 4 after 4 s (steps 3-4)
    _run(RunConfig(logging=LoggingConfig(steps_per_print=2)), steps=5, clock=iter([10.0, 11.0, 15.0]).__next__)
    assert _lines(capsys.readouterr().out) == [
        f"zerofit: step 2 | lr 0.05 | {2 * SEQ} tokens/s | 2 samples/s",  # CPU: no MFU, no GPU peak
        f"zerofit: step 4 | lr 0.05 | {4 * SEQ / 4:.3g} tokens/s | 1 samples/s",
    ]


def test_the_line_values_go_to_the_trackers_under_zerofit(capsys, tmp_path):
    acc = _run(RunConfig(logging=LoggingConfig(steps_per_print=2)), steps=4, accumulate=2, tracker_dir=tmp_path,
               clock=iter([0.0, 2.0, 4.0]).__next__)
    acc.end_training()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # two micro-steps of 2 samples per optimizer step
    assert [{k: v for k, v in r.items() if k != "time"} for r in records] == [
        {"step": 2, "zerofit/tokens_per_s": 4 * SEQ / 2, "zerofit/samples_per_s": 2.0},
        {"step": 4, "zerofit/tokens_per_s": 8 * SEQ / 2, "zerofit/samples_per_s": 4.0},
    ]
    assert _lines(capsys.readouterr().out)[0] == f"zerofit: step 2 | lr 0.05 | {4 * SEQ / 2:g} tokens/s | 2 samples/s"


def test_throughput_false_keeps_step_and_lr_only(capsys, tmp_path):
    acc = _run(RunConfig(logging=LoggingConfig(steps_per_print=2, throughput=False)), steps=4, tracker_dir=tmp_path)
    assert acc._prepared.optimizers[0].progress.throughput is None
    acc.end_training()
    assert _lines(capsys.readouterr().out) == ["zerofit: step 2 | lr 0.05", "zerofit: step 4 | lr 0.05"]
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""


def test_the_switch_is_a_validated_key(tmp_path):
    path = tmp_path / "zerofit.yaml"
    path.write_text("logging:\n  steps_per_print: 10\n  throughput: false\n")
    assert load_config(str(path)).logging.throughput is False
    assert RunConfig().logging.throughput is True
    path.write_text("logging:\n  throughput: maybe\n")
    with pytest.raises(ConfigError, match=r"logging.throughput must be true or false \(got 'maybe'\)"):
        load_config(str(path))


def test_quiet_unless_the_config_sets_it(capsys):
    assert config_from_dict({"train_batch_size": 8}).logging.steps_per_print is None  # not DeepSpeed's 10
    assert config_from_dict({"steps_per_print": "inf"}).logging.steps_per_print is None  # Accelerate's "never"
    _run(RunConfig(), steps=3)
    assert "zerofit: step" not in capsys.readouterr().out


def test_only_the_main_process_prints():
    assert Progress.for_process(LoggingConfig(steps_per_print=10), is_main=False) is None
    assert Progress.for_process(LoggingConfig(), is_main=True) is None
    assert Progress.for_process(LoggingConfig(steps_per_print=10), is_main=True).every == 10


def _fake_optimizer(scaler):
    return SimpleNamespace(engine=SimpleNamespace(scaler=scaler), steps_taken=0, step_was_skipped=False,
                           optimizer=SimpleNamespace(param_groups=[{"lr": 2.5e-4}, {"lr": 1.0}]))


def test_fp16_lines_carry_the_loss_scale_and_the_skipped_steps(capsys):
    progress = Progress(2)
    opt = _fake_optimizer(SimpleNamespace(enabled=True, scale=32768.0))
    for skipped in (True, False, True, False):
        opt.steps_taken += 1
        opt.step_was_skipped = skipped
        progress.after_step(opt)
    assert capsys.readouterr().out.splitlines() == [
        "zerofit: step 2 | lr 0.00025 | loss scale 32768 | skipped 1",
        "zerofit: step 4 | lr 0.00025 | loss scale 32768 | skipped 2",
    ]
    assert progress_line(7, torch.tensor(1e-3), {}) == "zerofit: step 7 | lr 0.001"


def test_a_gpu_run_adds_mfu_and_the_memory_peak(capsys):
    """What a CUDA rank with a probed matmul rate shows, in fp16: every field (fake clock, peak and rate)."""
    throughput = Throughput(world=4, flops_per_token=train_flops_per_token(10**9, 10**9), peak_tflops=600.0,
                            memory_peak=lambda: 61 * 2**30 + 2**29, clock=iter([0.0, 2.0]).__next__)
    logged = []
    progress = Progress(1, throughput=throughput, log=lambda values, step: logged.append((step, values)))
    opt = _fake_optimizer(SimpleNamespace(enabled=True, scale=65536.0))
    for step in (1, 2):
        for _ in range(3):  # 3 micro-steps of 8 x 1024 tokens on this rank
            throughput.count((), {"input_ids": torch.zeros(8, 1024, dtype=torch.long)})
        opt.steps_taken = step
        progress.after_step(opt)
    local_tokens_per_s = 3 * 8 * 1024 / 2  # step 2's tokens on this rank, over 2 s
    utilisation = mfu(6e9, local_tokens_per_s, 600.0)
    assert utilisation == pytest.approx(6e9 * local_tokens_per_s / 600e12)
    assert logged == [
        (1, {"zerofit/gpu_peak_gib": 61.5, "zerofit/loss_scale": 65536.0, "zerofit/skipped_steps": 0}),
        (2, {"zerofit/tokens_per_s": 4 * local_tokens_per_s, "zerofit/samples_per_s": 4 * 3 * 8 / 2,
             "zerofit/mfu": pytest.approx(utilisation), "zerofit/gpu_peak_gib": 61.5,
             "zerofit/loss_scale": 65536.0, "zerofit/skipped_steps": 0}),
    ]
    assert capsys.readouterr().out.splitlines() == [
        "zerofit: step 1 | lr 0.00025 | GPU peak 61.5 GiB | loss scale 65536 | skipped 0",  # no window yet
        "zerofit: step 2 | lr 0.00025 | 49,152 tokens/s | 48 samples/s | MFU 12.3% | GPU peak 61.5 GiB | "
        "loss scale 65536 | skipped 0",
    ]


def test_unmeasured_gpu_and_inputs_without_token_ids():
    # CUDA without a cached matmul rate: the peak but no MFU; images: samples but no tokens (and so no MFU)
    throughput = Throughput(flops_per_token=60, peak_tflops=None, memory_peak=lambda: 2**30,
                            clock=iter([0.0, 1.0, 2.0, 3.0]).__next__)
    throughput.lap()
    throughput.count((torch.zeros(4, 7, dtype=torch.long),), {})
    window = throughput.lap()
    assert (window.samples_per_s, window.tokens_per_s, window.mfu) == (4.0, 28.0, None)
    throughput.count((), {"pixel_values": torch.zeros(3, 3, 8, 8)})
    throughput.count((), {"input_ids": torch.zeros(3, 5, dtype=torch.long)})
    window = throughput.lap()
    assert (window.samples_per_s, window.tokens_per_s) == (6.0, None)  # tokens of some forwards only: no rate
    window = throughput.lap()  # no training forward in the window
    assert (window.seconds, window.samples_per_s, window.tokens_per_s) == (1.0, None, None)
    assert forward_sizes((), {"inputs_embeds": torch.zeros(2, 9, 4)}) == (2, None)
    assert forward_sizes(("text",), {}) is None


def test_model_flops_rule():
    assert train_flops_per_token(10, 10) == 60  # 6 N
    assert train_flops_per_token(10, 2) == 44  # 4 N + 2 T: frozen weights pass a gradient on but need none
    with pytest.raises(ValueError, match="trainable parameters must be between 0 and the 10 parameters"):
        train_flops_per_token(10, 11)

"""transformers' Trainer on zerofit logs the losses of the library's own Trainer under DDP, dropout on.

With dropout, equal losses need two things besides the same weights: each rank must see the same
samples at every step ([Note: the same order as Accelerate] in zerofit.frontend.data.sampling), and the
global torch RNG must move the same way. Under Accelerate, each start of the train or eval
dataloader takes one draw from it ([Note: the draws of an epoch start] in zerofit.frontend.data.loaders).
tests/test_trainer.py turns dropout off, because it compares against one process with a doubled
batch. Here 2 gloo ranks train a tiny GPT-2 for 4 optimizer steps over 2 epochs (37 samples, so
the last batch is short), evaluating every 2 steps. It runs once as plain `Trainer`
(Accelerate's DDP) and once per ZeRO stage as zerofit's `Trainer`, and the logged losses must agree.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from trainer_cases import write_configs  # noqa: E402

from zerofit.testing.distributed import run_distributed  # noqa: E402

pytestmark = pytest.mark.slow

STAGES = {"stage0": {"zero": {"stage": 0}}, "stage3": {"zero": {"stage": 3, "param_persistence_threshold": 0}}}
LOSS_TOL = {"stage0": 1e-6,  # DDP's own arithmetic: bit-identical in practice
            "stage3": 2e-6}  # reduce-scatter sums in another order: a few fp32 ulps of a loss near 4.3


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        self.ids = torch.randint(0, 96, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(output_dir: str, *, zerofit: bool) -> list[tuple[str, float]]:
    from zerofit.integrations import transformers as ours

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96,
                                                                 n_positions=32))  # GPT-2's dropout 0.1
    args = transformers.TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=1.0,
        max_steps=4, logging_steps=1, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=3,
        save_strategy="no", report_to=[], use_cpu=True, learning_rate=1e-3, seed=42, disable_tqdm=True)
    cls = ours.Trainer if zerofit else transformers.Trainer
    trainer = cls(model=model, args=args, train_dataset=Tokens(37, 1), eval_dataset=Tokens(11, 2))
    trainer.train()
    return [(f"{key}@{entry['step']}", entry[key]) for entry in trainer.state.log_history
            for key in ("loss", "eval_loss") if key in entry]


def _runs(rank: int, world: int, root: str) -> dict:
    out = {}
    for name in STAGES:
        os.environ["ZEROFIT_CONFIG_FILE"] = os.path.join(root, f"{name}.json")
        out[name] = _train(os.path.join(root, name), zerofit=True)
    os.environ.pop("ZEROFIT_CONFIG_FILE")
    out["ddp"] = _train(os.path.join(root, "ddp"), zerofit=False)  # the library's own Trainer: Accelerate's DDP
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trainer_dropout"))
    write_configs(root, STAGES)
    return run_distributed(_runs, 2, root, timeout=300)[0]


@pytest.mark.parametrize("stage", STAGES)
def test_trainer_on_zerofit_logs_the_losses_of_trainer_under_ddp_with_dropout(runs, stage):
    got, want = runs[stage], runs["ddp"]
    assert [k for k, _ in got] == [k for k, _ in want] and len(want) == 6  # 4 train losses, 2 evaluations
    worst = max(abs(a - b) for (_, a), (_, b) in zip(got, want))
    assert worst < LOSS_TOL[stage], (got, want)

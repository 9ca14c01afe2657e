"""`load_best_model_at_end` under zerofit's Trainer: the model saved at the end is the best checkpoint's.

Trainer's own `_load_best_model` copies the best checkpoint into `model.load_state_dict`, which at ZeRO-3
writes into parameters whose storage is released (a segfault), and at ZeRO-2 in bf16 reaches only the
bf16 compute copies, so the fp32 masters that `save_model` writes stay the last step's. With
`greater_is_better` on eval_loss the best checkpoint is the first one (the loss falls), so "best" and
"last" differ and the test can tell which one was saved.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("accelerate")

import trainer_cases as tc  # noqa: E402

from zerofit.testing.distributed import run_distributed  # noqa: E402

pytestmark = pytest.mark.slow

CONFIGS = {
    "stage3_offload": ({"zero": {"stage": 3, "param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"},
                                 "offload_param": {"device": "cpu"}}}, False),
    "stage2_bf16": ({"zero": {"stage": 2}}, True),
}


def _train(rank: int, world: int, root: str) -> dict:
    import transformers

    from zerofit.integrations.transformers import Trainer

    out = {}
    for name, (_, bf16) in CONFIGS.items():
        os.environ["ZEROFIT_CONFIG_FILE"] = os.path.join(root, f"{name}.json")
        where = os.path.join(root, name)
        args = transformers.TrainingArguments(
            output_dir=where, per_device_train_batch_size=4, max_steps=4, eval_strategy="steps", eval_steps=2,
            save_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True,
            learning_rate=1e-2, report_to=[], use_cpu=True, seed=0, disable_tqdm=True, bf16=bf16)
        trainer = Trainer(model=tc.tiny_gpt2(), args=args, train_dataset=tc.token_data(),
                          eval_dataset=tc.token_data()[:8])
        trainer.train()
        trainer.save_model(os.path.join(where, "final"))
        out[name] = trainer.state.best_model_checkpoint
    os.environ.pop("ZEROFIT_CONFIG_FILE")
    return out


def test_the_model_saved_after_load_best_model_at_end_is_the_best_checkpoints(tmp_path):
    for name, (config, _) in CONFIGS.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
    best = run_distributed(_train, 2, str(tmp_path), timeout=300)[0]
    for name in CONFIGS:
        assert best[name].endswith("checkpoint-2"), (name, best[name])
        final = tc.saved_weights(str(tmp_path / name / "final"))
        chosen = tc.saved_weights(best[name])
        last = tc.saved_weights(str(tmp_path / name / "checkpoint-4"))
        assert max((final[k] - last[k]).abs().max().item() for k in final) > 0, name  # best != last here
        for key, tensor in chosen.items():
            torch.testing.assert_close(final[key], tensor, rtol=0, atol=0, msg=f"{name} {key}")


def _construct_saving_only_the_model(rank: int, world: int, root: str) -> str:
    import transformers

    from zerofit.errors import ConfigError
    from zerofit.integrations.transformers import Trainer

    args = transformers.TrainingArguments(
        output_dir=root, per_device_train_batch_size=4, max_steps=2, eval_strategy="steps", eval_steps=2,
        save_steps=2, save_only_model=True, load_best_model_at_end=True, report_to=[], use_cpu=True,
        disable_tqdm=True)
    with pytest.raises(ConfigError, match=r"save_only_model=True\) with load_best_model_at_end=True: .*drop "
                                          r"--save_only_model, or drop --load_best_model_at_end") as info:
        Trainer(model=tc.tiny_gpt2(), args=args, train_dataset=tc.token_data(), eval_dataset=tc.token_data()[:8])
    return str(info.value)


def test_save_only_model_with_load_best_model_at_end_is_refused_before_training(tmp_path):
    """Refused at `Trainer()`, as transformers does under DeepSpeed and FSDP: found after training, the
    error would skip the script's final save and lose the run."""
    message = run_distributed(_construct_saving_only_the_model, 1, str(tmp_path), timeout=120)[0]
    assert "zerofit_state/" in message, message
    assert not os.listdir(tmp_path), os.listdir(tmp_path)  # nothing trained, nothing written

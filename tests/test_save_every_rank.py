"""The save lines of PEFT's `examples/sequence_classification/peft_no_lora_accelerate.py`, run as the
script runs them: `save_pretrained(dir, state_dict=accelerator.get_state_dict(model))` on every rank,
`is_main_process` left at its default. Before #29 rank 1 got {} and died with
`KeyError: 'modules_to_save.default.weight'`. At stages 0-2 every rank holds the full dict and writes
the same file. At stage 3 an adapter's trainable weights are on every rank too ([Note: adapters
everywhere]), so the same line works there, and so does PEFT CorDA's `model.save_pretrained(dir)` on
every rank with a LoRA adapter (it crashed on meta placeholders before that note); `is_main_process`
works as well. Two gloo ranks, fp32, every case in one launch."""

from __future__ import annotations

import os

import pytest
import torch

from zerofit import Accelerator
from zerofit.config.schema import RunConfig, ZeroConfig
from zerofit.testing.distributed import run_distributed

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CASES = {"stage 0": 0, "stage 2": 2, "stage 3": 3, "stage 3, every rank writes": 3, "stage 3 lora": 3}


def _peft_classifier(lora: bool = False):
    torch.manual_seed(0)
    base = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, num_labels=2, pad_token_id=0))
    if lora:
        return peft.get_peft_model(base, peft.LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["c_attn"]))
    return peft.get_peft_model(base, peft.PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=4))


def _save_like_the_script(rank, world, root):
    from safetensors.torch import load_file

    out = {}
    for name, stage in CASES.items():
        model = _peft_classifier(lora="lora" in name)
        acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=stage, param_persistence_threshold=0)), cpu=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = acc.prepare(model, opt)
        ids = torch.randint(1, 64, (4, 8), generator=torch.Generator().manual_seed(rank))
        acc.backward(model(input_ids=ids, labels=torch.tensor([0, 1, 1, 0])).loss)
        opt.step()
        opt.zero_grad()
        acc.wait_for_everyone()
        unwrapped = acc.unwrap_model(model)
        mine = os.path.join(root, name.replace(" ", ""), f"rank{rank}")
        if name == "stage 3":  # the main process writes; the others pass through with placeholders
            unwrapped.save_pretrained(mine, state_dict=acc.get_state_dict(model), is_main_process=acc.is_main_process)
        elif "lora" in name:  # CorDA's line under Trainer: no state_dict, every rank
            unwrapped.save_pretrained(mine)
        else:  # exactly the example's line: every rank writes, is_main_process left True
            unwrapped.save_pretrained(mine, state_dict=acc.get_state_dict(model))
        acc.wait_for_everyone()
        path = os.path.join(mine, "adapter_model.safetensors")
        out[name] = load_file(path) if os.path.exists(path) else None
    return out


def test_every_rank_saves_the_peft_adapter_as_the_accelerate_example_does(tmp_path):
    ranks = run_distributed(_save_like_the_script, 2, str(tmp_path), timeout=120)
    for name in CASES:
        first = ranks[0][name]
        assert first is not None and any("score" in k for k in first), name  # the classifier head (modules_to_save)
        assert any(("lora" if "lora" in name else "prompt") in k for k in first), name
        if name != "stage 3":
            second = ranks[1][name]
            assert second is not None and second.keys() == first.keys(), name
            for key, value in first.items():
                torch.testing.assert_close(second[key], value, rtol=0, atol=0, msg=f"{name} {key}")
        else:
            assert ranks[1][name] is None, name  # rank 1 wrote nothing (is_main_process=False)

"""The save lines of PEFT's `examples/sequence_classification/peft_no_lora_accelerate.py`, run as the
script runs them: `save_pretrained(dir, state_dict=accelerator.get_state_dict(model))` on every rank,
`is_main_process` left at its default. Before #29 rank 1 got {} and died with
`KeyError: 'modules_to_save.default.weight'`. At stages 0-2 every rank holds the full dict and writes
the same file. At stage 3 an adapter's trainable weights are on every rank too ([Note: adapters
everywhere]), so the same line works there, and so does PEFT CorDA's `model.save_pretrained(dir)` on
every rank with a LoRA adapter (it crashed on meta placeholders before that note); `is_main_process`
works as well. The example's own defaults (p-tuning, whose prompt encoder is most of a small model) and
prompt tuning at ZeRO-3, with and without parameter offload, write on every rank the files a one-process
run writes. Two gloo ranks, fp32, every case of a test in one launch."""

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


# The example's own defaults (`--peft_type p_tuning --num_virtual_tokens 20 --encoder_hidden_size 128`): on this
# small base the prompt encoder is over half the elements, so a rule on the trainable share alone gave rank 1
# meta placeholders for the classifier head and it died writing them ("Cannot copy out of meta tensor").
EXAMPLE_CASES = {"p_tuning": False, "p_tuning, parameters offloaded": True, "prompt_tuning, parameters offloaded": True}
GLOBAL_BATCH = 4


def _example_model(peft_type: str):
    torch.manual_seed(0)
    base = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        vocab_size=64, n_positions=48, n_embd=16, n_layer=2, n_head=2, num_labels=2, pad_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0))  # each process draws its own
    if peft_type == "p_tuning":
        config = peft.PromptEncoderConfig(task_type="SEQ_CLS", num_virtual_tokens=20, encoder_hidden_size=128)
    else:
        config = peft.PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=20)
    return peft.get_peft_model(base, config)


def _example_batch(rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's rows of one global batch (all of it for one process)."""
    ids = torch.randint(1, 64, (GLOBAL_BATCH, 8), generator=torch.Generator().manual_seed(5))
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return {"input_ids": ids[rows], "labels": torch.tensor([0, 1, 1, 0])[rows]}


def _saved_files(directory: str) -> dict[str, bytes]:
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


def _example_save_at_zero3(rank, world, root):
    from zerofit.config.schema import OffloadConfig

    out = {}
    for name, offload in EXAMPLE_CASES.items():
        peft_type = name.split(",")[0]
        zero = ZeroConfig(stage=3, param_persistence_threshold=0,
                          offload_param=OffloadConfig(device="cpu" if offload else "none"))
        acc = Accelerator(config=RunConfig(zero=zero), cpu=True)
        model = _example_model(peft_type)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)  # SGD: the two batch splits' rounding stays ~1e-9
        model, opt = acc.prepare(model, opt)
        acc.backward(model(**_example_batch(rank, world)).loss)
        opt.step()
        opt.zero_grad()
        acc.wait_for_everyone()
        unwrapped = acc.unwrap_model(model)
        folder = os.path.join(root, name.replace(" ", "").replace(",", "-"))
        # the example's line, every rank into the same folder; then with is_main_process, as Accelerate documents
        unwrapped.save_pretrained(os.path.join(folder, "example"), state_dict=acc.get_state_dict(model))
        unwrapped.save_pretrained(os.path.join(folder, "main"), state_dict=acc.get_state_dict(model),
                                  is_main_process=acc.is_main_process)
        acc.wait_for_everyone()
        if rank == 0:
            out[name] = {kind: _saved_files(os.path.join(folder, kind)) for kind in ("example", "main")}
    if rank == 0:  # the reference: one process, plain PyTorch, the whole batch, PEFT's own save
        for peft_type in {n.split(",")[0] for n in EXAMPLE_CASES}:
            model = _example_model(peft_type)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            model(**_example_batch(0, 1)).loss.backward()
            opt.step()
            model.save_pretrained(os.path.join(root, f"one-process-{peft_type}"))
            out[f"one process {peft_type}"] = _saved_files(os.path.join(root, f"one-process-{peft_type}"))
    return out


def test_the_examples_save_at_zero3_on_every_rank_writes_the_one_process_files(tmp_path):
    from safetensors.torch import load

    got = run_distributed(_example_save_at_zero3, 2, str(tmp_path), timeout=180)[0]
    for name in EXAMPLE_CASES:
        want = got[f"one process {name.split(',')[0]}"]
        for kind in ("example", "main"):
            files = got[name][kind]
            assert files.keys() == want.keys() == {"README.md", "adapter_config.json", "adapter_model.safetensors"}
            assert files["adapter_config.json"] == want["adapter_config.json"], (name, kind)
            saved, reference = load(files["adapter_model.safetensors"]), load(want["adapter_model.safetensors"])
            assert saved.keys() == reference.keys() and {"prompt_embeddings"} < saved.keys(), (name, kind)
            assert any("score" in k for k in saved), (name, kind)  # the classifier head (modules_to_save)
            for key, value in reference.items():
                torch.testing.assert_close(saved[key], value, rtol=0, atol=1e-6, msg=f"{name} {kind} {key}")
        # both ranks wrote the example's file, the same bytes as the main process alone writes
        assert got[name]["example"]["adapter_model.safetensors"] == got[name]["main"]["adapter_model.safetensors"]

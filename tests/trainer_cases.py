"""What the Trainer tests train: a tiny GPT-2, token data, a word-level tokenizer, and one run of each kind.

`run(kind, ...)` trains a fresh model with transformers' / TRL's own class (`zerofit=False`, real
Accelerate) or zerofit's drop-in (`zerofit=True`, under the zerofit config `ZEROFIT_CONFIG_FILE` names)
and returns the per-step losses, the final trainable weights and what it saved.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

VOCAB = 61
SEQ = 12
SAMPLES = 40
WORDS = [f"w{i}" for i in range(40)]


@dataclass(frozen=True)
class Run:
    kind: str = "trainer"  # "trainer", "sft", "dpo"
    lora: bool = False
    per_device: int = 4
    accumulation: int = 2
    steps: int = 4
    save_steps: int = 2
    resume_from: str | None = None
    evaluate: bool = False  # evaluate() before train(), and every 2 steps during it (Trainer only)
    prompt: bool = False  # PEFT prompt tuning (Trainer only): its adapter is saved by a forward pass
    optim: str = "adamw_torch"  # TrainingArguments(optim=...)
    max_grad_norm: float = 1.0  # 0: no clipping, so zerofit's offloaded updates start during backward


def tiny_gpt2():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                                     eos_token_id=2, pad_token_id=0)
    config._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(config)


def with_lora(model):
    import peft

    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
                                                       target_modules=["c_attn"], fan_in_fan_out=True))
    with torch.no_grad():  # LoRA's B starts at zero: A would get no gradient in the first step
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "[UNK]": 3} | {w: 4 + i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]",
                                   unk_token="[UNK]")


def token_data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": t, "labels": t} for t in torch.randint(4, VOCAB, (SAMPLES, SEQ), generator=g)]


def _sentence(g: torch.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())


def text_data(kind: str):
    import datasets

    g = torch.Generator().manual_seed(4)
    if kind == "sft":
        return datasets.Dataset.from_dict({"text": [_sentence(g, 6 + i % 5) for i in range(SAMPLES)]})
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(SAMPLES):
        rows["prompt"].append(_sentence(g, 3 + i % 3))
        rows["chosen"].append(_sentence(g, 2 + i % 2))
        rows["rejected"].append(_sentence(g, 3))
    return datasets.Dataset.from_dict(rows)


def run(run: Run, output_dir: str, *, zerofit: bool) -> dict:
    """Train `run` into `output_dir` and return {"losses", "weights", "saved"} (see the module doc)."""
    model = tiny_gpt2()
    common = dict(output_dir=output_dir, per_device_train_batch_size=run.per_device,
                  gradient_accumulation_steps=run.accumulation, max_steps=run.steps, logging_steps=1,
                  save_steps=run.save_steps, report_to=[], use_cpu=True, learning_rate=1e-3,
                  max_grad_norm=run.max_grad_norm, seed=0, disable_tqdm=True, lr_scheduler_type="linear",
                  warmup_steps=1, bf16=False, optim=run.optim)
    if run.kind == "trainer":
        import transformers

        from zerofit.integrations import transformers as ours

        model = with_lora(model) if run.lora else model
        if run.prompt:
            import peft

            torch.manual_seed(1)
            model = peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
        cls = ours.Trainer if zerofit else transformers.Trainer
        if run.evaluate:
            common.update(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=3)
        trainer = cls(model=model, args=transformers.TrainingArguments(**common), train_dataset=token_data(),
                      eval_dataset=token_data()[:12] if run.evaluate else None)
    else:
        import trl

        from zerofit.integrations import trl as ours_trl

        if run.kind == "sft":
            cls = ours_trl.SFTTrainer if zerofit else trl.SFTTrainer
            args = trl.SFTConfig(**common, max_length=SEQ, packing=False, dataset_num_proc=None)
            extra = {}
        else:
            import copy

            cls = ours_trl.DPOTrainer if zerofit else trl.DPOTrainer
            args = trl.DPOConfig(**common, max_length=SEQ, dataset_num_proc=None)
            extra = {"ref_model": copy.deepcopy(model)}
        peft_config = None
        if run.lora:
            import peft

            torch.manual_seed(1)
            peft_config = peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
                                          target_modules=["c_attn"], fan_in_fan_out=True)
        trainer = cls(model=model, args=args, train_dataset=text_data(run.kind), processing_class=tokenizer(),
                      peft_config=peft_config, **extra)
    before = trainer.evaluate()["eval_loss"] if run.evaluate else None
    trainer.train(resume_from_checkpoint=run.resume_from)
    final = os.path.join(output_dir, "final")
    trainer.save_model(final)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    evals = [before] + [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e] if run.evaluate else []
    engines = trainer.accelerator._prepared.trained_engines() if zerofit else []
    early = sum(e.times.host_steps_in_backward + e.times.gpu_steps_in_backward for e in engines)
    return {"losses": losses, "evals": evals, "saved": final, "rank": int(os.environ.get("RANK", "0")),
            "early": early}


def saved_weights(directory: str) -> dict[str, torch.Tensor]:
    """The tensors a save wrote (an adapter's, or the full model's), by name."""
    from safetensors.torch import load_file

    for name in ("adapter_model.safetensors", "model.safetensors"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return load_file(path)
    raise FileNotFoundError(f"no safetensors weights in {directory}: {sorted(os.listdir(directory))}")


def write_configs(root: str, configs: dict[str, dict]) -> None:
    """Each zerofit config as `root/NAME.json`, for `ZEROFIT_CONFIG_FILE` to name in the ranks."""
    for name, config in configs.items():
        with open(os.path.join(root, f"{name}.json"), "w") as f:
            json.dump(config, f)

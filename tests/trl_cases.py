"""What the TRL trainer tests train: each TRL trainer zerofit exports, on a tiny GPT-2 saved to disk.

`run(kind, root, zerofit=..., per_device=...)` trains `kind` ("grpo", "rloo", "reward", "kto",
"distillation") with TRL's own class (`zerofit=False`, real Accelerate) or zerofit's export
(`zerofit=True`, under the config `ZEROFIT_CONFIG_FILE` names) for 2 steps and returns the logged
losses and gradient norms and the folder `save_model` wrote. The models load from `root/policy`
(written by `write_models`): GRPO and RLOO build their reference model from that path.
"""

from __future__ import annotations

import os

import torch
import trainer_cases as tc

SAMPLING = ("grpo", "rloo", "distillation")
"""Trainers that sample completions: each rank samples with its own seed (seed + process index), so their
runs compare against TRL's own class on the same 2 ranks, not against one process."""
KINDS = ("grpo", "rloo", "reward", "kto", "distillation")


def write_models(root: str) -> None:
    tc.tiny_gpt2().save_pretrained(os.path.join(root, "policy"))
    tc.tokenizer().save_pretrained(os.path.join(root, "policy"))
    torch.manual_seed(5)
    teacher = tc.tiny_gpt2()
    with torch.no_grad():  # another model than the student's, so distillation has something to learn
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    teacher.save_pretrained(os.path.join(root, "teacher"))


def count_w1(completions, **kwargs) -> list[float]:
    """A rule-based reward (no reward model): how many words of the completion start with "w1"."""
    return [float(sum(w.startswith("w1") for w in c.split())) for c in completions]


def _data(kind: str):
    import datasets

    g = torch.Generator().manual_seed(4)
    n = 32
    if kind in ("grpo", "rloo", "distillation"):
        return datasets.Dataset.from_dict({"prompt": [tc._sentence(g, 2 + i % 3) for i in range(n)]})
    if kind == "reward":
        return datasets.Dataset.from_dict({"chosen": [tc._sentence(g, 4 + i % 3) for i in range(n)],
                                           "rejected": [tc._sentence(g, 3 + i % 2) for i in range(n)]})
    return datasets.Dataset.from_dict({"prompt": [tc._sentence(g, 2 + i % 3) for i in range(n)],
                                       "completion": [tc._sentence(g, 2 + i % 2) for i in range(n)],
                                       "label": [bool(i % 3) for i in range(n)]})


def run(kind: str, root: str, out: str, *, zerofit: bool, per_device: int) -> dict:
    import transformers
    import trl

    from zerofit.integrations import trl as ours

    policy = os.path.join(root, "policy")
    common = dict(output_dir=out, per_device_train_batch_size=per_device, max_steps=2, logging_steps=1,
                  save_strategy="no", report_to=[], use_cpu=True, learning_rate=1e-3, max_grad_norm=1.0, seed=0,
                  disable_tqdm=True, bf16=False)
    tokenizer = tc.tokenizer()
    name = {"grpo": "GRPOTrainer", "rloo": "RLOOTrainer", "reward": "RewardTrainer", "kto": "KTOTrainer",
            "distillation": "DistillationTrainer"}[kind]
    cls = getattr(ours if zerofit else trl, name)
    model = transformers.AutoModelForCausalLM.from_pretrained(policy)
    if kind in ("grpo", "rloo"):
        config = (trl.GRPOConfig if kind == "grpo" else trl.RLOOConfig)(
            **common, num_generations=4, max_completion_length=4, beta=0.1)
        tokenizer.padding_side = "left"
        trainer = cls(model=model, reward_funcs=[count_w1], args=config, train_dataset=_data(kind),
                      processing_class=tokenizer)
    elif kind == "distillation":
        tokenizer.padding_side = "left"
        teacher = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, "teacher"))
        config = trl.DistillationConfig(**common, max_completion_length=4)
        trainer = cls(model=model, teacher_model=teacher, args=config, train_dataset=_data(kind),
                      processing_class=tokenizer)
    elif kind == "reward":
        torch.manual_seed(2)
        model = transformers.GPT2ForSequenceClassification.from_pretrained(policy, num_labels=1)
        trainer = cls(model=model, args=trl.RewardConfig(**common, max_length=tc.SEQ), train_dataset=_data(kind),
                      processing_class=tokenizer)
    else:
        ref = transformers.AutoModelForCausalLM.from_pretrained(policy)
        trainer = cls(model=model, ref_model=ref, args=trl.KTOConfig(**common, max_length=tc.SEQ),
                      train_dataset=_data(kind), processing_class=tokenizer)
    trainer.train()
    final = os.path.join(out, "final")
    trainer.save_model(final)
    logged = [e for e in trainer.state.log_history if "loss" in e]
    return {"losses": [e["loss"] for e in logged], "grad_norms": [e["grad_norm"] for e in logged], "saved": final}

"""Which entries of a PEFT model's state dict its `save_pretrained` writes, found without gathering a weight.

[Note: an adapter's save gathers the adapter]
`PeftModel.save_pretrained(dir, state_dict=sd)` writes a small part of `sd`: per adapter, the keys PEFT's
`get_peft_model_state_dict` picks (the adapter's own weights, `modules_to_save` copies, and the embedding
layers where they were targeted or resized). Trainer's `save_model` hands it the model's whole state dict,
so under ZeRO-3 every save (each `save_steps` checkpoint too) would gather the frozen base to the main
process's host memory - 140 GB and minutes for a 70 B base to write a 100 MB LoRA adapter - and at ZeRO
0-2 copy it to the host on every process. Here PEFT's own selection runs first on stand-ins: one tensor on
the meta device per parameter or buffer (shapes and dtypes, no values, no gather, tied names sharing one),
and the keys whose stand-ins come back are the ones to gather (`Accelerator.get_state_dict(model,
keys=...)`); `save_pretrained` then picks the same keys again from the real values. The selection is
trusted only where it is a pure choice of entries: if PEFT computes a value (VB-LoRA's top-k, a
prompt encoder's output) or raises on a stand-in, or the model is not a PEFT model, the answer is None and
the whole state dict is gathered as before. Prompt learning computes its adapter with a forward pass
([Note: saving runs a forward] in zerofit.integrations.transformers): it is never asked here.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn


def is_peft_model(model: nn.Module) -> bool:
    """A PEFT model (`peft.PeftModel` or a subclass: adapters on a base model, `peft_config` naming them), as
    transformers' Trainer tells one; not a transformers model with adapters loaded into it (`load_adapter`)."""
    configs = getattr(model, "peft_config", None)
    return isinstance(configs, dict) and bool(configs) and callable(getattr(model, "get_base_model", None))


def saved_adapter_keys(model: nn.Module) -> set[str] | None:
    """The state-dict keys `model.save_pretrained(dir, state_dict=...)` writes when `model` is a PEFT model
    whose selection is a choice of entries (see the Note); None: gather everything."""
    if not is_peft_model(model):
        return None
    configs = model.peft_config
    if any(getattr(c, "is_prompt_learning", False) for c in configs.values()):
        return None
    try:
        from peft.utils import get_peft_model_state_dict
    except ImportError:
        return None
    live = model.state_dict(keep_vars=True)  # the tensors themselves: no gather under ZeRO-3
    stand_in: dict[int, torch.Tensor] = {}
    stand_ins = {k: stand_in.setdefault(id(t), torch.empty(t.shape, dtype=t.dtype, device="meta"))
                 for k, t in live.items()}
    key_of: dict[int, list[str]] = {}
    for k, t in stand_ins.items():
        key_of.setdefault(id(t), []).append(k)
    keys: set[str] = set()
    with warnings.catch_warnings(), contextlib.suppress(Exception):
        warnings.simplefilter("ignore")  # the real save says them (an embedding layer saved, ...)
        for name in configs:  # `save_pretrained` saves every adapter by default
            picked = get_peft_model_state_dict(model, state_dict=dict(stand_ins), adapter_name=name,
                                               save_embedding_layers="auto")
            if any(id(t) not in key_of for t in picked.values()):
                return None  # a computed value: only the real state dict gives it
            keys.update(k for t in picked.values() for k in key_of[id(t)])
        return keys
    return None

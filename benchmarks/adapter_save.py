"""What saving a LoRA adapter costs from a prepared model: `get_state_dict` of the whole model against the adapter's
keys alone ([Note: an adapter's save gathers the adapter] in zerofit.integrations.adapter_keys).

    zerofit launch --cpu --num_processes 2 --config_file CONFIG benchmarks/adapter_save.py [--layers 16] [--hidden 1024]

A Llama built from a config (random weights; the save's cost does not depend on the values), LoRA r=8 on
q_proj/v_proj, one training step, then each way timed on the main process between two barriers; prints one
JSON line: seconds, entries and MB of real (non-meta) tensors the main process holds for each. The adapter's
keys are found anew each time (`saved_adapter_keys`), as Trainer's save_model does. Then `save_state` with and
without `exclude_frozen_parameters` (what zerofit's Trainer sets for a PEFT model): seconds and MB on disk.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import peft
import torch
import transformers

from zerofit import Accelerator
from zerofit.integrations.adapter_keys import saved_adapter_keys

parser = argparse.ArgumentParser()
parser.add_argument("--layers", type=int, default=16)
parser.add_argument("--hidden", type=int, default=1024)
args = parser.parse_args()

torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                  num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=16)
model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                            peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
accelerator = Accelerator()
model, optimizer = accelerator.prepare(model, optimizer)
ids = torch.randint(0, config.vocab_size, (2, 32))
accelerator.backward(model(input_ids=ids, labels=ids).loss)
optimizer.step()
optimizer.zero_grad()
result = {"params_M": round(sum(p.numel() for p in accelerator.unwrap_model(model).parameters()) / 1e6, 1),
          "processes": accelerator.num_processes}
for way in ("adapter", "whole", "adapter again"):
    accelerator.wait_for_everyone()
    start = time.perf_counter()
    keys = saved_adapter_keys(accelerator.unwrap_model(model)) if way != "whole" else None
    state = accelerator.get_state_dict(model, keys=keys)
    accelerator.wait_for_everyone()
    seconds = time.perf_counter() - start
    held = sum(t.numel() * t.element_size() for t in state.values() if t.device.type != "meta")
    result[way] = {"s": round(seconds, 3), "entries": len(state), "MB": round(held / 2**20, 1)}
    del state
with tempfile.TemporaryDirectory() as root:  # a node-local folder: one machine here
    root = accelerator.gather_for_metrics([root])[0] if accelerator.num_processes > 1 else root
    for way, exclude in (("checkpoint", False), ("checkpoint without the base", True)):
        accelerator.wait_for_everyone()
        start = time.perf_counter()
        path = accelerator.save_state(os.path.join(root, way.replace(" ", "_")), exclude_frozen_parameters=exclude)
        seconds = time.perf_counter() - start
        size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
        result[way] = {"s": round(seconds, 3), "MB": round(size / 2**20, 1)}
    accelerator.wait_for_everyone()
if accelerator.is_main_process:
    print(json.dumps(result), flush=True)

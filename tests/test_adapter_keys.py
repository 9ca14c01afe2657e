"""`saved_adapter_keys`: the entries PEFT's save_pretrained writes, found on stand-ins without a gather.

One process, no engine: the keys must be exactly those whose values PEFT picks from the real state dict
([Note: an adapter's save gathers the adapter]); where PEFT computes a value or is not in charge the
answer is None (gather everything). tests/test_engine_peft.py checks the same at ZeRO-3 on 2 ranks,
with the gathers counted.
"""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from zerofit.integrations.adapter_keys import saved_adapter_keys  # noqa: E402


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=31, n_positions=16, n_embd=8, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def picked_from_the_real_state_dict(model) -> set[str]:
    """The keys whose tensors PEFT's selection returns from the real state dict, every adapter."""
    live = model.state_dict()
    key_of = {}
    for k, t in live.items():
        key_of.setdefault(id(t), []).append(k)
    keys = set()
    for name in model.peft_config:
        picked = peft.get_peft_model_state_dict(model, state_dict=live, adapter_name=name)
        keys.update(k for t in picked.values() for k in key_of[id(t)])
    return keys


@pytest.mark.parametrize("config", [
    peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True),
    peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, modules_to_save=["ln_f"]),
    peft.LoraConfig(r=2, target_modules=["c_attn", "wte"], fan_in_fan_out=True),  # an embedding: saved whole
    peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, bias="all"),
    peft.IA3Config(target_modules=["c_attn", "mlp.c_proj"], feedforward_modules=["mlp.c_proj"], fan_in_fan_out=True),
], ids=["lora", "modules_to_save", "embedding_targeted", "bias_all", "ia3"])
def test_the_keys_are_those_peft_picks_from_the_real_state_dict(config):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(gpt2(), config)
        want = picked_from_the_real_state_dict(model)
    got = saved_adapter_keys(model)
    assert got == want and got
    assert len(got) < len(model.state_dict())


def test_every_adapter_of_the_model_counts():
    model = peft.get_peft_model(gpt2(), peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["c_fc"], fan_in_fan_out=True))
    got = saved_adapter_keys(model)
    assert got == picked_from_the_real_state_dict(model)
    assert any(".second." in k for k in got) and any(".default." in k for k in got)


def test_none_where_everything_must_be_gathered():
    assert saved_adapter_keys(gpt2()) is None  # not a PEFT model: save_pretrained writes it all
    prompt = peft.get_peft_model(gpt2(), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    assert saved_adapter_keys(prompt) is None  # its adapter is a forward's output


def test_a_value_peft_computes_means_none():
    """VB-LoRA's top-k saving builds new tensors from the logits: stand-ins cannot give them."""
    if not hasattr(peft, "VBLoRAConfig"):
        pytest.skip("this PEFT has no VB-LoRA")
    config = peft.VBLoRAConfig(r=2, target_modules=["c_attn"], num_vectors=4, vector_length=4,
                               save_only_topk_weights=True, fan_in_fan_out=True)
    model = peft.get_peft_model(gpt2(), config)
    assert saved_adapter_keys(model) is None

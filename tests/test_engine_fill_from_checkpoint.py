"""A model built on the meta device and marked with `load_at_prepare` is filled from its checkpoint at
`prepare()`, one unit at a time (zerofit.engine.weight_source): after prepare and after one training step
it is bit for bit the model `from_pretrained` + prepare gives, at every stage and with optimizer offload.
Two gloo ranks, every case in one launch; the errors need no process group."""

from __future__ import annotations

import warnings

import pytest
import torch

from zerofit import Accelerator
from zerofit.config.schema import OffloadConfig, PrecisionConfig, RunConfig, ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.engine.weight_source import CheckpointFiles, mark
from zerofit.errors import CheckpointError, EngineError
from zerofit.testing.distributed import run_distributed
from zerofit.utils import empty_from_pretrained, init_empty_weights, load_at_prepare

transformers = pytest.importorskip("transformers")

ZERO = {"stage0": ZeroConfig(stage=0), "stage1": ZeroConfig(stage=1), "stage2": ZeroConfig(stage=2),
        "stage3": ZeroConfig(stage=3, param_persistence_threshold=0),
        "stage3-offload": ZeroConfig(stage=3, param_persistence_threshold=0,
                                     offload_optimizer=OffloadConfig(device="cpu"))}
# checkpoint -> (the dtype the model is built in, mixed precision, the ZeRO settings it runs under)
CASES = {"llama-bf16-sharded": (torch.bfloat16, "bf16", list(ZERO)),
         "llama-fp32": (torch.float32, "no", ["stage1", "stage3"]),
         "gpt2-tied-fp32": (torch.float32, "no", list(ZERO)),
         "gpt2-tied-fp32-as-bf16": (torch.bfloat16, "bf16", ["stage2", "stage3-offload"])}


def _llama_config():
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=100)


def _gpt2_config():  # no dropout: the two models must draw nothing in forward
    return transformers.GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(_llama_config())
    gpt2 = transformers.GPT2LMHeadModel(_gpt2_config())
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    paths = {name: str(root / name) for name in CASES}
    llama.to(torch.bfloat16).save_pretrained(paths["llama-bf16-sharded"], max_shard_size="20KB")
    llama.float().save_pretrained(paths["llama-fp32"])
    gpt2.save_pretrained(paths["gpt2-tied-fp32"])
    paths["gpt2-tied-fp32-as-bf16"] = paths["gpt2-tied-fp32"]
    paths["llama-base"] = str(root / "llama-base")
    llama.model.save_pretrained(paths["llama-base"])  # a LlamaModel: no lm_head, no "model." prefix
    return paths


def _prepare_and_step(model, zero, mixed, world, rank):
    """The full weights after prepare, the loss of one step on this rank's half of the batch, the full weights
    after the step (the weights: {} off the main process)."""
    acc = Accelerator(config=RunConfig(zero=zero, precision=PrecisionConfig(mixed_precision=mixed)), cpu=True)
    model.train()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    before = acc.get_state_dict(model)
    ids = torch.randint(0, 100, (2 * world, 8), generator=torch.Generator().manual_seed(5))[2 * rank:2 * rank + 2]
    loss = model(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    return before, loss.item(), acc.get_state_dict(model)


def _fill_every_case(rank, world, paths):
    out = {}
    for case, (dtype, mixed, zeros) in CASES.items():
        for zero in zeros:
            reference = transformers.AutoModelForCausalLM.from_pretrained(paths[case], dtype=dtype)
            empty = empty_from_pretrained(transformers.AutoModelForCausalLM, paths[case], dtype=dtype)
            assert all(p.is_meta for p in empty.parameters())
            out[case, zero] = (_prepare_and_step(reference, ZERO[zero], mixed, world, rank),
                               _prepare_and_step(empty, ZERO[zero], mixed, world, rank),
                               empty.lm_head.weight is empty.base_model.get_input_embeddings().weight)
    # a base model's checkpoint into a *ForCausalLM: the head is new, initialised alike on both ranks
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(_llama_config())
    load_at_prepare(model, paths["llama-base"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = Accelerator(config=RunConfig(zero=ZERO["stage3"]), cpu=True)
        model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    head = acc._prepared.engines[id(model)].named_full_tensors("param")["lm_head.weight"]  # every rank, whole
    out["base"] = ([str(w.message) for w in caught if "newly initialised" in str(w.message)], head,
                   acc.get_state_dict(model))
    return out


@pytest.fixture(scope="module")
def launched(checkpoints):
    return run_distributed(_fill_every_case, 2, checkpoints, timeout=180)


def test_filled_at_prepare_equals_from_pretrained_at_every_stage(launched):
    for case, (_, _, zeros) in CASES.items():
        for zero in zeros:
            (ref_before, ref_loss, ref_after), (before, loss, after), tied = launched[0][case, zero]
            assert ref_before and before.keys() == ref_before.keys() and after.keys() == ref_after.keys(), (case, zero)
            for name, value in ref_before.items():
                assert before[name].dtype == value.dtype, (case, zero, name)
                assert torch.equal(before[name], value), (case, zero, name)  # bit for bit
            for name, value in ref_after.items():
                assert torch.equal(after[name], value), (case, zero, name)
            for r in launched:
                assert r[case, zero][0][1] == r[case, zero][1][1], (case, zero, "loss")
            assert tied == case.startswith("gpt2"), case  # the tie is one parameter, filled once
            other = launched[1][case, zero][1][0]  # get_state_dict off the main process
            assert other.keys() == before.keys(), (case, zero)
            if all(v.device.type == "meta" for v in other.values()):  # stage 3: placeholders
                assert zero.startswith("stage3"), (case, zero)
            else:  # stages 0-2: the full dict on every rank
                for name, value in before.items():
                    assert torch.equal(other[name], value), (case, zero, name)


def test_a_base_checkpoint_fills_a_causal_lm_and_its_new_head_is_warned(launched, checkpoints):
    (warned, head, state), (warned_1, head_1, _) = launched[0]["base"], launched[1]["base"]
    assert warned == [f"zerofit: 1 tensor(s) of the model are not in the checkpoint {checkpoints['llama-base']!r} "
                      "and were newly initialised: lm_head.weight. You should probably train the model before using "
                      "it (a new head is expected when fine-tuning a base checkpoint)"]
    assert warned_1 == []  # the main process only
    assert torch.equal(head, head_1) and torch.equal(state["lm_head.weight"], head)  # alike on every rank
    assert abs(head.std().item() - _llama_config().initializer_range) < 0.005  # the model's own _init_weights
    base = transformers.LlamaModel.from_pretrained(checkpoints["llama-base"]).state_dict()
    for name, value in base.items():
        assert torch.equal(state[f"model.{name}"], value), name


def _llama_meta():
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(_llama_config())


def test_load_at_prepare_errors_name_the_problem_and_the_fix(checkpoints, tmp_path):
    with pytest.raises(CheckpointError, match=r"load_at_prepare: checkpoint directory '.*nowhere' does not exist.*"
                                              r"save_pretrained"):
        load_at_prepare(_llama_meta(), tmp_path / "nowhere")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no safetensors weights in '.*bin': looked for "
                                              r"model.safetensors.index.json .* and model.safetensors, and it holds "
                                              r"\['pytorch_model.bin'\].*save_pretrained"):
        load_at_prepare(_llama_meta(), tmp_path / "bin")
    with pytest.raises(ValueError, match="no tensors on the meta device.*from_pretrained.*torch.device"):
        load_at_prepare(transformers.LlamaForCausalLM(_llama_config()), checkpoints["llama-fp32"])
    with pytest.raises(CheckpointError, match="empty_from_pretrained: checkpoint directory"):
        empty_from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "nowhere")
    wider = _llama_config()
    wider.vocab_size = 120
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(wider)
    with pytest.raises(EngineError, match=r"checkpoint tensor 'model.embed_tokens.weight' in .*model.safetensors has "
                                          r"shape \[100, 32\] but the model's 'model.embed_tokens.weight' has shape "
                                          r"\[120, 32\]: build the model from the checkpoint's own config"):
        load_at_prepare(model, checkpoints["llama-fp32"])
    with torch.device("meta"):
        other = transformers.GPT2Model(_gpt2_config())
    with pytest.raises(EngineError, match=r"none of the \d+ meta tensors of GPT2Model is in the checkpoint "
                                          r"'.*llama-fp32' \(e.g. 'wte.weight'; .*\): pass load_at_prepare the "
                                          r"checkpoint of this model"):
        load_at_prepare(other, checkpoints["llama-fp32"])


def test_the_engine_checks_again_what_changed_after_marking(checkpoints):
    model = load_at_prepare(_llama_meta(), checkpoints["llama-bf16-sharded"])
    with torch.device("meta"):
        model.lm_head = torch.nn.Linear(32, 120, bias=False)  # e.g. a resized vocabulary
    with pytest.raises(EngineError, match=r"'lm_head.weight' in .*model-0000\d-of-0000\d.safetensors has shape "
                                          r"\[100, 32\] but the model's 'lm_head.weight' has shape \[120, 32\]"):
        ZeroEngine(model, device=torch.device("cpu"))
    model = load_at_prepare(_llama_meta(), checkpoints["llama-fp32"])
    model.to_empty(device="cpu")
    with pytest.raises(EngineError, match="marked by load_at_prepare.*no meta tensors left"):
        ZeroEngine(model, device=torch.device("cpu"))


def test_a_causal_lm_checkpoint_fills_its_base_model_and_says_what_it_left(checkpoints):
    with torch.device("meta"):
        model = transformers.LlamaModel(_llama_config())
    load_at_prepare(model, checkpoints["llama-fp32"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ZeroEngine(model, device=torch.device("cpu"))
    reference = transformers.LlamaForCausalLM.from_pretrained(checkpoints["llama-fp32"])
    for name, value in reference.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert [str(w.message) for w in caught if "not in the model" in str(w.message)] == [
        f"zerofit: 1 tensor(s) of the checkpoint {checkpoints['llama-fp32']!r} are not in the model and were not "
        "read: lm_head.weight (expected when loading a checkpoint with a head into a model without it)"]


def test_transformers_meta_device_map_is_input_load_at_prepare_takes(checkpoints):
    try:  # transformers 5.17 builds the empty model itself; 5.25 refuses device_map="meta"
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["gpt2-tied-fp32"], device_map="meta")
    except ValueError:
        pytest.skip("this transformers refuses device_map='meta'")
    load_at_prepare(model, checkpoints["gpt2-tied-fp32"])
    ZeroEngine(model, device=torch.device("cpu"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["gpt2-tied-fp32"])
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


class _RecordedReads(CheckpointFiles):
    def __init__(self, directory):
        super().__init__(directory)
        self.keys_read = []

    def read(self, key):
        self.keys_read.append(key)
        return super().read(key)


def test_each_unit_reads_only_its_own_tensors_once_as_it_is_laid_out(checkpoints):
    model = _llama_meta()
    files = _RecordedReads(checkpoints["llama-bf16-sharded"])
    mark(model, files)
    engine = ZeroEngine(model, zero=ZeroConfig(stage=3, param_persistence_threshold=0), device=torch.device("cpu"))
    unit_of = {name: i for i, u in enumerate(engine.units) for g in u.groups for name in g.names}
    order = [unit_of[key] for key in files.keys_read]
    assert order == sorted(order) and len(set(order)) == len(engine.units) > 2  # unit after unit, each read once
    assert sorted(files.keys_read) == sorted(set(files.keys_read)) == sorted(files.shapes)  # every tensor, once

"""Generation inside training at stage 3 (#38): no-grad forwards keep the units they gather.

One launch of two gloo ranks loops every configuration (parameters on the device or offloaded to the
CPU; keeping on, off, or under a budget that holds part of the model). Checked, per configuration:
- greedy `generate()` of a tiny Llama gives the single-process model's tokens;
- all-gathers counted from the engine's collective trace: with keeping on each unit is gathered once per
  generate call and a second call gathers nothing; with it off (budget 0) each unit is gathered once per
  generated token, and the next unit is already gathering when a unit's forward begins (prefetch); a
  budget of the root and one layer keeps those two only; a `gathered_parameters` block that rewrites the
  weights leaves no kept copy with its writes behind;
- training is exact around generation: backward / eval / step / generate / eval ... gives the losses and fp32 masters
  of the same loop without generation, bit for bit, and the tokens and eval logits after each step equal
  those of a run that streams every unit (so a kept copy never outlives a step); after each step,
  generation and evaluation together gather each unit once.
"""

from __future__ import annotations

import pytest
import torch

from zerofit.config.schema import OffloadConfig, ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.engine.kept import gathered_bytes
from zerofit.engine.unit import ParamState
from zerofit.errors import EngineError
from zerofit.testing.distributed import run_distributed

transformers = pytest.importorskip("transformers")

NEW_TOKENS, LAYERS, STEPS = 8, 3, 3


def _model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return transformers.LlamaForCausalLM(config)


def _prompt(rank: int) -> torch.Tensor:
    return torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(7 + rank))


def _generate(model, prompt):
    out = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=0)
    return out[:, prompt.shape[1]:]


def _engine(offload: bool, budget: int | None = None, lr: float = 1e-2):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    zero = ZeroConfig(stage=3, param_persistence_threshold=0,
                      offload_param=OffloadConfig(device="cpu" if offload else "none"))
    engine = ZeroEngine(model, opt, zero=zero)
    engine.keep_gathered_budget = budget
    return model, opt, engine


def _gathers(engine) -> dict[str, int]:
    counts: dict[str, int] = {}
    for label, _sizes, _dtypes in engine.comm.trace:
        if label.startswith("all_gather:"):
            name = label.split(":", 1)[1]
            counts[name] = counts.get(name, 0) + 1
    return counts


def _prefetched_while_streaming(engine, model, prompt) -> list[bool]:
    """For each layer but the last, at each of its forwards after the first: was the next layer gathering?"""
    layers = list(model.model.layers)
    unit_of = {id(u.module): u for u in engine.units}
    following = [unit_of[id(layer)] for layer in layers[1:]]
    seen = []
    handles = [layer.register_forward_pre_hook(
        lambda *_a, nxt=nxt: seen.append(nxt.state is not ParamState.RELEASED))
        for layer, nxt in zip(layers[:-1], following)]
    _generate(model, prompt)
    for h in handles:
        h.remove()
    return seen[len(layers) - 1:]  # the first forward has no record to prefetch along


def _generation_counts(rank, offload):
    prompt = _prompt(rank)
    out = {"reference": _generate(_model().eval(), prompt)}
    model, _opt, engine = _engine(offload)
    names = [u.name for u in engine.units if u.sharded]
    engine.comm.trace = []
    out["kept_tokens"] = _generate(model, prompt)
    out["kept_first"] = _gathers(engine)
    engine.comm.trace = []
    out["kept_again_tokens"] = _generate(model, prompt)
    out["kept_second"] = _gathers(engine)
    with engine.full_state.held(), torch.no_grad():  # a block that rewrites full weights (PEFT's merge)...
        for p in model.parameters():
            p.zero_()
    out["after_held_tokens"] = _generate(model, prompt)  # ...whose writes are dropped with the kept copies
    engine.keep_gathered_budget = 0
    engine.comm.trace = []
    out["streamed_tokens"] = _generate(model, prompt)
    out["streamed"] = _gathers(engine)
    out["prefetched"] = _prefetched_while_streaming(engine, model, prompt)
    root, first = engine.units[0], next(u for u in engine.units if u.module is model.model.layers[0])
    engine.keep_gathered_budget = gathered_bytes(root) + gathered_bytes(first)
    engine.comm.trace = []
    out["partial_tokens"] = _generate(model, prompt)
    out["partial"] = _gathers(engine)
    out["partial_kept"] = sorted(u.name for u in engine.stage3.kept.units)
    out["partial_expected"] = sorted([root.name, first.name])
    out["names"] = names
    return out


def _train(rank, offload, *, generate: bool, budget: int | None):
    model, opt, engine = _engine(offload, budget)
    prompt = _prompt(rank)
    losses, tokens, logits, gathers = [], [], [], []
    for step in range(STEPS):
        ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if generate:
            with torch.no_grad():  # between backward and step: kept units that the step must not leave stale
                logits.append(model(input_ids=prompt).logits)
        engine.step()
        losses.append(loss.detach())
        if generate:
            engine.comm.trace = []
            tokens.append(_generate(model, prompt))
            with torch.no_grad():  # an evaluation pass between steps, on the kept units
                logits.append(model(input_ids=prompt).logits)
            gathers.append(_gathers(engine))
            engine.comm.trace = None
    return {"losses": torch.stack(losses), "masters": engine.named_full_tensors("master"), "tokens": tokens,
            "logits": logits, "gathers": gathers, "names": [u.name for u in engine.units if u.sharded]}


def _trainer_budgets(root: str) -> dict[str, int | None]:
    """The engine budget a zerofit Trainer's prepared model gets, with TRL's `ds3_gather_for_generation` set
    each way and absent (transformers' own TrainingArguments)."""
    import dataclasses
    import json
    import os

    from zerofit.integrations.transformers import Trainer

    @dataclasses.dataclass
    class GenerationArgs(transformers.TrainingArguments):
        ds3_gather_for_generation: bool = True

    path = os.path.join(root, "stage3.json")
    with open(path, "w") as f:
        json.dump({"zero": {"stage": 3, "param_persistence_threshold": 0}}, f)
    os.environ["ZEROFIT_CONFIG_FILE"] = path
    out = {}
    for name, args in (("gather", GenerationArgs(output_dir=root, use_cpu=True, report_to=[])),
                       ("stream", GenerationArgs(output_dir=root, use_cpu=True, report_to=[],
                                                 ds3_gather_for_generation=False)),
                       ("plain", transformers.TrainingArguments(output_dir=root, use_cpu=True, report_to=[]))):
        trainer = Trainer(model=_model(), args=args)
        model, _opt = trainer.accelerator.prepare(trainer.model, torch.optim.AdamW(trainer.model.parameters()))
        out[name] = trainer.accelerator._prepared.engines[id(model)].keep_gathered_budget
    os.environ.pop("ZEROFIT_CONFIG_FILE")
    return out


def _ranks(rank, world, root):
    results = {"trainer": _trainer_budgets(root)}
    for offload in (False, True):
        results[offload] = {
            "counts": _generation_counts(rank, offload),
            "with": _train(rank, offload, generate=True, budget=None),
            "streamed": _train(rank, offload, generate=True, budget=0),
            "without": _train(rank, offload, generate=False, budget=None),
        }
    frozen = ZeroEngine(_model(), None, zero=ZeroConfig(stage=3, param_persistence_threshold=0))
    results["frozen_budget"] = frozen.keep_gathered_budget  # a reference model has no release point: streams
    _, _, engine = _engine(False)
    for bad in (-1, 1.5, True):
        with pytest.raises(EngineError, match="keep_gathered_budget must be a number of bytes >= 0 or None"):
            engine.keep_gathered_budget = bad
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_ranks, 2, str(tmp_path_factory.mktemp("generation")))


def test_trl_ds3_gather_for_generation_false_streams_the_trainers_model(ranks):
    for r in ranks:
        assert r["trainer"] == {"gather": None, "stream": 0, "plain": None}
        assert r["frozen_budget"] == 0


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload_param"])
def test_generate_gathers_each_unit_once_when_kept_and_per_token_when_streamed(ranks, offload):
    for r in ranks:
        c = r[offload]["counts"]
        for key in ("kept_tokens", "kept_again_tokens", "after_held_tokens", "streamed_tokens", "partial_tokens"):
            assert torch.equal(c[key], c["reference"]), key
        names = c["names"]
        assert len(names) == LAYERS + 1
        assert c["kept_first"] == {n: 1 for n in names}
        assert c["kept_second"] == {}
        assert c["streamed"] == {n: NEW_TOKENS for n in names}
        assert c["prefetched"] and all(c["prefetched"])
        kept = set(c["partial_expected"])
        assert c["partial_kept"] == c["partial_expected"]
        assert c["partial"] == {n: 1 if n in kept else NEW_TOKENS for n in names}


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload_param"])
def test_training_around_generation_is_exact(ranks, offload):
    for r in ranks:
        run = r[offload]
        assert torch.equal(run["with"]["losses"], run["without"]["losses"])
        assert torch.equal(run["streamed"]["losses"], run["without"]["losses"])
        for name, value in run["without"]["masters"].items():
            assert torch.equal(run["with"]["masters"][name], value), name
        for a, b in zip(run["with"]["tokens"], run["streamed"]["tokens"]):
            assert torch.equal(a, b)
        for a, b in zip(run["with"]["logits"], run["streamed"]["logits"]):
            assert torch.equal(a, b)
        # after each step every unit is gathered again, once, for generation and evaluation together
        for gathered in run["with"]["gathers"]:
            assert gathered == {n: 1 for n in run["with"]["names"]}
        for gathered in run["streamed"]["gathers"]:
            assert gathered == {n: NEW_TOKENS + 1 for n in run["streamed"]["names"]}
        assert len(run["with"]["logits"]) == 2 * STEPS
        # the weights moved between steps, so the generations differ: a stale copy would have shown
        assert not all(torch.equal(a, b) for a, b in zip(run["with"]["logits"][1:], run["with"]["logits"][:-1]))

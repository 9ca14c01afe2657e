"""Under ZeRO-3, `model.state_dict()` and `save_pretrained` without `state_dict=` give the full, trained
weights on the main process (DeepSpeed writes empty weight files in this case) and meta placeholders of
the same shapes on the others, so one host copy exists, not one per rank (#29); see [Note: full state
dict under stage 3] in zerofit.engine.full_state. Two gloo ranks, fp32, so the comparisons are exact."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerofit import Accelerator
from zerofit.config import config_from_dict
from zerofit.config.schema import RunConfig, ZeroConfig
from zerofit.testing.distributed import run_distributed

transformers = pytest.importorskip("transformers")


def _trained(freeze_base: bool = False, rows: int = 8, batch_size: int = 2):
    """A tiny GPT-2 trained at stage 3 over `rows` rows (also tests/test_one_rank_alone.py's model)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16,
                                                                   n_layer=2, n_head=2))
    if freeze_base:  # PEFT-style: only the last block and the final norm train
        for name, p in model.named_parameters():
            p.requires_grad = name.startswith(("transformer.h.1.", "transformer.ln_f."))
    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=3, param_persistence_threshold=0)), cpu=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 50, (rows, 8), generator=torch.Generator().manual_seed(3))
    model, opt, dl = acc.prepare(model, opt, DataLoader(TensorDataset(ids), batch_size=batch_size))
    for (batch,) in dl:
        acc.backward(model(input_ids=batch, labels=batch).loss)
        opt.step()
        opt.zero_grad()
    return acc, model


def _save_and_read(rank, world, out, freeze_base):
    acc, model = _trained(freeze_base)
    reference = acc.get_state_dict(model)  # meta placeholders off the main process
    state = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    acc.unwrap_model(model).save_pretrained(out, is_main_process=acc.is_main_process, save_function=acc.save)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    adapter = {k: v for k, v in model.state_dict().items() if k in trainable}  # what PEFT-style saving keeps
    loss = model(input_ids=torch.arange(8)[None], labels=torch.arange(8)[None]).loss.item()  # still trains
    return reference, state, shapes, adapter, loss


@pytest.mark.parametrize("freeze_base", [False, True])
def test_state_dict_and_save_pretrained_hold_the_full_trained_weights(tmp_path, freeze_base):
    out = str(tmp_path / "saved")
    (ref, state0, shapes0, adapter0, loss0), (_, state1, shapes1, adapter1, loss1) = run_distributed(
        _save_and_read, 2, out, freeze_base, timeout=180)
    full = {k: tuple(v.shape) for k, v in ref.items()}
    assert {k: s for k, s in shapes0.items() if k in full} == full and shapes1 == shapes0
    for name, value in ref.items():
        torch.testing.assert_close(state0[name], value, rtol=0, atol=0)
        assert state1[name].device.type == "meta" and state1[name].dtype == value.dtype  # no copy off rank 0
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).state_dict()
    for name, value in ref.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)
    assert adapter0 and adapter0.keys() == adapter1.keys()  # a key filter works on every rank
    for name, value in adapter0.items():
        torch.testing.assert_close(value, ref[name], rtol=0, atol=0)
        assert adapter1[name].device.type == "meta"
    assert loss0 == pytest.approx(loss1)


def _submodule_state_dicts(rank, world):
    """Each case: (module path, kwargs of state_dict) -> the dict every rank gets, plus the engine's
    unit states before and after (the gathers must release what they gathered)."""
    acc, model = _trained(freeze_base=False)
    engine = acc._prepared.engines[id(model)]
    states_before = [u.state for u in engine.units]
    full = model.state_dict()  # the root gathers (tested above): the reference
    cases = {"transformer.h.0": {}, "lm_head": {}, "transformer.wte": {}, "transformer": {},
             "transformer.h.1.mlp": {"prefix": "x."}, "transformer.ln_f": {}}
    got, gathers = {}, {}
    for path, kw in cases.items():
        before = engine.comm.calls
        got[path] = model.get_submodule(path).state_dict(**kw)
        gathers[path] = engine.comm.calls - before
    states_after = [u.state for u in engine.units]
    block = next(u for u in engine.units if u.module is model.transformer.h[0])
    # One all-gather per sharded group of the units the module holds parameters of, no more.
    assert gathers["transformer.h.0"] == sum(g.placement.shard_params for g in block.groups) > 0
    assert gathers["transformer"] == sum(g.placement.shard_params for u in engine.units for g in u.groups)
    params = dict(model.transformer.h[0].named_parameters())
    own = all(v is params[k] for k, v in model.transformer.h[0].state_dict(keep_vars=True).items() if k in params)
    loss = model(input_ids=torch.arange(8)[None], labels=torch.arange(8)[None]).loss.item()  # still trains
    return full, got, cases, states_before == states_after, own, loss


def test_a_submodules_state_dict_gathers_too():
    """#25: `model.transformer.h[0].state_dict()` or `model.lm_head.state_dict()` at stage 3 gave the
    local (empty) views while `model.state_dict()` gathered."""
    ranks = run_distributed(_submodule_state_dicts, 2, timeout=180)
    plain = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16,
                                                                  n_layer=2, n_head=2))
    for rank, (full, got, cases, released_again, _, _) in enumerate(ranks):
        assert released_again, rank
        for path, kw in cases.items():
            prefix = kw.get("prefix", "")
            expected = {prefix + k: full[f"{path}.{k}"] for k in plain.get_submodule(path).state_dict()}
            assert list(got[path]) == list(expected), (rank, path)
            for name, value in expected.items():
                if rank == 0:
                    torch.testing.assert_close(got[path][name], value, rtol=0, atol=0, msg=f"{path} {name}")
                else:  # placeholders off the main process (buffers are the module's own)
                    assert got[path][name].shape == value.shape, (path, name)
    assert ranks[0][4] and ranks[1][4]  # keep_vars=True still gives the parameters themselves, no gather
    assert ranks[0][5] == pytest.approx(ranks[1][5])


def _one_rank_first_without_a_store(rank: int, world: int) -> tuple[list[str], bool]:
    import os
    import time

    from zerofit.distributed import arrival

    # No store to reach (a file:// rendezvous, say): the ranks agree to leave the check off ([Note: checked
    # places] in zerofit.distributed.arrival), and a gather left waiting only says why it may hang.
    del os.environ["MASTER_ADDR"]
    arrival.SILENT_AFTER_S = 0.5
    acc = Accelerator(config=config_from_dict({"zero": {"stage": 3, "param_persistence_threshold": 0}}), cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if rank == 1:
        time.sleep(3.0)  # late, not absent: the gather still completes
    full = model.state_dict()
    assert full["0.weight"].shape == (8, 8)  # the values on rank 0, a placeholder elsewhere
    return list(arrival.notices), arrival.current() is None


def test_with_the_check_off_a_state_dict_call_left_waiting_names_the_usual_mistake():
    """`if accelerator.is_main_process: model.save_pretrained(...)` at ZeRO-3 where the ranks share no store."""
    (notices0, off0), (notices1, off1) = run_distributed(_one_rank_first_without_a_store, 2, timeout=60)
    assert off0 and off1
    assert len(notices0) == 1 and notices1 == []
    assert "every rank must call them" in notices0[0] and "is_main_process=accelerator.is_main_process" in notices0[0]

"""`model.load_state_dict()` after `prepare()` loads into the engine at every stage (zerofit.engine.full_state_load).

Before: under bf16 the next step put the old weights back (the fp32 masters were never written), and
under stage 3 the copy went into released parameter storage (a segmentation fault). 2 gloo ranks, a
tiny GPT-2 with tied embeddings, stages 0-3 with and without offload, fp32 and bf16: after loading a
state dict, what the engine holds (its masters, `get_state_dict`) equals it exactly, the forward
equals an unsharded model that loaded it, and an SGD step from it equals the unsharded one.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from zerofit import Accelerator  # noqa: E402
from zerofit.config import config_from_dict  # noqa: E402
from zerofit.testing.distributed import run_distributed  # noqa: E402

CASES = [(0, "no", "none"), (1, "bf16", "none"), (2, "no", "cpu"), (2, "bf16", "none"), (3, "no", "none"),
         (3, "bf16", "cpu")]
TOL = {"no": 1e-6, "bf16": 5e-2}
"""fp32: summation order only. bf16: the engine computes in bf16 weights, the reference in fp32 with autocast
(weights of N(0, 1) make activations of ~5); unloaded weights would be off by O(1) everywhere."""
LOGITS_TOL = {"no": 1e-5, "bf16": 0.5}


def _model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=53, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _target() -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    out = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in _model().state_dict().items()}
    out["lm_head.weight"] = out["transformer.wte.weight"]  # tied: one tensor under both names, as state_dict() gives it
    return out


def _ids() -> torch.Tensor:
    return torch.randint(0, 53, (4, 8), generator=torch.Generator().manual_seed(3))


def _reference(mixed: str) -> dict:
    model = _model()
    model.load_state_dict(_target())
    ids = _ids()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed == "bf16"):
        logits = model(input_ids=ids).logits.float()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return {"logits": logits.detach(), "stepped": {k: v.clone() for k, v in model.state_dict().items()}}


def _run(rank: int, world: int) -> dict:
    out = {}
    ids = _ids()
    for stage, mixed, offload in CASES:
        config = config_from_dict({"zero": {"stage": stage, "param_persistence_threshold": 0,
                                            "offload_optimizer": {"device": offload},
                                            "offload_param": {"device": offload if stage == 3 else "none"}},
                                   "precision": {"mixed_precision": mixed}})
        acc = Accelerator(config=config, cpu=True)
        model = _model()
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        result = model.load_state_dict(_target())
        loaded = acc.get_state_dict(model)
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        rows = slice(rank * 2, rank * 2 + 2)  # the same global batch as the reference, split over the ranks
        acc.backward(model(input_ids=ids[rows], labels=ids[rows]).loss)
        opt.step()
        out[(stage, mixed, offload)] = {"missing": list(result.missing_keys),
                                        "unexpected": list(result.unexpected_keys), "loaded": loaded,
                                        "logits": logits, "stepped": acc.get_state_dict(model)}
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_run, 2, timeout=300)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}-{c[1]}-offload_{c[2]}")
def test_a_loaded_state_dict_is_what_the_engine_holds_and_trains_from(ranks, case):
    got = ranks[0][case]
    want = _reference(case[1])
    target = _target()
    assert got["missing"] == [] and got["unexpected"] == []
    for k, v in target.items():  # the masters hold the loaded values exactly (fp32, whatever the compute dtype)
        assert torch.equal(got["loaded"][k].float(), v.float()), k
    assert (got["logits"] - want["logits"]).abs().max().item() < LOGITS_TOL[case[1]]
    for k, v in want["stepped"].items():
        assert (got["stepped"][k].float() - v.float()).abs().max().item() < TOL[case[1]], k


def _errors(rank: int, world: int) -> dict:
    acc = Accelerator(config=config_from_dict({"zero": {"stage": 3, "param_persistence_threshold": 0}}), cpu=True)
    model = _model()
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    bad = _target()
    bad["transformer.h.0.attn.c_attn.weight"] = torch.zeros(3, 3)
    try:
        model.load_state_dict(bad)
        size_error = None
    except RuntimeError as e:
        size_error = str(e)
    partial = {k: v for k, v in _target().items() if not k.startswith("transformer.h.1.")}
    result = model.load_state_dict(partial, strict=False)
    head = model.transformer.h[1].mlp.load_state_dict({k[len("transformer.h.1.mlp."):]: v for k, v in _target().items()
                                                       if k.startswith("transformer.h.1.mlp.")})
    return {"size_error": size_error, "missing": sorted(result.missing_keys), "head": list(head.missing_keys),
            "loaded": acc.get_state_dict(model)}


def test_shape_errors_missing_keys_and_a_submodules_load_behave_as_in_torch():
    got = run_distributed(_errors, 2, timeout=120)[0]
    assert "size mismatch for transformer.h.0.attn.c_attn.weight" in got["size_error"]
    assert got["missing"] and all(k.startswith("transformer.h.1.") for k in got["missing"])
    assert got["head"] == []
    target = _target()
    for k in ("transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_fc.weight"):  # whole load, then submodule
        assert torch.equal(got["loaded"][k], target[k]), k

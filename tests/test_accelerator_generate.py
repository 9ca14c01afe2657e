"""ZeRO-3 evaluation and `generate()` on 2 CPU ranks whose prompts and lengths differ: no hang, same tokens.

Rank 0 stops after a few new tokens, rank 1 runs many more; each parameter gather under stage 3 needs
both ranks, so this hangs (and times out) unless transformers runs its synced-GPU loop.
"""

from __future__ import annotations

import pytest
import torch

from zerofit import Accelerator
from zerofit.config.schema import RunConfig, ZeroConfig
from zerofit.testing.distributed import run_distributed

transformers = pytest.importorskip("transformers")


def _tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=61, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=60, pad_token_id=60)
    return transformers.GPT2LMHeadModel(config).eval()


PROMPTS = {0: ([5, 9, 3], 4), 1: ([7, 2, 8, 1, 4, 6], 14)}  # rank -> (prompt, new tokens)


def generate_on_stage3(rank: int, world: int):
    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=3, param_persistence_threshold=0)))
    model = acc.prepare(_tiny_gpt2())
    engine = acc._prepared.engines[id(model)]
    assert all(u.sharded for u in engine.units)  # really sharded: a lone rank could not run a forward
    prompt, new = PROMPTS[rank]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = acc.unwrap_model(model).generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        # evaluation with a different batch per rank right after, on the same sharded model
        loss = model(input_ids=out, labels=out).loss
    reference = _tiny_gpt2()
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        want_loss = reference(input_ids=want, labels=want).loss
    return out.tolist(), want.tolist(), loss.item(), want_loss.item(), model.config.n_embd


def test_generate_under_zero3_with_different_lengths_per_rank_matches_unsharded_generation():
    results = run_distributed(generate_on_stage3, 2, timeout=120)
    for rank, (got, want, loss, want_loss, n_embd) in enumerate(results):
        prompt, new = PROMPTS[rank]
        assert len(got[0]) == len(prompt) + new
        assert got == want
        assert loss == pytest.approx(want_loss, abs=1e-5)
        assert n_embd == 32  # model.config and friends are untouched: the model is not wrapped


def _tiny_bart():
    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=61, d_model=16, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, max_position_embeddings=64, pad_token_id=1,
                                     bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    return transformers.BartForConditionalGeneration(config)


def train_then_generate_an_encoder_decoder(rank: int, world: int):
    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=3, param_persistence_threshold=0)))
    net = _tiny_bart()
    model, opt = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    engine = acc._prepared.engines[id(acc.unwrap_model(model))]
    ids = torch.tensor([[0, 5 + rank, 9, 3, 2]])
    acc.backward(model(input_ids=ids, labels=ids).loss)  # a training step: the gather schedule is learned
    opt.step()
    opt.zero_grad()
    model.eval()
    engine.comm.trace = []
    with torch.no_grad():
        acc.unwrap_model(model).generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1)
    encoder_units = [u.name for u in engine.units if ".encoder." in f".{u.name}."]
    gathers = [label for label, *_ in engine.comm.trace if label.startswith("all_gather:")]
    return encoder_units, gathers


def test_generate_gathers_an_encoder_decoders_encoder_once_not_per_token():
    # [Note: one gather order]: evaluation and generation gather on demand; standing in for the encoder in
    # every decoder-only forward of generate() would gather the whole encoder once per new token.
    for encoder_units, gathers in run_distributed(train_then_generate_an_encoder_decoder, 2, timeout=120):
        assert encoder_units
        counts = {name: gathers.count(f"all_gather:{name}") for name in encoder_units}
        # Once for the encoder's forward; the first unit once more, prefetched along the training order
        # by generate()'s first decoder step (later steps prefetch along generation's own order).
        assert counts == {name: 2 if i == 0 else 1 for i, name in enumerate(encoder_units)}, (counts, gathers)

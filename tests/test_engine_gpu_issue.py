"""The GPU-stepped stream's fixed work per chunk on the issuing thread (issue #39), on the CPU standing in for the
GPU: a steady step walks no piece's state to find the run's homes ([Note: verified homes] in
zerofit.engine.offload.gpu_homes), copies the scalar state of a chunk's pieces with one kernel, and a checkpoint
loaded into an engine that has stepped already is what its next step streams (the kept homes are re-checked)."""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import pytest
import torch

from zerofit.engine import ZeroEngine
from zerofit.engine.offload.gpu_homes import RunHomes
from zerofit.engine.offload.gpu_issue import interleaved
from zerofit.engine.offload.stored_homes import gap_index
from zerofit.errors import EngineError
from zerofit.testing.distributed import run_distributed
from zerofit.testing.models import gpu_stepped_engine, top_level_aten_ops


def _engine(state: str) -> ZeroEngine:
    """Every block a unit of two runs (weights with decay, biases and norms without: Trainer's groups)."""
    return gpu_stepped_engine(4, 8, state, lr=1e-2)


def _train(engine: ZeroEngine, seed: int, steps: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        engine.backward(engine.model(torch.randn(4, 8, generator=g)).square().mean())
        engine.step()


def _ops_of_a_steady_step(state: str) -> tuple[int, dict[str, int]]:
    """(chunks of one step, top-level aten ops of the issuing thread in that step after two steps)."""
    engine = _engine(state)
    _train(engine, 1, 2)
    gpu = engine.offload.gpu
    gpu.settle(state=True)
    chunks = sum(len(run.chunks) for runs in gpu._runs.values() for run in runs)
    engine.backward(engine.model(torch.randn(4, 8)).square().mean())
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)  # the issuing thread's ops too
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=config) as prof:
        engine.step()
        gpu.settle(state=True)

    return chunks, dict(top_level_aten_ops(prof.events()))


@pytest.mark.parametrize("state", ["fp32", "8bit"])
def test_a_steady_step_walks_no_state_and_copies_each_chunks_scalars_once(state):
    chunks, ops = _ops_of_a_steady_step(state)
    # finding a run's homes views storage (`home_of`: `set_`) on every walk; a steady step walks none
    assert ops.get("aten::set_", 0) == 0, ops
    # the scalar state (Adam's `step`) of a chunk's pieces: one stack or one clone per chunk, not one per piece
    assert ops.get("aten::stack", 0) + ops.get("aten::clone", 0) <= chunks, (chunks, ops)


def _reload_rank(rank: int, world: int, directory: str, state: str):
    """Train 2 steps, save, train 2 (a); load the checkpoint into that same engine, train the same 2 (b): the
    masters and the pieces' state of (a) and (b)."""
    from zerofit.checkpoint.sharded import load_state, save_state

    def snapshot(engine):
        masters = {k: v.clone() for k, v in engine.named_full_tensors("master").items()}
        opt = engine.optimizer
        return masters, [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[t].items()}
                         for pg in opt.param_groups for t in pg["params"]]

    engine = _engine(state)
    _train(engine, 1, 2)
    save_state(directory + "/ck", engine)
    _train(engine, 2, 2)
    first = snapshot(engine)
    load_state(directory + "/ck", engine)  # new state entries for every piece: the kept homes no longer hold
    _train(engine, 2, 2)
    return first, snapshot(engine)


@pytest.mark.parametrize("state", ["fp32", "8bit"])
def test_a_checkpoint_loaded_into_a_stepped_engine_is_what_its_next_step_streams(tmp_path, state):
    (masters_a, state_a), (masters_b, state_b) = run_distributed(_reload_rank, 1, str(tmp_path), state)[0]
    assert masters_a.keys() == masters_b.keys()
    assert all(torch.equal(masters_a[k], masters_b[k]) for k in masters_a)
    assert len(state_a) == len(state_b)
    for a, b in zip(state_a, state_b):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_kept_homes_are_dropped_when_a_piece_gets_a_new_entry():
    engine = _engine("fp32")
    _train(engine, 1, 2)
    gpu = engine.offload.gpu
    gpu.settle(state=True)
    homes: RunHomes = gpu._homes
    g = next(g for g in gpu.groups)
    run = gpu._runs[id(g)][0]
    kept = homes.of(g, run)
    assert homes.of(g, run) is kept  # nothing moved: the kept answer
    piece = run.pieces[0]
    engine.optimizer.state[piece.master] = {k: v.clone() for k, v in engine.optimizer.state[piece.master].items()}
    again = homes.of(g, run)  # a pageable copy, as a checkpoint load leaves it: moved into the home again
    assert again is not kept
    home = again.homes["exp_avg"]
    view = engine.optimizer.state[piece.master]["exp_avg"]
    assert view.untyped_storage().data_ptr() == home.untyped_storage().data_ptr()


def test_groups_kept_on_the_device_and_offloaded_ones_are_issued_merged_by_their_elements():
    """[Note: resident chunks]: each kind in forward order, a group where the middle of its elements falls in its
    kind's total (ties: the device's first)."""
    def groups(*sizes):
        return [SimpleNamespace(master=torch.empty(n), name=f"{kind}{i}") for i, (kind, n) in enumerate(sizes)]

    gs = groups(("d", 4), ("d", 4), ("d", 4), ("d", 4), ("o", 8), ("o", 8))
    order = interleaved(gs, {id(g) for g in gs if g.name[0] == "d"})
    assert [g.name for g in order] == ["d0", "o4", "d1", "d2", "o5", "d3"]
    gs = groups(("d", 10), ("o", 1), ("o", 1), ("o", 1))
    assert [g.name for g in interleaved(gs, {id(gs[0])})] == ["o1", "d0", "o2", "o3"]
    gs = groups(("o", 3), ("o", 5))  # one kind: forward order
    assert interleaved(gs, set()) == gs


@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_device_groups_step_in_place_in_a_slot_of_their_own(state):
    """Narrow state kept on the device joins the stream but not its ring: its chunks use a slot of their own and
    step the master where it lies (no master buffer), the ring's slots carry only offloaded chunks, and the values
    are those of every group offloaded (the parity with state on the device: tests/test_engine_state_dtype.py)."""
    half, whole = gpu_stepped_engine(4, 8, state, lr=1e-2, ratio=0.5), gpu_stepped_engine(4, 8, state, lr=1e-2)
    gpu = half.offload.gpu
    kept = {id(g) for g in gpu.groups if not g.placement.offloaded}
    assert kept and len(kept) < len(gpu.groups)
    assert gpu._order == interleaved(gpu.groups, kept) != gpu.groups
    for engine in (half, whole):
        _train(engine, 5, 3)
    names = {name for name, _ in gpu._home_slot._buffers}
    assert "master" not in names and {"exp_avg", "exp_avg_sq"} <= names
    largest_offloaded = max(r.end - r.start for g in gpu.groups if id(g) not in kept for r in gpu._runs[id(g)])
    assert all(s.capacity == largest_offloaded for s in gpu._slots)
    assert whole.offload.gpu._home_slot is None
    a, b = dict(half.model.named_parameters()), dict(whole.model.named_parameters())
    half.settle()
    whole.settle()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_gap_positions_are_those_no_piece_covers():
    """`gap_index` (the padding zeroed before a chunk's narrow state is encoded) from the pieces' bounds equals the
    positions a chunk-long mask of the pieces leaves uncovered (how it was found before: ~7 ms a 64 M chunk)."""
    def masked(pieces, start, length):
        covered = torch.zeros(length, dtype=torch.bool)
        for p in pieces:
            lo, hi = max(start, p.offset), min(start + length, p.offset + p.length)
            if lo < hi:
                covered[lo - start:hi - start] = True
        return None if bool(covered.all()) else (~covered).nonzero().flatten()

    rng = random.Random(0)
    for _ in range(2000):
        pieces, at = [], rng.randrange(0, 40)
        for _ in range(rng.randrange(0, 6)):
            n = rng.randrange(1, 50)
            pieces.append(SimpleNamespace(offset=at, length=n))
            at += n + rng.choice([0, 0, rng.randrange(1, 20)])
        rng.shuffle(pieces)
        start, length = rng.randrange(0, 60), rng.randrange(1, 200)
        want = masked(pieces, start, length)
        got = gap_index(SimpleNamespace(pieces=pieces), start, length, torch.device("cpu"))
        assert (want is None and got is None) or torch.equal(want, got), (pieces, start, length)


def test_work_called_on_the_issuing_thread_runs_in_order_and_its_failure_surfaces_at_the_next_wait():
    engine = _engine("8bit")
    issuer = engine.offload.gpu.issuer
    seen = []
    issuer.call(lambda: seen.append(threading.current_thread().name))
    issuer.call(lambda: 1 / 0)
    with pytest.raises(EngineError, match="ZeroDivisionError"):
        issuer.wait_all()
    assert seen == ["zerofit-stream-issue"]
    _train(engine, 1, 2)  # the thread still serves the steps

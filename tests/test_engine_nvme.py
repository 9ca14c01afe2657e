"""NVMe offload of optimizer state (gloo, CPU): files on a temporary directory instead of host memory.

NVMe runs must be bit-equal to CPU-offload runs (the same host step on the same values, only
swapped through files in between), keep at most `buffer_count` groups in memory, refuse unusable
paths on every rank before training, remove their files, and checkpoint like any other run.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from collections import namedtuple

import pytest
import torch
from engine_cases import Case, make_model_and_optim, run_engine
from test_checkpoint_support import assemble, build, owned_state, train

from zerofit.checkpoint import load_state, save_state
from zerofit.config.schema import OffloadConfig, ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.engine.offload.nvme import SwapFileChanged
from zerofit.errors import CheckpointError, EngineError
from zerofit.testing.distributed import run_distributed

PARITY = [(s, g) for s in (1, 2, 3) for g in (1, 4)]


def _nvme_engine(stage: int, path: str, *, buffer_count: int = 4, perturb: float = 0.0, step_on: str = "auto"):
    case = Case(stage=stage, steps=12)
    model, opt = make_model_and_optim(case)
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(perturb)
    zero = ZeroConfig(stage=stage, param_persistence_threshold=0,
                      offload_optimizer=OffloadConfig(device="nvme", nvme_path=path, buffer_count=buffer_count,
                                                      step_on=step_on))
    return case, model, opt, ZeroEngine(model, opt, zero=zero, device=torch.device("cpu"))


def parity_runs(rank, world, path):
    out = {}
    for stage, gas in PARITY:
        cpu = run_engine(rank, world, Case(stage=stage, gas=gas, offload="cpu"))
        nvme = run_engine(rank, world, Case(stage=stage, gas=gas, offload="nvme", nvme_path=path))
        out[(stage, gas)] = (cpu, nvme)
    return out


def memory_run(rank, world, path):
    """A pool of 2 buffers, more groups than that."""
    case, model, _, engine = _nvme_engine(2, path, buffer_count=2)
    swapper, groups = engine.offload.swapper, [g for g in engine.trainable_groups if g.placement.host_stepped]
    files = sorted(os.listdir(swapper.dir))
    resident = []
    for step in range(3):
        train(engine, model, case, rank, world, range(step, step + 1))
        resident.append(swapper.resident())  # right after step(): some groups may still be stepping
        engine.offload.stepper.wait_all()
        resident.append(swapper.resident())
    opt_state = [v for st in engine.optimizer.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor) and v.ndim == 1]
    memory = {"groups": len(groups), "files": len(files), "resident": resident,
              "allocated": swapper.pool.allocated, "state_numel": sum(v.numel() for v in opt_state),
              "state_tensors": len(opt_state)}
    directory = swapper.dir
    engine.offload.stepper.close()  # what the engine's finalizer does
    memory["removed"] = not os.path.exists(directory)
    return memory


# Two launches, so the fast loop (-m "not slow") runs the memory check without the parity sweep.
@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    return run_distributed(parity_runs, 2, str(tmp_path_factory.mktemp("nvme")), timeout=300)


@pytest.fixture(scope="module")
def memory_runs(tmp_path_factory):
    return run_distributed(memory_run, 2, str(tmp_path_factory.mktemp("nvme")), timeout=300)


@pytest.mark.slow  # a sweep of NVMe runs
@pytest.mark.parametrize("stage,gas", PARITY)
def test_nvme_bit_equal_to_cpu_offload(parity, stage, gas):
    for out in parity:
        cpu, nvme = out[(stage, gas)]
        assert nvme["offloaded"] == cpu["offloaded"] > 0
        assert nvme["losses"] == cpu["losses"]
        assert all(torch.equal(cpu["params"][k], nvme["params"][k]) for k in cpu["params"])
        for g1, g2 in zip(cpu["grads"], nvme["grads"]):
            assert all(torch.equal(g1[k], g2[k]) for k in g1)


def test_nvme_keeps_host_memory_bounded(memory_runs):
    for memory in memory_runs:
        assert memory["groups"] > 2 and memory["files"] == memory["groups"]
        assert max(memory["resident"]) <= 2 and memory["resident"][1::2] == [0, 0, 0]
        assert memory["allocated"] <= 2
        # swapped-out optimizer state holds no elements in memory (the tensors stay, empty)
        assert memory["state_tensors"] > 0 and memory["state_numel"] == 0
        assert memory["removed"]


def test_nvme_files_removed_at_exit(tmp_path):
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_engine_nvme import _nvme_engine
        from test_checkpoint_support import train
        case, model, _, engine = _nvme_engine(1, {str(tmp_path)!r})
        train(engine, model, case, 0, 1, range(2))
        assert len(__import__("os").listdir({str(tmp_path)!r})) == 1
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert os.listdir(tmp_path) == []  # removed by the atexit finalizer


# --- preflight (one process, no process group) ---------------------------------------------------
def test_preflight_missing_path(tmp_path):
    with pytest.raises(EngineError, match=r"offload_optimizer\.nvme_path '.*nope' does not exist.*create"):
        _nvme_engine(1, str(tmp_path / "nope"))


def test_preflight_path_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(EngineError, match=r"offload_optimizer\.nvme_path '.*file' is not a directory"):
        _nvme_engine(1, str(f))


def test_preflight_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)  # 0o500
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as root: a 0o500 directory is still writable")
        with pytest.raises(EngineError, match=r"offload_optimizer\.nvme_path '.*ro' is not writable.*chmod"):
            _nvme_engine(1, str(ro))
    finally:
        ro.chmod(0o700)


def test_preflight_too_little_space(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(1 << 20, 1 << 20, 4096))
    with pytest.raises(EngineError, match=r"offload_optimizer\.nvme_path '.*' has 0\.00 GiB free but rank 0 needs"):
        _nvme_engine(1, str(tmp_path))
    assert os.listdir(tmp_path) == []  # refused before any file was made


def test_preflight_needs_a_path():
    with pytest.raises(EngineError, match=r"nvme_path is not set"):
        _nvme_engine(1, None)


def test_too_few_buffers(tmp_path):
    with pytest.raises(EngineError, match=r"offload_optimizer\.buffer_count must be >= 2"):
        _nvme_engine(1, str(tmp_path), buffer_count=1)


def test_parameter_nvme_still_refused(tmp_path):
    model, opt = make_model_and_optim(Case(stage=3))
    zero = ZeroConfig(stage=3, offload_param=OffloadConfig(device="nvme", nvme_path=str(tmp_path)))
    with pytest.raises(EngineError, match=r"offload_param\.device 'nvme' is not supported"):
        ZeroEngine(model, opt, zero=zero, device=torch.device("cpu"))


# --- checkpoints ---------------------------------------------------------------------------------
def checkpoint_round_trip(rank, world, root, path):
    case, model, _, engine = _nvme_engine(3, path)
    train(engine, model, case, rank, world, range(3))
    save_state(os.path.join(root, "nvme"), engine)
    saved = owned_state(engine, rank)
    next_loss = train(engine, model, case, rank, world, range(3, 4))[0]  # trains on after materialising
    out = {"saved": saved, "next": next_loss}
    for name in ("plain", "nvme"):
        if name == "plain":
            case, model, _, other = build(2, perturb=0.5)
        else:
            case, model, _, other = _nvme_engine(1, path, perturb=0.5)
        load_state(os.path.join(root, "nvme"), other)
        out[name] = owned_state(other, rank)
        out[name + "_next"] = train(other, model, case, rank, world, range(3, 4))[0]
    return out


def test_checkpoint_saved_with_nvme_loads_anywhere(tmp_path):
    root, path = tmp_path / "ckpt", tmp_path / "swap"
    path.mkdir()
    per_rank = run_distributed(checkpoint_round_trip, 2, str(root), str(path), timeout=300)
    want = assemble([r["saved"] for r in per_rank])
    assert {k for _, k in want} >= {"master", "exp_avg", "exp_avg_sq"}
    for name in ("plain", "nvme"):
        got = assemble([r[name] for r in per_rank])
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), name
        assert per_rank[0][name + "_next"] == per_rank[0]["next"]


@pytest.mark.parametrize("step_on", ["host", "device"])  # the host stepper, and the GPU-stepped path on the CPU
def test_a_save_reads_one_group_at_a_time_and_leaves_them_on_file(tmp_path, monkeypatch, step_on):
    """[Note: saving from NVMe]: the save materialised every group at once (a rank's whole master and state in
    host memory, what NVMe was chosen to avoid); now each group's file is read while its tensors are written,
    and nothing stays in memory after. The checkpoint still holds every value: a plain engine loads it and
    trains on with the same loss."""
    from zerofit.checkpoint import sharded
    (tmp_path / "swap").mkdir()
    case, model, _, engine = _nvme_engine(1, str(tmp_path / "swap"), step_on=step_on)
    train(engine, model, case, 0, 1, range(2))
    swapper, seen = engine.offload.swapper, []
    groups = len(swapper._infos)
    assert groups >= 3

    def write(path, chunks):
        seen.append((swapper.resident(), {k.split("/", 1)[0] for k in chunks}))
        return write_shard(path, chunks)

    write_shard = sharded.write_shard
    monkeypatch.setattr(sharded, "write_shard", write)
    _writes_done(engine)
    first = engine.optimizer.param_groups[0]["params"][0]
    engine.optimizer.state[first]["step"].fill_(7.0)  # a piece whose step count differs from its group's
    scalars = _scalars(engine)
    assert sorted({v["step"] for v in scalars.values()}) == [2.0, 7.0]
    swapper.evict_materialized()  # back on file, as training leaves them
    save_state(str(tmp_path / "ckpt"), engine)
    # every group is on NVMe here (nothing else to write first): one file each, written while it alone is in memory
    assert len(seen) == groups
    assert all(resident == 1 and {"master", "exp_avg", "exp_avg_sq"} <= keys for resident, keys in seen), seen
    assert swapper.resident() == 0
    assert len(list((tmp_path / "ckpt" / "state").glob("*.safetensors"))) == groups
    want = assemble([owned_state(engine, 0)])
    next_loss = train(engine, model, case, 0, 1, range(2, 3))[0]
    case, model, _, plain = build(1, perturb=0.5)
    load_state(str(tmp_path / "ckpt"), plain)
    got = assemble([owned_state(plain, 0)])
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert train(plain, model, case, 0, 1, range(2, 3))[0] == next_loss
    # a load into an NVMe run reads the groups in one at a time too, and writes each back to its file
    (tmp_path / "swap2").mkdir()
    case, model, _, again = _nvme_engine(1, str(tmp_path / "swap2"), step_on=step_on, perturb=0.5)
    swapper, seen = again.offload.swapper, []

    def read(*args, **kw):
        seen.append(swapper.resident())
        return read_chunks(*args, **kw)

    read_chunks = sharded.read_chunks
    monkeypatch.setattr(sharded, "read_chunks", read)
    load_state(str(tmp_path / "ckpt"), again)
    assert seen == [0] + [1] * groups and swapper.resident() == 0, seen
    assert _scalars(again) == scalars  # each parameter's own step count, found while its group is in memory
    assert train(again, model, case, 0, 1, range(2, 3))[0] == next_loss
    got = assemble([owned_state(again, 0)])
    after = assemble([owned_state(engine, 0)])
    assert all(torch.equal(got[k], after[k]) for k in after)
    # an export of the weights too (`full_state_dict`, `save_consolidated`): one group in memory at a time
    swapper.evict_materialized()
    from zerofit.checkpoint import consolidate, full_state_dict
    whole, during = consolidate._whole_group, []

    def gather(*args, **kw):
        during.append(swapper.resident())
        return whole(*args, **kw)

    monkeypatch.setattr(consolidate, "_whole_group", gather)
    exported = full_state_dict(again)
    assert during == [1] * groups and swapper.resident() == 0, during
    monkeypatch.setattr(consolidate, "_whole_group", whole)
    want_weights = full_state_dict(engine)
    assert exported.keys() == want_weights.keys()
    assert all(torch.equal(exported[k], want_weights[k]) for k in exported)


def _scalars(engine) -> dict:
    from zerofit.engine.state import fragment_scalars, local_fragments
    engine.settle()
    return fragment_scalars(local_fragments(engine.groups, engine.optimizer, 0))


def test_a_failed_write_fails_every_later_slot_request_instead_of_hanging():
    import threading

    from zerofit.engine.offload.nvme import BufferPool

    pool = BufferPool(1, 4, pin=False)
    held = pool.acquire()  # kept by a write that fails
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(pytest.raises(EngineError, pool.acquire)))
    waiter.start()
    pool.fail(OSError(28, "No space left on device"))
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert got and got[0].match(r"an NVMe write failed \(.*No space left on device\).*nvme_path")
    with pytest.raises(EngineError, match="NVMe write failed"):
        pool.acquire()
    assert held.numel() == 4


# --- a swap file changed by something else ---------------------------------------------------------
def _damage(path: str, how: str) -> None:
    """Truncate the file, or overwrite it with finite garbage of the same size (bytes of random floats)."""
    size = os.path.getsize(path)
    if how == "truncate":
        os.truncate(path, size // 2)
    else:
        with open(path, "r+b") as f:
            f.write(torch.randn(size // 4, generator=torch.Generator().manual_seed(7)).numpy().tobytes())


def _writes_done(engine) -> None:
    """Wait until the files hold every value of the last step, without reading them back."""
    if engine.offload.stepper is not None:
        engine.offload.stepper.wait_all()
    else:
        engine.offload.gpu.issuer.wait_all()
    engine.offload.swapper.flush()


@pytest.mark.parametrize("step_on", ["host", "device"])  # the host stepper, and the GPU-stepped path on the CPU
@pytest.mark.parametrize("how", ["truncate", "garbage"])
def test_a_swap_file_changed_by_another_process_is_an_error_naming_it(tmp_path, how, step_on):
    """#25: a truncated file gave a bare 'the host optimizer step failed' RuntimeError (the file named
    nowhere); a file overwritten with finite garbage silently turned the next loss and every weight to NaN."""
    case, model, _, engine = _nvme_engine(1, str(tmp_path), step_on=step_on)
    train(engine, model, case, 0, 1, range(2))
    _writes_done(engine)
    victim = os.path.join(engine.offload.swapper.dir, "group-00000.bin")
    _damage(victim, how)
    problem = "is shorter than zerofit wrote it" if how == "truncate" else "no longer holds what zerofit wrote"
    with pytest.raises(EngineError, match=(
            rf"NVMe swap file '{re.escape(victim)}' {problem} .*: something outside zerofit changed it \(rank 0\)\. "
            rf"Point zero_optimization\.offload_optimizer\.nvme_path \(now '{re.escape(str(tmp_path))}'\) at a "
            r"directory no other process writes, and restart from the last checkpoint")) as caught:
        train(engine, model, case, 0, 1, range(2, 4))
        engine.settle()
    assert type(caught.value) is SwapFileChanged  # raised as itself, not wrapped in a generic step failure


def test_a_damaged_swap_file_fails_a_checkpoint_save_too(tmp_path):
    case, model, _, engine = _nvme_engine(1, str(tmp_path))
    train(engine, model, case, 0, 1, range(1))
    _writes_done(engine)
    _damage(os.path.join(engine.offload.swapper.dir, "group-00001.bin"), "garbage")
    with pytest.raises(CheckpointError, match=r"rank 0: NVMe swap file '.*group-00001\.bin' no longer holds what "
                       "zerofit wrote"):  # agreed by every rank: the save reads every file back
        save_state(str(tmp_path / "ckpt"), engine)
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.glob("ckpt.tmp-*"))

"""Which GPU a rank computes on, and that every stream and event the library takes names it (#30).

A script (or transformers' `TrainingArguments`) often creates the process group before zerofit does;
the rank's GPU must still become the current device, and no stream may be taken from "the current
device" without naming it, or every rank orders its collectives against GPU 0.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerofit
from zerofit.config import load_config
from zerofit.distributed import arrival, runtime
from zerofit.engine.engine import default_device
from zerofit.errors import ConfigError
from zerofit.frontend.state import ProcessState
from zerofit.testing.distributed import run_distributed

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(("local_rank", "count", "index"),
                         [(0, 1, 0), (3, 1, 0), (3, 8, 3), (7, 8, 7), (9, 8, 1), (5, 2, 1)])
def test_device_index_wraps_the_local_rank_around_the_visible_gpus(local_rank, count, index):
    assert runtime.device_index(local_rank, count) == index


def test_device_index_errors_name_the_values():
    with pytest.raises(ConfigError, match=r"local rank 0 has no GPU to use: this process sees 0 GPUs"):
        runtime.device_index(0, 0)
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=-1 is not a local rank: .* 0 or more"):
        runtime.device_index(-1, 2)


@pytest.fixture
def one_visible_gpu_local_rank_3(monkeypatch):
    """SLURM `--gpus-per-task=1`: the fourth task on a machine sees one GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv(runtime.CONFIG_FILE_ENV, raising=False)


def test_one_visible_gpu_per_task_is_used_whatever_the_local_rank(one_visible_gpu_local_rank_3):
    assert runtime.device(load_config(None)) == torch.device("cuda", 0)
    assert default_device() == torch.device("cuda", 0)


def test_the_device_is_selected_when_the_script_made_the_process_group(monkeypatch):
    """ProcessState selects the rank's GPU whether or not zerofit creates the process group itself."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    selected = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: selected.append(torch.device(d)))
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # the script called init_process_group
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist, "get_rank", lambda *a: 2)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(arrival, "open_board", lambda **kw: None)  # no real group for the ranks to agree over
    state = ProcessState.create(load_config(None))
    assert state.device == torch.device("cuda", 2) and not state.initialized_here
    assert selected == [torch.device("cuda", 2)]


# Calls that fall back to the current device when given no device (or stream): each must name one.
_NEEDS_DEVICE = {"current_stream", "default_stream", "Stream", "synchronize", "record"}


def _device_less_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, owner = node.func.attr, ast.unparse(node.func.value)
        if name not in _NEEDS_DEVICE or node.args or node.keywords:
            continue
        # Event.synchronize() waits for its own event; torch.cuda.synchronize() waits for a device.
        if name == "synchronize" and owner not in ("torch.cuda", "cuda"):
            continue
        found.append(f"{path.relative_to(Path(zerofit.__file__).parent.parent)}:{node.lineno} "
                     f"{ast.unparse(node)}")
    return found


def test_no_stream_or_event_is_taken_from_the_current_device():
    """`torch.cuda.current_stream()` / `event.record()` without a device use whatever device is
    current, which is GPU 0 on a rank whose script never selected its own (#30)."""
    root = Path(zerofit.__file__).parent
    found = [c for path in sorted(root.rglob("*.py")) for c in _device_less_calls(path)]
    assert not found, "name the device (or the stream):\n" + "\n".join(found)


def _script_made_the_group(rank, world, local_rank):
    """The process group exists before zerofit runs (the harness made it, as a script would)."""
    from torch import nn

    from zerofit import Accelerator
    from zerofit.config.schema import RunConfig, ZeroConfig

    os.environ["LOCAL_RANK"] = str(local_rank)
    expected = runtime.device_index(local_rank, torch.cuda.device_count())
    before = torch.cuda.current_device()
    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=3, param_persistence_threshold=0)))
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    engine = acc._prepared.engines[id(model)]
    for _ in range(2):
        acc.backward(model(torch.randn(4, 8, device=acc.device)).sum())
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize(acc.device)
    return {"expected": expected, "before": before, "current": torch.cuda.current_device(),
            "acc": acc.device, "engine": engine.device, "comm_stream": engine.comm.stream.device,
            "gpu0_bytes": torch.cuda.memory_allocated(0)}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_group_made_by_the_script_still_runs_on_the_ranks_gpu(backend):
    """LOCAL_RANK 3: GPU 3 on a machine with 4 or more, GPU 0 on one (modulo, as SLURM's one GPU per
    task needs), GPU 1 on two; on any machine with 2 or more it is not the default GPU 0."""
    (got,) = run_distributed(_script_made_the_group, 1, 3, backend=backend, timeout=170)
    assert got["before"] == 0  # the script did not select a device
    want = torch.device("cuda", got["expected"])
    assert got["current"] == got["expected"]
    assert got["acc"] == want and got["engine"] == want and got["comm_stream"] == want
    if got["expected"] != 0:
        assert got["gpu0_bytes"] == 0  # nothing of this rank's lands on GPU 0


def test_nccl_takes_a_cpu_tensor_through_this_processs_gpu(monkeypatch):
    from zerofit.frontend import ops

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert ops.wire_device(torch.zeros(2), "nccl") == torch.device("cuda", 2)  # a metric on the CPU
    assert ops.wire_device(torch.zeros(2), "gloo") == torch.device("cpu")
    meta = torch.empty(2, device="meta")  # any tensor NCCL can move stays where it is
    assert ops.wire_device(meta, "gloo") == meta.device

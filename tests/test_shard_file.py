"""A rank's checkpoint file is written tensor by tensor ([Note: streaming shard writer]): what it writes is a
safetensors file that safetensors and DCP's reader read back exactly, and a save takes no host memory beyond a
bounce buffer (DCP's writer took a private copy of every tensor and the serialised file: twice the state)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open

from zerofit.checkpoint import shard_file
from zerofit.checkpoint.chunks import Chunk, read_chunks, read_index
from zerofit.checkpoint.shard_file import layout, shard_name, tiling_problem, write_shard
from zerofit.errors import CheckpointError

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "master/w": torch.randn(37, generator=g),
        "param/e": torch.randn(11, generator=g).to(torch.bfloat16),
        "exp_avg/w": torch.randint(0, 255, (37,), generator=g, dtype=torch.uint8),
        "exp_avg.absmax/w": torch.rand(3, generator=g),
        "buffer/pos": torch.arange(9, dtype=torch.int64),
        "buffer/mask": torch.rand(13, generator=g) > 0.5,
        "buffer/half": torch.randn(5, generator=g).half(),
        "buffer/i32": torch.arange(-3, 4, dtype=torch.int32),
        "buffer/f64": torch.randn(3, generator=g, dtype=torch.float64),
    }


def test_every_dtype_reads_back_through_safetensors_and_dcp(tmp_path):
    values = _values()
    # a rank's share of each tensor: elements [2, n) of a tensor of n + 2 (chunk offsets in the header)
    chunks = {k: Chunk(v, 2, v.numel() + 2) for k, v in values.items()}
    chunks["master/whole"] = Chunk(torch.randn(1000)[::2], 0, 500)  # a strided view: written as its values
    write_shard(tmp_path / shard_name(0), chunks)
    with safe_open(str(tmp_path / shard_name(0)), framework="pt") as f:
        info = json.loads(f.metadata()["DCP_SHARDING_INFO"])
        for k, c in chunks.items():
            assert torch.equal(f.get_tensor(k), c.tensor), k
            assert info[k] == {"saved_offsets": [c.start]}
    index = read_index(tmp_path)
    assert {k: (tuple(md.size), md.properties.dtype) for k, md in index.items()} == \
        {k: ((c.numel,), c.tensor.dtype) for k, c in chunks.items()}
    back = {k: Chunk(torch.zeros_like(c.tensor), c.start, c.numel) for k, c in chunks.items()}
    read_chunks(tmp_path, back, None, no_dist=True)
    for k, c in chunks.items():
        assert torch.equal(back[k].tensor, c.tensor), k
    with open(tmp_path / shard_name(0), "rb") as f:
        assert int.from_bytes(f.read(8), "little") % 8 == 0  # the header is padded to 8 bytes, as safetensors does


def test_every_tensor_starts_aligned_to_its_element_size(tmp_path):
    """Widest elements first, as safetensors' own writer orders them: a reader that maps the file sees aligned
    tensors (an odd number of bf16 elements before an fp32 tensor would leave it off by two bytes)."""
    values = {"a/odd": torch.ones(3, dtype=torch.bfloat16), "b/bytes": torch.ones(5, dtype=torch.uint8),
              "c/wide": torch.arange(4, dtype=torch.float64), "d/f32": torch.ones(7)}
    chunks = {k: Chunk(v, 0, v.numel()) for k, v in values.items()}
    write_shard(tmp_path / "x.safetensors", chunks)
    with open(tmp_path / "x.safetensors", "rb") as f:
        entries = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    sizes = {"F64": 8, "F32": 4, "BF16": 2, "U8": 1}
    assert all(e["data_offsets"][0] % sizes[e["dtype"]] == 0 for k, e in entries.items() if k != "__metadata__")
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(k), c.tensor) for k, c in chunks.items())


def test_an_unstorable_dtype_names_the_tensor_and_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match=r"master/c: a tensor of dtype torch.complex64 cannot be stored"):
        write_shard(tmp_path / "x.safetensors", {"master/c": Chunk(torch.zeros(3, dtype=torch.complex64), 0, 3)})


def test_tiling_problems_name_the_gap_and_the_overlap():
    a = {"master/w": Chunk(torch.zeros(4), 0, 10)}
    b = {"master/w": Chunk(torch.zeros(6), 4, 10)}
    assert tiling_problem([layout(a), layout(b)]) is None
    late, short = Chunk(torch.zeros(5), 5, 10), Chunk(torch.zeros(5), 4, 10)
    assert "gap or overlap at element 4" in tiling_problem([layout(a), layout({"master/w": late})])
    assert "cover 9 of 10 elements" in tiling_problem([layout(a), layout({"master/w": short})])


def test_a_save_takes_no_memory_beyond_the_state(tmp_path):
    """One process saves an engine holding ~0.8 GB of fp32 master and Adam state: the peak RSS grows by well
    under a tenth of that (DCP's writer: a copy of every tensor plus the serialised file, ~1.6 GB)."""
    script = textwrap.dedent("""
        import resource, sys, torch
        from torch import nn
        from zerofit.checkpoint import save_state
        from zerofit.config.schema import ZeroConfig
        from zerofit.engine import ZeroEngine
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(4)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=2), device=torch.device("cpu"))
        engine.backward(model(torch.randn(2, 4096)).square().mean())
        engine.step()
        state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.ndim)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        save_state(sys.argv[1], engine, update_latest=False)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(state, after - before)
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ckpt")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    state, grew = map(int, out.stdout.split()[-2:])
    assert state > 500e6
    assert grew < 0.1 * state, f"a save grew the peak RSS by {grew / 1e6:.0f} MB ({state / 1e6:.0f} MB of state)"


@requires_cuda
def test_device_tensors_are_written_through_the_bounce_buffer(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_file, "PIECE", 1000)  # several pieces per tensor, a last one shorter
    values = {k: v.cuda() for k, v in _values().items()}
    values["master/big"] = torch.randn(12345, device="cuda")
    chunks = {k: Chunk(v, 0, v.numel()) for k, v in values.items()}
    write_shard(tmp_path / shard_name(0), chunks)
    with safe_open(str(tmp_path / shard_name(0)), framework="pt") as f:
        for k, v in values.items():
            assert torch.equal(f.get_tensor(k), v.cpu()), k

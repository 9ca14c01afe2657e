"""One rank's chunks written as one safetensors file, tensor by tensor, with nothing staged in memory.

[Note: streaming shard writer]
A checkpoint's tensors are a rank's whole training state: the fp32 master, every optimizer state tensor,
its share of the frozen weights - for one process fine-tuning a 9 B model, about 48 GB with 8-bit state. DCP's
Hugging Face writer copies each tensor to a private CPU tensor and serialises the whole file into one bytes
object before writing it, so a save needed about twice the rank's state in free host memory: the memory that
offloading had just put to use. Here a rank's file is written as it is read: the header first (every chunk's
dtype, length and byte range are known up front), then each chunk's bytes straight from where the engine
keeps them - host tensors from their own memory, device tensors through one bounce buffer of `PIECE` bytes.
A save then needs no memory beyond that buffer.

The file is exactly what DCP's Hugging Face storage writes (`HuggingFaceStorageWriter(save_distributed=True)`)
and reads back (`HuggingFaceStorageReader`, which zerofit loads with): a safetensors file whose metadata
entry `DCP_SHARDING_INFO` gives each tensor's first element in the whole flattened tensor (`saved_offsets`),
so DCP's resharding reads it at any world size (see [Note: checkpoint format] in zerofit.checkpoint.chunks).
The format: an 8-byte little-endian header length, the header (JSON, padded with spaces to a multiple of 8
bytes), then the tensors' bytes back to back in the header's order, native little-endian.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
from pathlib import Path

import torch

from zerofit.checkpoint.chunks import Chunk
from zerofit.errors import CheckpointError

PIECE = 64 << 20
"""Bytes per copy of a device tensor to the host while it is written (the only buffer a save allocates)."""

_CODES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
    torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _CODES[getattr(torch, _name)] = _code


def shard_name(rank: int, part: int = 1, parts: int = 1) -> str:
    """File `part` of the `parts` rank `rank` writes (DCP's Hugging Face storage names one so; the reader reads
    every `.safetensors` file of the folder)."""
    return f"shard-{rank:05d}-model-{part:05d}-of-{parts:05d}.safetensors"


def header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The length-prefixed safetensors header of `tensors`, whose bytes follow in this order."""
    entries: dict[str, object] = {}
    end = 0
    for name, t in tensors.items():
        code = _CODES.get(t.dtype)
        if code is None:
            raise CheckpointError(f"{name}: a tensor of dtype {t.dtype} cannot be stored in a safetensors file "
                                  f"(supported: {', '.join(str(d) for d in _CODES)}); keep it in one of those dtypes")
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [end, end + size]}
        end += size
    entries["__metadata__"] = metadata
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], *,
                      what: str = "the sharded tensors") -> None:
    """Write `tensors` (any device, any layout) as the safetensors file `path`, each from where it lies (a device
    tensor through one bounce buffer of `PIECE` bytes), widest elements first so every tensor's bytes start
    aligned to its element size, and flush it to disk. Raises CheckpointError naming the file and `what` on
    any failure (the caller removes what is unfinished)."""
    if sys.byteorder != "little":  # pragma: no cover - safetensors stores little-endian; no big-endian host here
        raise CheckpointError("writing a safetensors file needs a little-endian host")
    order = sorted(tensors, key=lambda name: -tensors[name].element_size())  # stable: names keep their order
    tensors = {name: tensors[name] for name in order}
    try:
        with open(path, "wb") as f:
            f.write(header(tensors, metadata))
            bounce: torch.Tensor | None = None
            for t in tensors.values():
                data = t.detach()
                if not data.is_contiguous():
                    data = data.contiguous()
                raw = data.reshape(-1).view(torch.uint8)
                if raw.device.type == "cpu":
                    _write_bytes(f, raw)
                    continue
                if bounce is None or bounce.numel() < min(PIECE, raw.numel()):
                    bounce = torch.empty(min(PIECE, raw.numel()), dtype=torch.uint8,
                                         pin_memory=raw.device.type == "cuda")
                for lo in range(0, raw.numel(), PIECE):
                    piece = raw[lo:lo + PIECE]
                    out = bounce[:piece.numel()]
                    out.copy_(piece)  # synchronous: the bytes are on the host when it returns
                    _write_bytes(f, out)
            f.flush()
            os.fsync(f.fileno())
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a full disk, a lost mount, a device error: all name the file
        raise CheckpointError(f"{path}: writing {what} failed ({type(e).__name__}: {e}): check the free space "
                              "and the path") from None


def write_shard(path: Path, chunks: dict[str, Chunk]) -> None:
    """Write a rank's `chunks` (1-D tensors) as the safetensors file `path` that DCP's reader reshards from (each
    chunk's first element in the header's `DCP_SHARDING_INFO`; see the module note)."""
    offsets = {fqn: {"saved_offsets": [c.start]} for fqn, c in chunks.items()}
    write_safetensors(path, {fqn: c.tensor for fqn, c in chunks.items()},
                      {"DCP_SHARDING_INFO": json.dumps(offsets), "DCP_VERSION": "1.0", "format": "pt"})


def layout(chunks: dict[str, Chunk]) -> list[tuple[str, int, int, int]]:
    """(name, first element, elements, elements of the whole tensor) of each chunk: what `tiling_problem` checks."""
    return [(fqn, c.start, c.tensor.numel(), c.numel) for fqn, c in chunks.items()]


def tiling_problem(layouts: list[list[tuple[str, int, int, int]]]) -> str | None:
    """Every rank's `layout`, gathered: None when the ranks' chunks tile every tensor exactly once, else what does
    not (an engine bug: every element has exactly one writer, `zerofit.engine.state.writer_fragments`)."""
    found: dict[str, list[tuple[int, int]]] = {}
    sizes: dict[str, int] = {}
    for rank_layout in layouts:
        for fqn, start, length, numel in rank_layout:
            found.setdefault(fqn, []).append((start, length))
            sizes.setdefault(fqn, numel)
    for fqn, runs in found.items():
        end = 0
        for start, length in sorted(runs):
            if start != end:
                return f"{fqn}: the ranks' chunks leave a gap or overlap at element {end} (an engine bug: please " \
                       "report it)"
            end += length
        if end != sizes[fqn]:
            return f"{fqn}: the ranks' chunks cover {end} of {sizes[fqn]} elements (an engine bug: please report it)"
    return None


def _write_bytes(f, raw: torch.Tensor) -> None:
    """Write a contiguous host uint8 tensor's bytes without copying them."""
    n = raw.numel()
    if n:
        f.write(memoryview((ctypes.c_char * n).from_address(raw.data_ptr())).cast("B"))

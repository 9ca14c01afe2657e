"""Chunks of flat 1-D tensors, read through `torch.distributed.checkpoint` (DCP) in the files it writes.

Every saved tensor is a flattened parameter (or optimizer state, or buffer) of `numel` elements, and
each rank writes only the contiguous run of it that it owns: a `Chunk`. Loading asks for the runs
the new layout owns; DCP's resharding matches them against the saved runs, whatever world size,
stage or unit layout wrote them.

[Note: checkpoint format]
DCP's default storage (`FileSystemWriter`/`FileSystemReader`) keeps its index in `.metadata`, a
pickle that `FileSystemReader.read_metadata` opens with plain `pickle.load` in torch 2.11 and 2.13:
loading an untrusted checkpoint could run code. Both releases also ship DCP's Hugging Face storage
(`HuggingFaceStorageWriter(save_distributed=True)` / `HuggingFaceStorageReader`, torch >= 2.9): each
rank writes one `.safetensors` file, the chunk offsets go as JSON into the safetensors header, and
the reader rebuilds the index from those headers. Nothing on that path unpickles, and safetensors
reads only the byte ranges a request needs. zerofit reads that storage with its own planner
(`_ChunkLoadPlanner`, on DCP's public planner interface), so DCP still plans the reads, coordinates the
ranks and reshards; it never sees pickle. Each rank writes its file itself, in the same format, without
staging it in memory (see [Note: streaming shard writer] in zerofit.checkpoint.shard_file).
Non-tensor state goes to JSON files beside it (`zerofit.checkpoint.tree`). DCP keeps no checksums
and leaves no commit marker on this path: `zerofit.checkpoint.manifest` and `.commit` add both.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter  # noqa: F401
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from zerofit.errors import CheckpointError


@dataclass
class Chunk:
    """Elements [start, start + tensor.numel()) of a flattened tensor of `numel` elements."""

    tensor: torch.Tensor
    """1-D. Saving reads it; loading writes into it (it may be a view into engine state)."""
    start: int
    numel: int

    def meta(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.start]), sizes=torch.Size([self.tensor.numel()]))


class _ChunkLoadPlanner(LoadPlanner):
    """Reads, for each local chunk, the parts of every saved chunk that overlap it."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.chunks: dict[str, Chunk] = state_dict
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for fqn, c in self.chunks.items():
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [c.meta()])
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value) -> None:
        raise CheckpointError(f"{read_item.dest_index.fqn}: the checkpoint holds bytes where a tensor was "
                              "expected; it was not written by zerofit")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        c = self.chunks[read_item.dest_index.fqn]
        return c.tensor.narrow(0, read_item.dest_offsets[0], read_item.lengths[0])

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # `resolve_tensor` handed out views of the destination: the data is already in place


def require_hf_storage() -> None:
    if "save_distributed" not in inspect.signature(HuggingFaceStorageWriter.__init__).parameters:
        raise CheckpointError(f"sharded checkpoints need torch >= 2.9 (HuggingFaceStorageWriter with "
                              f"save_distributed); this is torch {torch.__version__}: upgrade torch")


def _failure_text(e: BaseException) -> str:
    # DCP's CheckpointException (a BaseException) carries {rank: (exception, traceback)}; show the causes.
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {r}: {w[0] if isinstance(w, tuple) else w!r}" for r, w in sorted(failures.items()))
    return repr(e)


def read_index(directory: Path) -> dict[str, TensorStorageMetadata]:
    """fqn -> shape, dtype and saved chunks, from the safetensors headers under `directory` (local)."""
    require_hf_storage()
    try:
        return dict(HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata)
    except Exception as e:  # noqa: BLE001 - a damaged header can raise many kinds
        raise CheckpointError(f"{directory}: cannot read the sharded tensors' headers ({e!r}): the "
                              "checkpoint is damaged; load an earlier one") from None


def missing_ranges(index: dict[str, TensorStorageMetadata], chunks: dict[str, Chunk]) -> list[str]:
    """Problems that would stop `read_chunks`: unknown tensors, other sizes, runs no saved chunk covers."""
    problems = []
    for fqn, c in chunks.items():
        md = index.get(fqn)
        if md is None:
            problems.append(f"{fqn}: not in the checkpoint")
            continue
        if tuple(md.size) != (c.numel,):
            problems.append(f"{fqn}: {tuple(md.size)[0] if len(md.size) == 1 else tuple(md.size)} elements "
                            f"in the checkpoint, {c.numel} in this model")
            continue
        lo, hi = c.start, c.start + c.tensor.numel()
        covered = sum(max(0, min(hi, s.offsets[0] + s.sizes[0]) - max(lo, s.offsets[0])) for s in md.chunks)
        if covered != hi - lo:
            problems.append(f"{fqn}: the saved chunks cover {covered} of elements [{lo}, {hi})")
    return problems


def read_chunks(directory: Path, chunks: dict[str, Chunk], group: dist.ProcessGroup | None, *,
                no_dist: bool | None = None) -> None:
    """Fill every chunk's tensor from the checkpoint under `directory` (collective unless `no_dist`)."""
    require_hf_storage()
    if no_dist is None:
        no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(chunks, storage_reader=HuggingFaceStorageReader(str(directory)),
                     planner=_ChunkLoadPlanner(), process_group=group, no_dist=no_dist)
    except (Exception, dcp.CheckpointException) as e:
        raise CheckpointError(f"{directory}: reading the sharded tensors failed: {_failure_text(e)}") from None

"""`save_state` / `load_state`: the resumable checkpoint of one engine, sharded as the ranks hold it.

A checkpoint directory:

    state/shard-0000R-model-00001-of-00001.safetensors  each rank's chunks (see `chunks`): tensors named
                                                        "<kind>/<parameter>", kind = master (fp32, trainable),
                                                        param (frozen), buffer, or an optimizer state key
                                                        (as stored: fp32, bf16, or 8-bit codes and their
                                                        "<key>.absmax" block scales, see `state_forms`)
    common.json (+ common.safetensors)                  what was saved: parameter table, optimizer param
                                                        groups and scalar state, loss scaler, micro-step
    rank-0000R.json (+ .safetensors)                    rank R's `extra_state` (see `tree`)
    run_config.json                                     the resolved RunConfig, when one was given
    hf_config/                                          the model's Hugging Face config, when it has one
    manifest.json                                       sizes and SHA-256 of all of the above, written last

Every element is written by exactly one rank (`zerofit.engine.state.writer_fragments`), and loading
reads, on every rank, the runs that rank's new layout holds, so a checkpoint loads at any world size,
stage or offload setting. Every phase ends with all ranks agreeing on success (`ranks`), and the
directory appears under its final name only when complete (`commit`).

[Note: a checkpoint without the frozen weights]
A PEFT run trains an adapter of megabytes on a frozen base of up to hundreds of gigabytes, and the base
never changes: writing it into every checkpoint costs its size in disk and time at each save.
`exclude_frozen` (Accelerate's `save_state(..., exclude_frozen_parameters=True)`, DeepSpeed's argument of
that name; zerofit's Trainer sets it for a PEFT model, as transformers' Trainer does under DeepSpeed) keeps
the frozen parameters in the parameter table but writes none of their values, and `common.json` says so
(`frozen_excluded`). Loading such a checkpoint leaves every parameter that was frozen when it was saved
as the model holds it now, so the run that resumes must build the same base (the same `from_pretrained`).
That is checked: the checkpoint records `PROBE` values spread over every frozen parameter
(`frozen_probe`), and a model whose frozen parameters hold others there (another base, a base fine-tuned
further; exactly where the dtypes agree, within the coarser dtype's rounding where they differ) is refused
before anything is loaded. `zerofit merge` refuses such a checkpoint: it holds no full model.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

from zerofit.checkpoint import commit as files
from zerofit.checkpoint import visibility
from zerofit.checkpoint.chunks import Chunk, missing_ranges, read_chunks, read_index, require_hf_storage
from zerofit.checkpoint.export import save_hf_configs
from zerofit.checkpoint.inventory import Entry, aliases, buffer_entries, param_entries, persistent_buffers
from zerofit.checkpoint.manifest import (
    check_hashes,
    check_sizes,
    describe,
    missing_required,
    read_manifest,
    unlisted,
    write_manifest,
)
from zerofit.checkpoint.ranks import Ranks
from zerofit.checkpoint.shard_file import layout, shard_name, tiling_problem, write_shard
from zerofit.checkpoint.state_forms import StateLoad, loading_codec, merge_forms, narrow_forms
from zerofit.checkpoint.tree import encode, read_tree, write_encoded, write_tree
from zerofit.checkpoint.whole_state import chunks_to_load, chunks_to_save
from zerofit.config.schema import RunConfig
from zerofit.engine.state import (
    allocate_optimizer_state,
    differing_scalars,
    fragment_scalars,
    is_scale_key,
    local_fragments,
    optimizer_scalars,
    restore_param_scalars,
    writer_fragments,
)
from zerofit.engine.whole_step import is_stand_in
from zerofit.errors import CheckpointError, EngineError

FORMAT = "zerofit-checkpoint/1"
STATE_DIR = "state"
COMMON = "common"
RUN_CONFIG = "run_config.json"
HF_CONFIG_DIR = "hf_config"
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")
"""Param-group settings that say how the optimizer runs here, not what it computes: never restored."""


def rank_stem(rank: int) -> str:
    return f"rank-{rank:05d}"


def save_state(directory: str | os.PathLike[str], engine, *, extra_state: dict | None = None,
               config: RunConfig | None = None, update_latest: bool = True, exclude_frozen: bool = False,
               run: str | None = None) -> str:
    """Collective: write the engine's full training state as a sharded checkpoint at `directory`.

    `extra_state` is this rank's own state (scheduler, counters, RNG, data position, ...): JSON-able
    values, tensors and numpy arrays. With `update_latest`, `<parent of directory>/latest` names the
    new checkpoint afterwards. `exclude_frozen`: the frozen parameters' values are left out ([Note: a
    checkpoint without the frozen weights]). `run`: the writing run's id, kept in the manifest
    (`zerofit.checkpoint.ownership`). Returns the checkpoint's path.
    """
    require_hf_storage()  # what loads it back
    ranks = Ranks(engine.comm.group)
    final = Path(directory).absolute()
    if not engine.at_boundary:
        warnings.warn("save_state in the middle of a gradient accumulation window: the gradients "
                      "accumulated so far are not saved, so resuming repeats nothing of this window; "
                      "save right after the optimizer step", stacklevel=2)
    extra_tensors: dict[str, torch.Tensor] = {}
    error = None
    try:
        extra_data = encode(extra_state or {}, extra_tensors, "extra_state")
    except CheckpointError as e:
        error = f"rank {ranks.rank}: {e}"
    ranks.agree(error)
    token = ranks.broadcast(uuid.uuid4().hex[:12])
    tmp = files.temp_dir(final, token)
    error = None
    if ranks.is_main:
        try:
            files.check_replaceable(final, update_latest=update_latest)
            files.remove_stale(final)
            tmp.mkdir(parents=True)
        except CheckpointError as e:
            error = str(e)
        except Exception as e:
            error = f"{tmp}: cannot create the checkpoint directory ({e}): check the path and free space"
    ranks.agree(error)
    try:
        error, optim_part, written = None, None, []
        try:
            (tmp / STATE_DIR).mkdir(parents=True, exist_ok=True)  # on each rank: a folder not every machine sees
            optim_part, written = _write_tensors(tmp / STATE_DIR, engine, ranks, exclude_frozen)
        except (CheckpointError, EngineError) as e:  # their text names the cause and the fix (a bad swap file)
            error = f"rank {ranks.rank}: {e}"
        except Exception as e:  # any failure must reach the agreement, or the peers would wait forever
            error = f"rank {ranks.rank}: writing {tmp / STATE_DIR} failed: {e}"
        gathered = ranks.all_gather((error, optim_part, written))
        ranks.raise_any([e for e, _, _ in gathered])
        ranks.agree(tiling_problem([w for _, _, w in gathered]))
        optim_parts = [part for _, part, _ in gathered]
        error = None
        try:
            write_encoded(tmp, rank_stem(ranks.rank), extra_data, extra_tensors)
            if ranks.is_main:
                _write_common(tmp, engine, ranks, optim_parts, config, exclude_frozen)
        except CheckpointError as e:
            error = f"rank {ranks.rank}: {e}"
        except Exception as e:  # any failure must reach the agreement, or the peers would wait forever
            error = f"rank {ranks.rank}: writing {tmp} failed: {e}"
        ranks.agree(error)
        _seal(tmp, final, token, ranks, update_latest, run)
    except CheckpointError:  # raised on every rank alike (see [Note: agreeing on failure])
        if ranks.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # free what a full disk needs back
        ranks.barrier()
        if tmp.exists():  # a folder of its own on this rank's machine (a directory not every machine sees)
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(final)


def _write_tensors(folder: Path, engine, ranks: Ranks, exclude_frozen: bool) -> tuple[tuple, list]:
    """Write this rank's tensors into `folder`, reading the groups as `ZeroEngine.state_by_group` allows: those
    readable in memory into one file, each NVMe-offloaded group into a file of its own while only it is in host
    memory ([Note: saving from NVMe]). Returns what `_write_common` needs of this rank and the chunks' `layout`."""
    opt = engine.optimizer
    keys: set[str] = set()
    scalars: dict = {}
    probes: list[dict] = []
    forms: list[dict] = []
    written: list = []
    whole_chunks, whole_records = chunks_to_save(engine)
    with engine.state_by_group() as scope:  # an overlapped step may still be writing the offloaded masters
        batches = _batches(engine.groups, scope)
        for part, (one, groups) in enumerate(batches, 1):
            with scope(one) if one is not None else contextlib.nullcontext():
                frags = writer_fragments(groups, opt, ranks.rank, ranks.world, among=engine.groups)
                keys.update(k for f in frags for k in f.tensors if not is_scale_key(k))
                scalars.update(fragment_scalars(frags))
                probes.append(base_probe(frags) if exclude_frozen else {})
                forms.append(narrow_forms(frags))
                chunks = {f"{key}/{f.name}": Chunk(t, *f.span(key)) for f in frags for key, t in f.tensors.items()
                          if not (exclude_frozen and key == "param") and t.numel()}  # a cut may hold no block scale
                if part == 1:
                    chunks.update(whole_chunks)
                    if ranks.is_main:
                        for name, buf in persistent_buffers(engine.model):
                            if buf.numel():
                                chunks[f"buffer/{name}"] = Chunk(buf.reshape(-1), 0, buf.numel())
                if chunks:
                    write_shard(folder / shard_name(ranks.rank, part, len(batches)), chunks)
                written += layout(chunks)
                del frags, chunks  # views of a group's buffer: it is freed when its scope closes
    state_keys = sorted(keys - {"master", "param"})
    return (optimizer_scalars(opt), state_keys, scalars, merge_probes(probes),
            merge_forms(forms, "save_state"), whole_records), written


def _batches(groups: list, scope) -> list[tuple]:
    """How a save or a load takes `groups` (`scope`: `ZeroEngine.state_by_group`'s): (None, the groups readable in
    memory now), then (g, [g]) for each group brought into memory alone ([Note: saving from NVMe])."""
    return [(None, [g for g in groups if scope(g) is None]), *((g, [g]) for g in groups if scope(g) is not None)]


def _write_common(tmp: Path, engine, ranks: Ranks, optim_parts: list, config: RunConfig | None,
                  exclude_frozen: bool) -> None:
    opt = engine.optimizer
    common: dict[str, Any] = {
        "frozen_excluded": exclude_frozen,
        "frozen_probe": merge_probes([part[3] for part in optim_parts]),
        "format": FORMAT, "torch_version": torch.__version__, "world_size": ranks.world,
        "stage": engine.zero.stage, "mixed_precision": engine.precision.mixed_precision,
        "params": [e.to_json() for e in param_entries(engine)],
        "buffers": [e.to_json() for e in buffer_entries(engine.model)],
        "aliases": aliases(engine.model),
        "scaler": engine.scaler.state_dict(),
        "micro_step": engine.window.micro_step,
        "optimizer": None,
    }
    if opt is not None:
        groups = []
        for gi in range(len(opt.param_groups)):
            per_rank = [scalars[gi] for scalars, *_ in optim_parts]
            found = next((g["scalars"] for g in per_rank if g["scalars"]), {})
            groups.append({"hyper": per_rank[0]["hyper"], "scalars": found})
        keys = sorted({k for _, ks, *_ in optim_parts for k in ks})
        per_param = {name: values for _, _, part, *_ in optim_parts for name, values in part.items()}
        group_of = {name: g.layout.groups[i] for g in engine.groups if g.trainable
                    for i, name in enumerate(g.names)}
        common["optimizer"] = {"class": type(opt).__name__, "groups": groups, "state_keys": keys,
                               "param_scalars": differing_scalars(per_param, groups, group_of),
                               "whole_state": {n: r for *_, records in optim_parts for n, r in records.items()}}
        forms = merge_forms([part[4] for part in optim_parts], "save_state")
        if forms:  # [Note: state forms in a checkpoint]: fp32 state is written as it always was
            common["optimizer"]["state_forms"] = forms
    write_tree(tmp, COMMON, common, "checkpoint state")
    if config is not None:
        from zerofit.config import save_config

        save_config(config, tmp / RUN_CONFIG)
    save_hf_configs(engine.model, tmp / HF_CONFIG_DIR)


def _seal(tmp: Path, final: Path, token: str, ranks: Ranks, update_latest: bool, run: str | None) -> None:
    """Confirm rank 0 sees every rank's files (see [Note: one directory every rank sees]), hash them (shared
    between ranks), write the manifest last, then commit and move `latest`."""
    names = visibility.confirm(tmp, final, ranks)
    error = None
    described: dict[str, dict] = {}
    try:
        described = describe(tmp, names)
    except Exception as e:
        error = f"rank {ranks.rank}: hashing {tmp} failed: {e}"
    parts = ranks.all_gather((error, described))
    ranks.agree(next((e for e, _ in parts if e), None))
    error = None
    if ranks.is_main:
        try:
            write_manifest(tmp, {k: v for _, d in parts for k, v in d.items()}, run)
            files.commit(tmp, final, token)
        except Exception as e:
            error = f"committing {final} failed: {e}"
        else:
            if update_latest:
                try:
                    files.point_latest(final, token)
                except CheckpointError as e:  # `final` is committed: the error says what is saved and what not
                    error = str(e)
    ranks.agree(error)


def saved_config(directory: str | os.PathLike[str]) -> RunConfig | None:
    """The RunConfig a checkpoint was saved with (None when it was saved without one)."""
    from zerofit.config import load_config

    path = files.resolve(directory) / RUN_CONFIG
    return load_config(path) if path.is_file() else None


def verify(path: Path, ranks: Ranks) -> None:
    """Raise CheckpointError on every rank unless the manifest and every file it lists check out."""
    error, manifest = None, {}
    try:
        manifest = read_manifest(path)
        error = "\n".join(missing_required(manifest, (f"{COMMON}.json",), STATE_DIR) + check_sizes(path, manifest)
                          + unlisted(path, manifest, STATE_DIR)) or None
    except CheckpointError as e:
        error = str(e)
    except OSError as e:  # e.g. a file the manifest lists that this rank may not read
        error = f"rank {ranks.rank}: {path}: cannot check the checkpoint's files ({e}): check their permissions"
    ranks.agree(error)
    names = sorted(manifest)
    try:
        error = "\n".join(check_hashes(path, manifest, names[ranks.rank::ranks.world])) or None
    except OSError as e:
        error = f"rank {ranks.rank}: {path}: cannot read the checkpoint's files ({e}): check their permissions"
    ranks.agree(error)


def read_common(path: Path) -> dict:
    common = read_tree(path, COMMON)
    if not isinstance(common, dict) or common.get("format") != FORMAT:
        raise CheckpointError(f"{path / (COMMON + '.json')}: not a {FORMAT} checkpoint (format "
                              f"{common.get('format') if isinstance(common, dict) else None!r}): upgrade zerofit "
                              "or load a checkpoint written by this version")
    return common


def load_state(directory: str | os.PathLike[str], engine) -> dict:
    """Collective: load a `save_state` checkpoint into `engine` (any world size, stage, offload);
    returns this rank's `extra_state`. A directory holding a `latest` file loads the one it names."""
    ranks = Ranks(engine.comm.group)
    with engine.state_by_group(write=True) as scope:  # nothing of the engine's may still be in flight
        path, common = _load_tensors(directory, engine, ranks, scope)
        engine.refresh_params(published=True)
    engine.scaler.load_state_dict(common["scaler"])
    engine.window.micro_step = int(common["micro_step"])
    saved_world = int(common["world_size"])
    source = ranks.rank if ranks.rank < saved_world else ranks.rank % saved_world
    if source != ranks.rank:
        warnings.warn(f"the checkpoint was saved by {saved_world} ranks: rank {ranks.rank} gets the "
                      f"extra_state of rank {source} (per-rank RNG streams repeat)", stacklevel=2)
    error, extra = None, {}
    try:  # each rank reads its own file: a failure here must reach the agreement, or the others would wait
        extra = read_tree(path, rank_stem(source))
    except CheckpointError as e:
        error = f"rank {ranks.rank}: {e}"
    except Exception as e:  # noqa: BLE001 - read_tree names what it expects; anything else still agrees
        error = f"rank {ranks.rank}: {path / rank_stem(source)}.json: unreadable ({type(e).__name__}: {e}): " \
                "the checkpoint is damaged or was edited; load an earlier checkpoint"
    ranks.agree(error)
    return extra


PROBE = 8
"""Elements of each frozen parameter a checkpoint without the frozen weights records, spread evenly over it
(the first would often be a padding row of zeros) ([Note: a checkpoint without the frozen weights])."""


def base_probe(frags) -> dict[str, dict]:
    """{name: {"dtype", "values": {position: value}}} for the probed positions of each frozen parameter that
    these fragments hold (a parameter split over ranks gives each rank's part; `merge_probes` joins them)."""
    out: dict[str, dict] = {}
    for f in frags:
        if f.trainable or "param" not in f.tensors:
            continue
        held = [i for i in sorted({k * f.numel // PROBE for k in range(PROBE)}) if f.start <= i < f.start + f.length]
        if not held:
            continue
        values = f.tensors["param"][torch.tensor([i - f.start for i in held])].double().tolist()
        entry = out.setdefault(f.name, {"dtype": str(f.dtype).removeprefix("torch."), "values": {}})
        entry["values"].update({str(i): v for i, v in zip(held, values) if math.isfinite(v)})
    return out


def merge_probes(parts: list[dict[str, dict]]) -> dict[str, dict]:
    """Every rank's `base_probe`, as one."""
    out: dict[str, dict] = {}
    for part in parts:
        for name, entry in part.items():
            out.setdefault(name, {"dtype": entry["dtype"], "values": {}})["values"].update(entry["values"])
    return out


def _check_base(path: Path, common: dict, engine) -> str | None:
    """A checkpoint without the frozen weights, loaded into a model whose frozen parameters are another base's:
    the error (None: the same base, or a checkpoint with its frozen weights)."""
    problems = other_base(common.get("frozen_probe") or {}, local_fragments(engine.groups, engine.optimizer, 0))
    if not problems:
        return None
    return (f"{path}: saved without its frozen weights (exclude_frozen_parameters), from another base than this "
            f"model's: " + "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
            + ": build the model from the base the run was saved with (the same from_pretrained path and dtype) "
            "before loading it")


def other_base(saved: dict[str, dict], frags) -> list[str]:
    """The frozen parameters among these fragments whose probed values differ from the saved probe's: exactly
    where the dtypes agree, within the coarser dtype's rounding where they differ."""
    problems = []
    for name, here in base_probe(frags).items():
        probe = saved.get(name)
        if probe is None:
            continue
        coarse = max(torch.finfo(getattr(torch, probe["dtype"])).eps, torch.finfo(getattr(torch, here["dtype"])).eps)
        tol = 0.0 if probe["dtype"] == here["dtype"] else coarse
        pairs = [(i, probe["values"][i], v) for i, v in here["values"].items() if i in probe["values"]]
        wrong = [(i, a, b) for i, a, b in pairs if abs(a - b) > tol * max(abs(a), abs(b))]
        if wrong:
            i, a, b = wrong[0]
            problems.append(f"{name}[{i}] (flattened) is {a:.6g} ({probe['dtype']}) in the checkpoint, {b:.6g} "
                            f"({here['dtype']}) here")
    return problems


def _check_model(path: Path, common: dict, engine) -> str | None:
    source = str(path / f"{COMMON}.json")
    saved = {e.name: e for e in (Entry.from_json(d, source) for d in common["params"])}
    mine = {e.name: e for e in param_entries(engine)}
    problems = []
    for label, names in (("parameters the checkpoint lacks", [n for n in mine if n not in saved]),
                         ("parameters the model lacks", [n for n in saved if n not in mine])):
        if names:
            problems.append(f"{label}: {names[:5]}" + (f" (+{len(names) - 5} more)" if len(names) > 5 else ""))
    wrong = [f"{n} {saved[n].shape} saved, {e.shape} here" for n, e in mine.items()
             if n in saved and saved[n].shape != e.shape]
    if wrong:
        problems.append("other shapes: " + "; ".join(wrong[:5]))
    if not problems:
        return None
    return f"{source}: the checkpoint was saved from a different model ({'; '.join(problems)}): load a " \
           "checkpoint of this model"


def _prepare_optimizer(path: Path, common: dict, opt, codec) -> None:
    """Restore param-group settings and create the state tensors the checkpoint will be read into, in the
    form `codec` this run stores them in."""
    saved = common.get("optimizer")
    if opt is None or saved is None:
        return
    if len(saved["groups"]) != len(opt.param_groups):
        raise CheckpointError(f"{path / (COMMON + '.json')}: {len(saved['groups'])} optimizer param groups "
                              f"saved, this optimizer has {len(opt.param_groups)}: build the optimizer with "
                              "the same param groups as the run that saved it")
    for group, g in zip(opt.param_groups, saved["groups"]):
        for key, value in g["hyper"].items():
            if key not in _IMPLEMENTATION_KEYS:
                group[key] = value
        for t in group["params"]:
            if not is_stand_in(t):  # whole parameters get theirs from `chunks_to_load`
                opt.state[t] = {}  # replace, never merge with, whatever state the optimizer had
    allocate_optimizer_state(opt, list(saved["state_keys"]), [g for g in saved["groups"]], codec)


def _restore_param_scalars(engine, common: dict, groups: list) -> None:
    """Parameters of `groups` whose step count differs from their group's get their own back (see
    `fragment_scalars`). Their masters must be in memory: fragments find their pieces by address."""
    saved = (common.get("optimizer") or {}).get("param_scalars") or {}
    if saved and engine.optimizer is not None:
        restore_param_scalars(local_fragments(groups, engine.optimizer, 0), saved)


def _load_tensors(directory, engine, ranks: Ranks, scope) -> tuple[Path, dict]:
    """Check the checkpoint at `directory` against `engine` and read its tensors in, the groups as `scope`
    (`ZeroEngine.state_by_group`) allows: those in memory at once, then each NVMe-offloaded group alone, written
    back to its file once read ([Note: saving from NVMe]). Returns the checkpoint's path and common record."""
    error, path = None, Path(directory)
    try:
        path = files.resolve(directory)
    except CheckpointError as e:
        error = str(e)
    ranks.agree(error)
    verify(path, ranks)
    common: dict = {}
    try:
        common = read_common(path)
        error = _check_model(path, common, engine) or _check_base(path, common, engine)
    except CheckpointError as e:
        error = str(e)
    except (KeyError, TypeError, ValueError) as e:  # valid JSON of the wrong shape
        error = f"{path / (COMMON + '.json')}: malformed ({type(e).__name__}: {e}): load an earlier checkpoint"
    ranks.agree(error)
    codec = loading_codec(engine)
    _prepare_optimizer(path, common, engine.optimizer, codec)
    saved_optimizer = (common.get("optimizer") or {}) if engine.optimizer is not None else {}
    state_load = StateLoad(saved_optimizer.get("state_forms") or {}, codec, saved_optimizer.get("state_keys", []))
    index, error = {}, None
    try:
        index = read_index(path / STATE_DIR)
    except CheckpointError as e:
        error = str(e)
    ranks.agree(error)
    batches = _batches(engine.groups, scope)
    reads = max(ranks.all_gather(len(batches)))  # each read is collective: a rank with fewer reads an empty one
    batches += [(None, [])] * (reads - len(batches))
    for part, (one, groups) in enumerate(batches, 1):
        with scope(one) if one is not None else contextlib.nullcontext():
            _restore_param_scalars(engine, common, groups)
            chunks, copies = _load_chunks(engine, common, state_load, groups, buffers=part == 1)
            if engine.optimizer is not None and part == 1:  # [Note: whole-parameter steps]: by parameter
                chunks.update(chunks_to_load(engine, (common.get("optimizer") or {}).get("whole_state") or {}))
            problems = missing_ranges(index, chunks)
            ranks.agree(f"{path / STATE_DIR}: " + "; ".join(problems[:5]) +
                        (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "") +
                        ": the checkpoint does not match this model; load one saved from it" if problems else None)
            read_chunks(path / STATE_DIR, chunks, ranks.group)
            state_load.convert()
            with torch.no_grad():
                for dst, src in copies:
                    dst.copy_(src.view_as(dst))
                for g in groups:  # while its master is in memory (`refresh_params` gathers them after)
                    if g.trainable:
                        g.publish_master()
    state_load.finish(path, ranks.is_main)
    return path, common


def _load_chunks(engine, common: dict, state_load: StateLoad, groups: list, *,
                 buffers: bool) -> tuple[dict[str, Chunk], list]:
    """The chunks this rank reads for `groups` (and the model's buffers with `buffers`), and (destination,
    buffer) copies for non-contiguous buffers."""
    saved_kind = {d["name"]: d["kind"] for d in common["params"]}
    kept = "param" if common.get("frozen_excluded") else None  # [Note: a checkpoint without the frozen weights]
    chunks: dict[str, Chunk] = {}
    for f in local_fragments(groups, engine.optimizer, 0):  # 0: replicated groups too, on every rank
        stored = saved_kind[f.name]  # frozen <-> trainable changes read the values that were saved
        for key, t in f.tensors.items():
            if key in ("master", "param") and stored != kept:
                chunks[f"{stored}/{f.name}"] = Chunk(t, f.start, f.numel)
        if stored == "master":
            chunks.update(state_load.chunks(f))
    copies = []
    for name, buf in persistent_buffers(engine.model) if buffers else ():
        if not buf.numel():
            continue
        flat = buf.view(-1) if buf.is_contiguous() else torch.empty(buf.numel(), dtype=buf.dtype, device=buf.device)
        if flat.data_ptr() != buf.data_ptr():
            copies.append((buf, flat))
        chunks[f"buffer/{name}"] = Chunk(flat, 0, buf.numel())
    return chunks, copies

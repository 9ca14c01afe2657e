"""A user's Accelerate loop on a pretrained checkpoint from disk: load, prepare, train, save, check.

    python benchmarks/trainer_clm.py --make_checkpoint DIR --hidden 5120 --layers 40 --heads 40 --intermediate 13824
    zerofit launch --config_file auto.yaml benchmarks/pretrained.py --model DIR --result r.json [--save SAVE_DIR]

What the script does is what a user's does (#29): `AutoModelForCausalLM.from_pretrained(DIR, dtype=bfloat16)`
(bf16 safetensors, memory-mapped), `torch.optim.AdamW`, `accelerator.prepare(model, optimizer, loader)`,
`model.train()`, `--steps` steps of a fixed synthetic token batch, then `save_pretrained(state_dict=
accelerator.get_state_dict(model), is_main_process=...)` on every rank, as Accelerate's examples do. The
saved folder is read back and every tensor checked: present, not empty, the shape the model has; with
`--check-values` also every value, of the prepared model against the checkpoint and of the saved folder against
the trained model (gathered one layer at a time). `--save-with save_model` saves through `accelerator.save_model`
(one shard at a time) and `--drop-input` deletes the checkpoint once prepared, for a disk that holds one copy.

Rank 0 prints one line starting `pretrained:` (and writes it to `--result`): the step times (CUDA
synchronised at each step's end), their median after `--warmup`, losses, the load / prepare / save
seconds, the GPU peak in each phase, the host peak RSS, and the setting the engine ran. A CUDA
out-of-memory error is caught, the phase it happened in is recorded with `torch.cuda.memory_summary()`,
and with `ZEROFIT_BENCH_MEMORY_HISTORY=1` the largest live allocations at the failure with the Python
frames that made them (`torch.cuda.memory._record_memory_history`) go to `<result>.oom.txt`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import traceback

import torch
import transformers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint folder (benchmarks/trainer_clm.py --make_checkpoint)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    p.add_argument("--batch", type=int, default=8, help="micro-batch per process")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--save", default=None, help="save_pretrained here after training, then check what was written")
    p.add_argument("--save-with", choices=("save_pretrained", "save_model"), default="save_pretrained",
                   help="save_pretrained(state_dict=get_state_dict(...)) (a full host copy on the main process), "
                        "or accelerator.save_model (one shard at a time: for a model whose copy the host cannot hold)")
    p.add_argument("--check-values", action="store_true",
                   help="every tensor's values: the prepared model against the checkpoint, the saved folder against "
                        "the trained model (not only names and shapes)")
    p.add_argument("--drop-input", action="store_true",
                   help="delete the checkpoint folder once prepared and checked (a disk that cannot hold the input "
                        "and the save together; the run reads nothing from it after prepare)")
    p.add_argument("--result", default=None, help="where rank 0 writes its JSON record")
    p.add_argument("--fp32", action="store_true", help="load in fp32 (the CPU check)")
    p.add_argument("--no-loader", dest="loader", action="store_false",
                   help="prepare(model, optimizer) only and feed the batch by hand (the planner sees no batch shape)")
    p.add_argument("--mode", choices=("train", "none", "eval"), default="train",
                   help="after prepare(): model.train() (default), nothing (the model stays as from_pretrained "
                        "returned it, in eval mode), or model.eval() (training forwards in eval mode)")
    return p.parse_args(argv)


class Phases:
    """GPU peak and wall time per phase of the run (load, prepare, train, save)."""

    def __init__(self):
        self.record: dict[str, dict[str, float]] = {}
        self.current: str | None = None
        self._start = 0.0

    def enter(self, name: str) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.current, self._start = name, time.perf_counter()

    def leave(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        entry = {"s": time.perf_counter() - self._start, "host_rss_peak_gib": _host_peak_gib()}
        if torch.cuda.is_available():
            entry["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            entry["gpu_after_gib"] = torch.cuda.memory_allocated() / 2**30
        self.record[self.current] = entry
        self.current = None


def _host_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def check_saved(folder: str, model: torch.nn.Module | None) -> dict[str, object]:
    """Every tensor the saved folder holds, against the model's own names and shapes (None: no shapes compared;
    `compare_values` compares them)."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()} if model is not None else {}
    empty = [k for k, s in shapes.items() if 0 in s]
    wrong = [k for k, s in shapes.items() if k in expected and expected[k] != s and expected[k] != (0,)]
    return {"files": len(files), "tensors": len(shapes), "empty": empty[:5], "n_empty": len(empty),
            "wrong_shape": wrong[:5], "bytes": sum(os.path.getsize(os.path.join(folder, f)) for f in files)}


def _layer_batches(names: list[str]) -> list[list[str]]:
    """The model's entry names in groups of one decoder layer each (and one of the rest): what one
    `get_state_dict(keys=...)` call gathers, so the host holds one layer's full tensors at a time."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        key = ".".join(parts[:parts.index("layers") + 2]) if "layers" in parts else ""
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def compare_values(accelerator, model, folder: str) -> dict[str, object]:
    """Collective: every entry of the prepared model's state, gathered one layer at a time, against the tensor
    of that name in the safetensors files of `folder` (exact equality; the dtype and shape must match too)."""
    from safetensors import safe_open

    files = {}
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        handle = safe_open(os.path.join(folder, name), framework="pt")
        files.update({key: handle for key in handle.keys()})
    names = entry_names(accelerator.unwrap_model(model))
    checked, missing, differ = 0, [], []
    for keys in _layer_batches(names):
        state = accelerator.get_state_dict(model, keys=keys)
        if not accelerator.is_main_process:
            continue
        for key in keys:
            if key not in files:
                missing.append(key)
                continue
            stored = files[key].get_tensor(key)
            ours = state[key]
            if stored.dtype != ours.dtype or stored.shape != ours.shape or not torch.equal(stored, ours.cpu()):
                differ.append(key)
            checked += 1
    extra = sorted(set(files) - set(names))
    return {"checked": checked, "missing": missing[:5], "n_missing": len(missing), "differ": differ[:5],
            "n_differ": len(differ), "not_in_model": extra[:5], "n_not_in_model": len(extra)}


def entry_names(model: torch.nn.Module) -> list[str]:
    """The names `state_dict()` would have (parameters, persistent buffers), without calling it: under ZeRO-3
    `state_dict()` gathers every parameter onto the host."""
    names = [n for n, _ in model.named_parameters()]
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                names.append(f"{module_name}.{name}" if module_name else name)
    return names


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from zerofit import Accelerator

    history = os.environ.get("ZEROFIT_BENCH_MEMORY_HISTORY") == "1" and torch.cuda.is_available()
    if history:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    phases = Phases()
    accelerator = Accelerator()
    record: dict[str, object] = {"model": args.model, "batch": args.batch, "seq": args.seq,
                                 "world_size": accelerator.num_processes}
    try:
        phases.enter("load")
        dtype = torch.float32 if args.fp32 else torch.bfloat16
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        record["parameters"] = sum(p.numel() for p in model.parameters())
        phases.leave()
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (args.batch * accelerator.num_processes, args.seq), generator=g)
        rows = [{"input_ids": r, "labels": r} for r in ids]
        loader = torch.utils.data.DataLoader(rows, batch_size=args.batch)
        phases.enter("prepare")
        if args.loader:
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        else:  # the batch goes to the model's device by hand, as scripts without a prepared loader do
            model, optimizer = accelerator.prepare(model, optimizer)
            loader = [{k: v.to(accelerator.device) for k, v in b.items()} for b in loader]
        phases.leave()
        if args.check_values:
            phases.enter("check_loaded")
            record["loaded_values"] = compare_values(accelerator, model, args.model)
            phases.leave()
        if args.drop_input:
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                import shutil

                shutil.rmtree(args.model)
                record["disk_free_gib_after_drop"] = shutil.disk_usage(os.path.dirname(os.path.abspath(args.model)) or
                                                                       ".").free / 2**30
            accelerator.wait_for_everyone()
        if args.mode != "none":
            getattr(model, args.mode)()
        record["mode"] = {"asked": args.mode, "training": model.training, "loader_prepared": args.loader}
        batch = next(iter(loader))
        phases.enter("train")
        marks, losses = [time.perf_counter()], []
        for _ in range(args.steps):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())  # synchronises: the step's work is done
            marks.append(time.perf_counter())
        phases.leave()
        times = [b - a for a, b in zip(marks, marks[1:])]
        record.update(step_s=times, losses=losses,
                      median_step_s=statistics.median(times[args.warmup:] or times))
        if args.save:
            phases.enter("save")
            accelerator.wait_for_everyone()
            if args.save_with == "save_model":
                accelerator.save_model(model, args.save)
            else:
                state = accelerator.get_state_dict(model)
                accelerator.unwrap_model(model).save_pretrained(args.save, state_dict=state,
                                                                is_main_process=accelerator.is_main_process,
                                                                save_function=accelerator.save)
                del state
            accelerator.wait_for_everyone()
            phases.leave()
            if accelerator.is_main_process:
                record["saved"] = check_saved(args.save, None if args.check_values else accelerator.unwrap_model(model))
            if args.check_values:
                phases.enter("check_saved")
                record["saved_values"] = compare_values(accelerator, model, args.save)
                phases.leave()
    except torch.OutOfMemoryError as e:
        record["oom"] = {"phase": phases.current, "error": str(e).splitlines()[0],
                         "traceback": traceback.format_exc()[-3000:]}
        if torch.cuda.is_available():
            record["oom"]["summary"] = torch.cuda.memory_summary(abbreviated=True)
        if history and args.result:
            _write_largest(args.result + ".oom.txt")
    engine_setting = getattr(accelerator, "config", None)
    if engine_setting is not None:
        z = engine_setting.zero
        record["setting"] = {"stage": z.stage, "offload_optimizer": z.offload_optimizer.device,
                             "ratio": z.offload_optimizer.ratio, "offload_param": z.offload_param.device,
                             "checkpointing": z.gradient_checkpointing}
    record["phases"] = phases.record
    record["host_rss_peak_gib"] = _host_peak_gib()
    record["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    if accelerator.is_main_process:
        if args.result:
            with open(args.result, "w") as f:
                json.dump(record, f, indent=1, default=str)
        print("pretrained: " + json.dumps({k: v for k, v in record.items() if k != "oom"}, default=str), flush=True)
        if "oom" in record:
            print("pretrained: OUT OF MEMORY in phase", record["oom"]["phase"], "\n" + record["oom"]["traceback"],
                  flush=True)
    if "oom" in record:
        sys.exit(3)


def _write_largest(path: str, top: int = 40) -> None:
    """The largest live CUDA allocations at the failure, each with the frames that made it."""
    snap = torch.cuda.memory._snapshot()
    blocks = []
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                frames = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
                          for f in b.get("frames", []) if f["filename"].endswith(".py")]
                blocks.append((b["size"], frames[:12]))
    blocks.sort(key=lambda x: -x[0])
    by_site: dict[str, list[int]] = {}
    for size, frames in blocks:
        site = " <- ".join(frames[:6])
        by_site.setdefault(site, []).append(size)
    with open(path, "w") as f:
        f.write(f"{len(blocks)} live blocks, {sum(s for s, _ in blocks) / 2**30:.2f} GiB\n\n")
        for site, sizes in sorted(by_site.items(), key=lambda kv: -sum(kv[1]))[:top]:
            f.write(f"{sum(sizes) / 2**30:8.2f} GiB in {len(sizes):5d} blocks: {site}\n")


if __name__ == "__main__":
    main()

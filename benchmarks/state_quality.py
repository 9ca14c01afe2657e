"""Optimizer state in fp32, bf16 and 8 bits: the loss curves of one training run per setting (issue #39, "Quality").

    python benchmarks/state_quality.py --build-corpus OUT/corpus                      # the text, once
    python benchmarks/state_quality.py --row zerofit-8bit --corpus OUT/corpus --out OUT   # one row, its own process
    python benchmarks/state_quality.py --summary OUT      # OUT/summary.md, and OUT/state_quality.png with matplotlib
    python benchmarks/state_quality.py --plot OUT         # docs/img/state_quality.png from OUT/*.json
    bash benchmarks/state_quality_gpu.sh OUT              # every row and the summary, one device call
    bash benchmarks/state_quality_gpu.sh --tiny OUT       # the same on the CPU with a tiny model (--tiny here)

Rows (ROWS): `zerofit-fp32`, `zerofit-bf16`, `zerofit-8bit` are `ZeroEngine` at ZeRO-2 on one device, no offload,
bf16 compute from bf16 parameters with fp32 masters, `precision.optimizer_state` fp32 / bf16 / 8bit, stepping
torch's AdamW (fused on CUDA); `torch-adamw` is plain PyTorch (fp32 weights, bf16 autocast, torch's fused AdamW);
`torchao-8bit` is the same with `torchao.optim.AdamW8bit` (a row saying so when torchao is not importable). The two
regimes differ (bf16 weights + fp32 masters vs fp32 weights under autocast), so each narrow row is compared with the
fp32-state row of its own regime: zerofit's with `zerofit-fp32`, torchao's with `torch-adamw`.

Model: the GPT-2 XL architecture (n_embd 1600, 48 layers, 25 heads) with a byte vocabulary (257: 256 bytes and a
padding id that never occurs), **random init** (seed 0, the same weights in every row): no pretrained weights can be
fetched on the lent machine, so this is training from scratch on real text, not a fine-tune of a pretrained model.
Dropout off, so rows differ only by the optimizer. Batch 16 x 128 bytes, AdamW lr 1e-4 (betas 0.9/0.999, eps 1e-8,
weight decay 0.01), linear warm-up over 30 steps then cosine to 0.1 x lr at the last step, gradient clipping 1.0,
300 steps. Every row reads the same windows in the same order (seeded, `data_sha` in each record).

Corpus (`build_corpus`): the `.py`, `.md`, `.txt` and `.rst` files of the running Python's standard library and of
the installed `torch` and `transformers` packages (code, docstrings, English prose), each between 1 byte and 256 KiB
and valid UTF-8, named by root and relative path ("stdlib/...", "torch/...", "transformers/..."), sorted, then
shuffled with `random.Random(0)`. Whole files fill the held-out slice first (EVAL_BYTES), then the training text
(TRAIN_BYTES, the last file cut), each file followed by a blank line. Tokens are the bytes. Another Python, torch or
transformers version gives another corpus: `corpus.json` records the versions, file count and sha256.

Measured: the training loss of every step (of its batch, before the step's update); the held-out loss (EVAL_BATCHES
fixed batches) before training, every `--eval-every` steps and at the end. `--deadline` (epoch seconds) stops a row
early with what it has (`stopped_early`); each record is rewritten at every held-out evaluation, so a killed row
still leaves its curve so far.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import sys
import time

import torch

ROWS = ["zerofit-fp32", "zerofit-bf16", "zerofit-8bit", "torch-adamw", "torchao-8bit"]
REFERENCE = {"zerofit-bf16": "zerofit-fp32", "zerofit-8bit": "zerofit-fp32", "torchao-8bit": "torch-adamw",
             "zerofit-fp32": "torch-adamw"}
"""Each row's fp32-state row of the same precision regime (zerofit-fp32 against torch-adamw: across regimes)."""
EXTENSIONS = (".py", ".md", ".txt", ".rst")
MAX_FILE_BYTES = 256 * 1024
VOCAB = 257
WEIGHT_DECAY = 0.01
FULL = dict(n_embd=1600, n_layer=48, n_head=25, batch=16, seq=128, steps=300, warmup=30, lr=1e-4, eval_every=50,
            eval_batches=4, train_bytes=40 * 2**20, eval_bytes=2**20, gap_from=50, window=20, clip=1.0)
TINY = dict(FULL, n_embd=64, n_layer=2, n_head=2, batch=4, seq=32, steps=100, warmup=10, lr=1e-3, eval_every=20,
            eval_batches=2, train_bytes=2 * 2**20, eval_bytes=2**16, gap_from=20, window=10)


# ---- corpus ------------------------------------------------------------------------------------------------------

def corpus_roots() -> dict[str, str]:
    import sysconfig

    import transformers

    return {"stdlib": sysconfig.get_paths()["stdlib"], "torch": os.path.dirname(torch.__file__),
            "transformers": os.path.dirname(transformers.__file__)}


def build_corpus(prefix: str, train_bytes: int, eval_bytes: int) -> dict:
    """Write `prefix.bin` (held-out slice, then training text) and `prefix.json` (how it was made)."""
    import transformers

    names = []
    for label, root in corpus_roots().items():
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "site-packages")]  # stdlib's venv copies none
            names += [(label, os.path.relpath(os.path.join(folder, f), root)) for f in files if f.endswith(EXTENSIONS)]
    names.sort()
    random.Random(0).shuffle(names)
    roots = corpus_roots()
    parts: list[bytes] = []
    size, eval_end, used = 0, None, 0
    for label, rel in names:
        path = os.path.join(roots[label], rel)
        if not 0 < os.path.getsize(path) <= MAX_FILE_BYTES:
            continue
        with open(path, "rb") as f:
            data = f.read()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        parts.append(data + b"\n\n")
        size += len(data) + 2
        used += 1
        if eval_end is None and size >= eval_bytes:
            eval_end = size  # whole files only: the held-out text shares no file with the training text
        if eval_end is not None and size >= eval_end + train_bytes:
            break
    blob = b"".join(parts)[:eval_end + train_bytes]
    if eval_end is None or len(blob) < eval_end + train_bytes // 2:
        raise SystemExit(f"--corpus-bytes {train_bytes}: only {len(blob)} bytes of text found under "
                         f"{sorted(roots.values())}; ask for fewer bytes")
    with open(prefix + ".bin", "wb") as f:
        f.write(blob)
    meta = {"eval_bytes": eval_end, "train_bytes": len(blob) - eval_end, "files": used, "candidates": len(names),
            "sha256": hashlib.sha256(blob).hexdigest(), "roots": roots, "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__}
    with open(prefix + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def load_corpus(prefix: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(held-out bytes, training bytes, meta) as uint8 tensors."""
    with open(prefix + ".json") as f:
        meta = json.load(f)
    with open(prefix + ".bin", "rb") as f:
        blob = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    return blob[:meta["eval_bytes"]], blob[meta["eval_bytes"]:], meta


def window_starts(n_bytes: int, seq: int, batches: int, batch: int, seed: int) -> torch.Tensor:
    """[batches, batch] start offsets of `seq`-byte windows (seeded: the same in every row)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_bytes - seq, (batches, batch), generator=g)


def windows(text: torch.Tensor, starts: torch.Tensor, seq: int, device: torch.device) -> torch.Tensor:
    return text[starts[:, None] + torch.arange(seq)].long().to(device)


# ---- one row -----------------------------------------------------------------------------------------------------

def lr_at(step: int, args) -> float:
    """Learning rate of 0-based `step`: linear warm-up, then cosine down to 0.1 x lr at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    done = (step - args.warmup) / max(1, args.steps - 1 - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, done))))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):  # torchao keeps lr as a tensor and refuses a float there
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def build_model(args, device: torch.device):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head, vocab_size=VOCAB,
                        n_positions=max(1024, args.seq), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        return GPT2LMHeadModel(config)


def make_row(row: str, args, device: torch.device):
    """(optimizer, train_step(ids) -> loss, eval_loss(ids) -> loss) for one row."""
    model = build_model(args, device)
    params = [p for p in model.parameters() if p.requires_grad]
    if row == "torchao-8bit":
        from torchao.optim import AdamW8bit

        optimizer = AdamW8bit(params, lr=args.lr, weight_decay=WEIGHT_DECAY)
    else:
        optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=WEIGHT_DECAY,
                                      fused=True if device.type == "cuda" else None)
    if row.startswith("zerofit-"):
        from zerofit.config.schema import PrecisionConfig, ZeroConfig
        from zerofit.engine import ZeroEngine

        engine = ZeroEngine(model, optimizer, zero=ZeroConfig(stage=2), device=device, gradient_clipping=args.clip,
                            precision=PrecisionConfig(mixed_precision="bf16", optimizer_state=row.split("-")[1]))

        def train_step(ids):
            loss = model(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return torch.stack([loss.detach().float(), engine.last_grad_norm.float()])

        autocast = False
    else:
        def train_step(ids):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, args.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return torch.stack([loss.detach().float(), norm.float()])

        autocast = True

    @torch.no_grad()
    def eval_loss(batches) -> float:
        total = 0.0
        for ids in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                total += float(model(input_ids=ids, labels=ids).loss)
        return total / len(batches)

    return optimizer, train_step, eval_loss


def environment(device: torch.device) -> dict:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"}
    try:
        import torchao

        out["torchao"] = torchao.__version__
    except ImportError:
        pass
    return out


def run_row(row: str, args) -> dict:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    record = {"row": row, "reference": REFERENCE.get(row), "config": {k: getattr(args, k) for k in FULL},
              "environment": environment(device)}
    path = os.path.join(args.out, f"{row}.json")
    if row == "torchao-8bit":
        try:
            import torchao.optim  # noqa: F401
        except Exception as e:  # ImportError, or torchao built for another torch failing at import
            record["skipped"] = f"torchao is not importable here ({type(e).__name__}: {e})"
            _write(path, record)
            print(f"[{row}] skipped: {record['skipped']}", flush=True)
            return record
    eval_text, train_text, meta = load_corpus(args.corpus)
    record["corpus"] = {k: meta[k] for k in ("sha256", "files", "train_bytes", "eval_bytes")}
    starts = window_starts(len(train_text), args.seq, args.steps, args.batch, seed=1234)
    record["data_sha"] = hashlib.sha256(starts.numpy().tobytes()).hexdigest()[:16]
    # every batch on the device up front (300 x 16 x 128 ids, 4.9 MB): a copy from pageable memory per step would
    # wait for the device and keep the host from queueing the next step ahead
    train_ids = windows(train_text, starts.flatten(), args.seq, device).view(args.steps, args.batch, args.seq)
    eval_batches = [windows(eval_text, s, args.seq, device)
                    for s in window_starts(len(eval_text), args.seq, args.eval_batches, args.batch, seed=4321)]
    t_start = time.perf_counter()
    optimizer, train_step, eval_loss = make_row(row, args, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the construction's transients go back: another row may share this GPU
        torch.cuda.reset_peak_memory_stats(device)
    record["build_s"] = time.perf_counter() - t_start
    record.update(train_loss=[], grad_norm=[], eval=[[0, eval_loss(eval_batches)]], lr=[], step_s=[],
                  stopped_early=False)
    t_train = time.perf_counter()
    try:
        _train(record, args, device, optimizer, train_step, eval_loss, (train_ids, eval_batches), t_train)
    except BaseException as e:  # out of memory beside another row, say: the record says so, the script reruns it
        record["error"] = f"{type(e).__name__}: {e}"[:2000]
        _finish(record, device, t_train)
        _write(path, record)
        raise
    print(f"[{row}] done: {len(record['train_loss'])} steps in {record['train_s']:.1f}s, "
          f"eval {record['eval'][-1][1]:.4f}", flush=True)
    return record


def _drain(record: dict, pending: list[torch.Tensor]) -> None:
    """The (loss, gradient norm before clipping) of the steps not read yet, into the record."""
    if pending:
        both = torch.stack(pending).tolist()
        record["train_loss"] += [b[0] for b in both]
        record["grad_norm"] += [b[1] for b in both]
        pending.clear()


def _train(record, args, device, optimizer, train_step, eval_loss, data, t_train) -> None:
    train_ids, eval_batches = data
    path = os.path.join(args.out, f"{record['row']}.json")
    pending: list[torch.Tensor] = []  # losses not read yet: reading one waits for the device
    for step in range(args.steps):
        if args.deadline and time.time() >= args.deadline:
            record["stopped_early"] = f"--deadline reached after {step} steps"
            break
        t0 = time.perf_counter()
        lr = lr_at(step, args)
        set_lr(optimizer, lr)
        pending.append(train_step(train_ids[step]))
        record["lr"].append(lr)
        record["step_s"].append(time.perf_counter() - t0)
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps or done % 25 == 0:
            _drain(record, pending)
            if done % args.eval_every == 0 or done == args.steps:
                record["eval"].append([done, eval_loss(eval_batches)])
                _finish(record, device, t_train)
                _write(path, record)
            print(f"[{record['row']}] step {done}/{args.steps} loss {record['train_loss'][-1]:.4f} eval "
                  f"{record['eval'][-1][1]:.4f} (at {record['eval'][-1][0]}) {time.perf_counter() - t_train:.1f}s",
                  flush=True)
    _drain(record, pending)
    if record["eval"][-1][0] != len(record["train_loss"]):
        record["eval"].append([len(record["train_loss"]), eval_loss(eval_batches)])
    _finish(record, device, t_train)
    _write(path, record)


def _finish(record: dict, device: torch.device, t_train: float) -> None:
    """Wall time so far (evaluations and torchao's compilation included; another row may have shared the GPU, so
    this is no speed measurement) and the GPU memory peaks (reserved: what a row beside it could not use)."""
    record["train_s"] = time.perf_counter() - t_train
    if device.type == "cuda":
        record["gpu_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        record["gpu_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30


def _write(path: str, record: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # a row killed mid-write keeps its last whole record


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--build-corpus", metavar="PREFIX", help="write PREFIX.bin and PREFIX.json")
    mode.add_argument("--row", choices=ROWS, help="train one row, write OUT/<row>.json")
    mode.add_argument("--summary", metavar="DIR", help="DIR/summary.md (+ DIR/state_quality.png) from DIR/*.json")
    mode.add_argument("--plot", metavar="DIR", help="docs/img/state_quality.png (or --png) from DIR/*.json")
    p.add_argument("--tiny", action="store_true", help="a tiny model and run, for a check on the CPU")
    p.add_argument("--corpus", default="out/state_quality/corpus", help="the --build-corpus PREFIX")
    p.add_argument("--out", default="out/state_quality")
    p.add_argument("--png", default=None, help="--plot: where the PNG goes")
    p.add_argument("--deadline", type=float, default=0.0, help="epoch seconds: stop training then, keep the record")
    for k, v in FULL.items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v), default=None, help=f"default {v} (--tiny: {TINY[k]})")
    args = p.parse_args(argv)
    for k, v in (TINY if args.tiny else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.build_corpus:
        os.makedirs(os.path.dirname(os.path.abspath(args.build_corpus)), exist_ok=True)
        meta = build_corpus(args.build_corpus, args.train_bytes, args.eval_bytes)
        print(f"corpus: {meta['files']} files, {meta['eval_bytes']} held-out + {meta['train_bytes']} training bytes, "
              f"sha256 {meta['sha256'][:16]}", flush=True)
    elif args.row:
        os.makedirs(args.out, exist_ok=True)
        run_row(args.row, args)
    else:
        from state_quality_report import plot, write_summary

        if args.summary:
            print(write_summary(args.summary))
        else:
            png = args.png or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "img",
                                           "state_quality.png")
            plot(args.plot, png)
            print(f"wrote {png}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()

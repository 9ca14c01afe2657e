"""One training set-up per benchmark method, behind the same three verbs: train, evaluate, recover.

Methods (the row names of the tables):
- `ddp`: the plain PyTorch baseline: fp32 weights, bf16 autocast, fused AdamW, clipping; wrapped in
  DistributedDataParallel with several processes (what `accelerate launch` gives a plain script).
- `zerofit-sN[-offload]`: the Accelerate-style loop on `zerofit.Accelerator`, configured by the
  DeepSpeed JSON below written to a file, exactly as a user passes it.
- `deepspeed-sN[-offload]`: DeepSpeed's own engine with that same JSON.
- `fsdp2[-offload]`: `fully_shard` on every repeated block and the root, bf16 parameters with fp32
  reductions, optionally `CPUOffloadPolicy`.
- `...-compiled` (not DeepSpeed): the same set-up compiled the way its users compile it, with
  `--compile_backend` (default inductor): `torch.compile` around the DDP (or FSDP2) model, as torch's
  documentation does; for zerofit, `Accelerator(dynamo_backend=...)`, which compiles the prepared model in
  place (the way docs/accelerate.md recommends). The first step pays the compile: the worker times it apart.

Every set-up builds the workload's model on the compute device under the same seed (see
[Note: same start, same data] in `zerofit.bench.workloads`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import tempfile
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerofit.bench.workloads import Workload

LR = 1e-4
WEIGHT_DECAY = 0.01


COMPILED = "-compiled"


def split_compiled(method: str) -> tuple[str, bool]:
    """("zerofit-s2", True) for "zerofit-s2-compiled"; (method, False) for an eager row."""
    if method.endswith(COMPILED):
        return method[:-len(COMPILED)], True
    return method, False


def parse(method: str) -> tuple[str, int, bool]:
    """("zerofit", 3, True) for "zerofit-s3-offload" (and for "zerofit-s3-offload-compiled": see
    `split_compiled`); stage 0 for ddp, 3 for fsdp2."""
    base, compiled = split_compiled(method)
    parts = base.split("-")
    family = parts[0]
    if family not in ("ddp", "zerofit", "deepspeed", "fsdp2"):
        raise ValueError(f"unknown method {method!r}: use ddp, zerofit-sN[-offload], deepspeed-sN[-offload] or "
                         "fsdp2[-offload]")
    stage = {"ddp": 0, "fsdp2": 3}.get(family)
    if stage is None:
        if len(parts) < 2 or parts[1] not in ("s0", "s1", "s2", "s3"):
            raise ValueError(f"method {method!r}: name the ZeRO stage, e.g. {family}-s2")
        stage = int(parts[1][1])
    offload = parts[-1] == "offload"
    if offload and stage < 2 and family != "fsdp2":
        raise ValueError(f"method {method!r}: optimizer offload needs stage 2 or 3")
    if compiled and family == "deepspeed":
        raise ValueError(f"method {method!r}: DeepSpeed rows are not compiled here (DeepSpeed compiles through "
                         f"its own engine.compile()); drop {COMPILED!r}, or compare ddp{COMPILED}, "
                         f"zerofit-sN{COMPILED} or fsdp2{COMPILED}")
    return family, stage, offload


def deepspeed_json(stage: int, offload: bool, *, bf16: bool, clip: float, micro_batch: int) -> dict[str, Any]:
    """The one config both zerofit and DeepSpeed rows run: what a user writes for this setting."""
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": clip, "bf16": {"enabled": bf16}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


class Runner:
    """A prepared model and optimizer: `train(batch)` one step, `evaluate(batch)` one forward."""

    model: nn.Module
    compiled: str | None = None
    """How a `-compiled` row compiled its model (for the record); None: eager."""

    def train(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.model.eval()
        try:
            with torch.no_grad(), self._autocast():
                return self.model(**batch).loss.detach()
        finally:
            self.model.train()

    def recover(self) -> None:
        """After an out-of-memory error in `train`/`evaluate`: drop the partial step, free memory."""
        _free()

    def config(self) -> dict[str, Any]:
        """The resolved settings of this row, for the JSON record."""
        return {}

    def _autocast(self):
        return contextlib.nullcontext()


class TorchLoopRunner(Runner):
    """The loop a plain PyTorch script runs: backward, clip, step (set up by the subclasses)."""

    optimizer: torch.optim.Optimizer
    clip: float
    autocast: torch.device | None = None
    """Where forward runs under bf16 autocast (plain PyTorch); None where the wrapper casts (FSDP2)."""

    def _autocast(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.autocast.type, dtype=torch.bfloat16)

    def train(self, batch):
        with self._autocast():
            loss = self.model(**batch).loss
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_([p for g in self.optimizer.param_groups for p in g["params"]], self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def recover(self):
        self.optimizer.zero_grad(set_to_none=True)
        _free()


class PlainRunner(TorchLoopRunner):
    def __init__(self, model: nn.Module, device: torch.device, *, bf16: bool, clip: float, world: int):
        self.clip, self.autocast = clip, device if bf16 else None
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        self.model = model

    def config(self):
        return {"optimizer": "torch.optim.AdamW(fused=True)", "autocast": "bf16" if self.autocast else None,
                "gradient_clipping": self.clip}


class ZerofitRunner(Runner):
    def __init__(self, model: nn.Module, ds_config: dict[str, Any], *, process_group_timeout: float | None = None,
                 compile_backend: str | None = None):
        from zerofit import Accelerator
        from zerofit.frontend.utils import DummyOptim, InitProcessGroupKwargs

        # as an Accelerate script sets it: zerofit's engine creates the group
        handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=process_group_timeout))] \
            if process_group_timeout else None
        self.ds_config = ds_config
        self.compiled = None if compile_backend is None else f"Accelerator(dynamo_backend={compile_backend!r})"
        fd, self.path = tempfile.mkstemp(prefix="zerofit-bench-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(ds_config, f)
        try:
            # a compiled row: what an Accelerate script asks for; prepare() compiles the model in place
            self.accelerator = Accelerator(config=self.path, kwargs_handlers=handlers, dynamo_backend=compile_backend)
            self.model, self.optimizer = self.accelerator.prepare(model, DummyOptim(model.parameters()))
        finally:
            os.unlink(self.path)

    def train(self, batch):
        loss = self.model(**batch).loss
        self.accelerator.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.detach()

    def recover(self):
        from zerofit.frontend.planning.backoff import discard_partial_step

        discard_partial_step(self.optimizer.engine)

    def config(self):
        return {"deepspeed_json": self.ds_config}


class DeepSpeedRunner(Runner):
    def __init__(self, model: nn.Module, ds_config: dict[str, Any]):
        import deepspeed

        self.ds_config = ds_config
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        self.model, self.optimizer, _, _ = deepspeed.initialize(model=model, config=dict(ds_config),
                                                                model_parameters=model.parameters())

    def train(self, batch):
        loss = self.model(**batch).loss
        self.model.backward(loss)
        self.model.step()
        return loss.detach()

    def recover(self):
        self.model.zero_grad()
        _free()

    def config(self):
        import deepspeed

        return {"deepspeed_json": self.ds_config, "deepspeed": deepspeed.__version__}


class Fsdp2Runner(TorchLoopRunner):
    def __init__(self, model: nn.Module, *, bf16: bool, offload: bool, clip: float):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        self.bf16, self.offload, self.clip = bf16, offload, clip
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        policy = CPUOffloadPolicy() if offload else OffloadPolicy()
        if offload:
            model = model.to("cpu")
        for block in repeated_blocks(model):
            fully_shard(block, mp_policy=mp, offload_policy=policy)
        fully_shard(model, mp_policy=mp, offload_policy=policy)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def config(self):
        return {"fully_shard": "each repeated block + root", "param_dtype": "bf16" if self.bf16 else "fp32",
                "reduce_dtype": "fp32", "offload_policy": "CPUOffloadPolicy" if self.offload else None,
                "optimizer": "torch.optim.AdamW(fused=True)", "gradient_clipping": self.clip}


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The entries of every ModuleList with two or more entries: a transformer's layers."""
    return [m for lst in model.modules() if isinstance(lst, nn.ModuleList) and len(lst) >= 2 for m in lst]


def build_runner(method: str, workload: Workload, *, tiny: bool, device: torch.device, bf16: bool, clip: float,
                 world: int, micro_batch: int, process_group_timeout: float | None = None,
                 compile_backend: str = "inductor") -> Runner:
    """`process_group_timeout`: seconds a collective waits for a peer before it raises (None: torch's
    default for the torch and DeepSpeed rows, `launch.process_group_timeout`'s for zerofit's);
    `compile_backend`: torch.compile's backend for a `-compiled` method."""
    family, stage, offload = parse(method)
    compiled = split_compiled(method)[1]
    if family in ("deepspeed", "fsdp2"):
        init_process_group(device, process_group_timeout)
    model = workload.build_model(tiny, device)
    runner: Runner
    if family == "ddp":
        if world > 1:
            init_process_group(device, process_group_timeout)
        runner = PlainRunner(model, device, bf16=bf16, clip=clip, world=world)
    elif family == "fsdp2":
        runner = Fsdp2Runner(model, bf16=bf16, offload=offload, clip=clip)
    elif family == "zerofit":
        ds = deepspeed_json(stage, offload, bf16=bf16, clip=clip, micro_batch=micro_batch)
        return ZerofitRunner(model, ds, process_group_timeout=process_group_timeout,
                             compile_backend=compile_backend if compiled else None)
    else:  # DeepSpeed joins the group created above
        return DeepSpeedRunner(model, deepspeed_json(stage, offload, bf16=bf16, clip=clip, micro_batch=micro_batch))
    if compiled:  # the torch rows: torch.compile around the wrapped model, as torch's DDP and FSDP2 docs do
        runner.model = torch.compile(runner.model, backend=compile_backend)
        runner.compiled = f"torch.compile({type(runner.model._orig_mod).__name__}, backend={compile_backend!r})"
    return runner


def init_process_group(device: torch.device, timeout_s: float | None = None) -> None:
    """The job's process group (torchrun's environment, or a one-process group on this host)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

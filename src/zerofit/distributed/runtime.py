"""What a worker process asks about the run it belongs to: its config, its backend, its device.

`zerofit launch` resolves the config once, writes it to a file and points every worker at it through
`ZEROFIT_CONFIG_FILE`. A script started without the launcher (plain `python train.py`) gets the
default config, so the same script runs on one process unchanged.
"""

from __future__ import annotations

import os

import torch

from zerofit.config import load_config
from zerofit.config.schema import RunConfig
from zerofit.errors import ConfigError

CONFIG_FILE_ENV = "ZEROFIT_CONFIG_FILE"
"""Environment variable naming the resolved config file the launcher wrote for its workers."""
RUN_ID_ENV = "ZEROFIT_RUN_ID"
"""Set by `zerofit launch`: one id for its workers, restarted attempts included, kept in the manifests of the
checkpoints they write (zerofit.checkpoint.ownership)."""

_cache: dict[str, RunConfig] = {}
_zerofit_state_built = False


def note_zerofit_state_built() -> None:
    """Record that this process built zerofit's `Accelerator` or `PartialState` (so the script runs on zerofit)."""
    global _zerofit_state_built
    _zerofit_state_built = True


def zerofit_state_built() -> bool:
    """Whether this process built zerofit's `Accelerator` or `PartialState`; `zerofit launch`'s workers
    read it when the script ends, to tell a run that never used zerofit (zerofit.cli.worker_entry)."""
    return _zerofit_state_built


def current_config() -> RunConfig:
    """The run's resolved config: the launcher's file when there is one, else the defaults."""
    path = os.environ.get(CONFIG_FILE_ENV) or ""
    if path not in _cache:
        if path and not os.path.isfile(path):
            raise ConfigError(f"{CONFIG_FILE_ENV}={path!r} does not exist: start the script with "
                              f"`zerofit launch`, or unset {CONFIG_FILE_ENV} to use the defaults")
        _cache[path] = load_config(path or None)
    return _cache[path]


def local_rank() -> int:
    """This process's index among the workers of its machine (0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def use_cpu(config: RunConfig | None = None) -> bool:
    """True when the run computes on CPU: `launch.use_cpu` is set or there is no GPU."""
    config = config or current_config()
    return bool(config.launch.use_cpu) or not torch.cuda.is_available()


def backend_for(cpu: bool) -> str:
    """The torch.distributed backend for a run on CPU (gloo) or on GPUs (NCCL); the one place that decides."""
    return "gloo" if cpu else "nccl"


def backend(config: RunConfig | None = None) -> str:
    """The torch.distributed backend of this process's run (see `use_cpu`)."""
    return backend_for(use_cpu(config))


def device_index(local_rank: int, device_count: int) -> int:
    """The GPU (an index among the `device_count` this process sees) for the worker `local_rank`.

    `local_rank % device_count`, as Accelerate chooses: where every process sees all of the machine's
    GPUs this is the local rank; where each sees only its own (SLURM `--gpus-per-task=1`, a
    `CUDA_VISIBLE_DEVICES` per process) the fourth worker has LOCAL_RANK 3 and one GPU, index 0.
    """
    if local_rank < 0:
        raise ConfigError(f"LOCAL_RANK={local_rank} is not a local rank: the launcher sets it to 0 or more; "
                          f"unset it for a single process")
    if device_count < 1:
        raise ConfigError(f"local rank {local_rank} has no GPU to use: this process sees {device_count} "
                          f"GPUs; check CUDA_VISIBLE_DEVICES, or pass --cpu")
    return local_rank % device_count


def local_gpu() -> torch.device:
    """This worker's GPU (see `device_index`); the one place that chooses it."""
    return torch.device("cuda", device_index(local_rank(), torch.cuda.device_count()))


def device(config: RunConfig | None = None) -> torch.device:
    """The device this process computes on: the CPU, or its GPU (see `device_index`)."""
    return torch.device("cpu") if use_cpu(config) else local_gpu()

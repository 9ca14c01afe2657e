"""`get_logger(name)`: a standard logger that, by default, only speaks on the main process.

    logger = get_logger(__name__)
    logger.info("starts")                          # main process only
    logger.info("mine", main_process_only=False)   # every process, prefixed with its rank
    logger.info("ordered", main_process_only=False, in_order=True)  # every process, rank by rank

The level comes from `log_level`, else the environment variable ZEROFIT_LOG_LEVEL (or Accelerate's
ACCELERATE_LOG_LEVEL, so existing job scripts keep working), else the logging default.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist

LOG_LEVEL_ENV = "ZEROFIT_LOG_LEVEL"


def _rank() -> int:
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class MultiProcessAdapter(logging.LoggerAdapter):
    """A LoggerAdapter that takes `main_process_only` (default True) and `in_order` on every call."""

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        rank = _rank()
        if main_only:
            if rank == 0:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            return
        world = dist.get_world_size() if dist.is_initialized() else 1
        for turn in range(world if in_order else 1):
            if not in_order or turn == rank:
                msg2, kw = self.process(f"[rank {rank}] {msg}", dict(kwargs))
                self.logger.log(level, msg2, *args, **kw)
            if in_order and world > 1:
                dist.barrier()

    def warning_once(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        """Log `msg` as a warning the first time this exact message is seen."""
        seen = self.__dict__.setdefault("_seen", set())
        if msg not in seen:
            seen.add(msg)
            self.warning(msg, *args, **kwargs)


def get_logger(name: str, log_level: str | int | None = None) -> MultiProcessAdapter:
    """The logger `name`, logging on the main process unless a call says `main_process_only=False`."""
    logger = logging.getLogger(name)
    level = log_level or os.environ.get(LOG_LEVEL_ENV) or os.environ.get("ACCELERATE_LOG_LEVEL")
    if level is not None:
        logger.setLevel(level.upper() if isinstance(level, str) else level)
        logger.root.setLevel(logger.level)
    return MultiProcessAdapter(logger, {})

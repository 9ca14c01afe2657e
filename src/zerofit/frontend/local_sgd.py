"""`LocalSGD`: Accelerate's local SGD (scripts import it as `zerofit.local_sgd.LocalSGD`).

Local SGD steps each process's optimizer on its own gradients and averages the parameters every few
steps. zerofit's engine always reduces gradients before the optimizer steps - the step updates
shards that must agree across ranks under every ZeRO stage - so it does not run local SGD on several
processes, and says so when the context is entered enabled (Accelerate does the same under
DeepSpeed). Disabled, or on one process, it is the plain loop it wraps.
"""

from __future__ import annotations

from typing import Any


class LocalSGD:
    """Accelerate's `LocalSGD(accelerator, model, local_sgd_steps, enabled)` context (see the module doc)."""

    def __init__(self, accelerator: Any, model: Any, local_sgd_steps: int, enabled: bool = True):
        self.accelerator, self.model = accelerator, model
        self.local_sgd_steps = local_sgd_steps
        self.enabled = enabled and accelerator.num_processes > 1
        self.num_steps = 0
        if self.enabled:
            raise NotImplementedError(
                "LocalSGD is not supported by zerofit: its engine reduces gradients before every optimizer step "
                "so that sharded updates agree across ranks. Remove LocalSGD (or pass enabled=False); to "
                "communicate less often, raise gradient_accumulation_steps instead")

    def __enter__(self) -> LocalSGD:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def step(self) -> None:
        self.num_steps += 1

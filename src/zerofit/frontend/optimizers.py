"""The optimizer a script steps: `AcceleratedOptimizer`, and optimizers built from a config's `optimizer`.

[Note: what the script's optimizer calls do]
`prepare()` hands the script's optimizer object to the ZeRO engine, which rebinds it to this rank's
fp32 master shards (see `zerofit.engine.optim`), and returns it wrapped. In the training loop:

* `optimizer.step()` applies the accumulated gradients through `engine.step()` (unscale, clip if
  the config says so and the script did not call `clip_grad_norm_`, skip on fp16 overflow, step,
  publish the new parameters) on a micro-step that closes an accumulation window; on other
  micro-steps it does nothing, because the gradients are still accumulating.
* `optimizer.zero_grad()` clears gradients only once a window has closed; a call in the middle of
  a window (a loop that zeroes before its forward) would throw away accumulated micro-steps, so it
  is a no-op there.
* `step_was_skipped` is True after a step an fp16 overflow skipped, or one with no backward since
  the last step (which applies nothing, as torch's optimizers do without gradients, and is not
  counted); the scheduler wrapper then does not advance either.

[Note: a torch Optimizer that owns nothing]
`AcceleratedOptimizer` subclasses `torch.optim.Optimizer` so that whatever checks `isinstance(opt,
Optimizer)` accepts it: torch's LR schedulers (`LambdaLR(prepared_optimizer)`, built after
`prepare()` in no_trainer scripts and always by transformers' Trainer), `get_*_schedule_with_warmup`.
It never calls `Optimizer.__init__`: that would give it param groups, state and defaults of its own
and patch the class's `step` with torch's profiling and hook wrapper. Instead `param_groups`,
`defaults` and `state` are the wrapped optimizer's own objects (not copies), so a scheduler that
sets `group["lr"]` sets it where the engine reads it (`zerofit.engine.optim.sync_hyperparams`), and
step and state-dict hooks registered here are registered on the wrapped optimizer, which the engine
steps. A scheduler may replace `step` on the instance (torch's schedulers wrap it to count calls);
the wrapper calls this class's `step`, so everything above still holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zerofit.config import catalog
from zerofit.config.schema import OptimizerConfig
from zerofit.engine import ZeroEngine
from zerofit.errors import ConfigError
from zerofit.frontend.progress import Progress
from zerofit.frontend.state import GradientState

_DEEPSPEED_ADAM_SWITCHES = ("torch_adam", "adam_w_mode")


class SiblingSteps:
    """What the optimizers of one model share: which of them called `step()` since the engine last stepped.

    [Note: several optimizers step together]
    The engine applies one window's gradients to all the optimizers of a model at once (see [Note: several
    optimizers over one model] in zerofit.engine.optimizer_set): the first `step()` of the window steps
    every one of them, and the others' `step()` in the same window find their update done and only
    record it (the same skipped flag, so their schedulers move alike). A script that steps them on
    different windows (one of them every other step, or a GAN's two optimizers over one model, each
    after its own loss) would get the others stepped too: the next window that steps is refused instead,
    naming the optimizer that did not step.
    """

    def __init__(self):
        self.members: list[AcceleratedOptimizer] = []
        self.stepped: set[int] = set()
        """id() of the members that called step() since the engine last stepped."""
        self.last_skipped = False
        """The engine's last step was skipped (fp16 overflow, non-finite norm)."""

    def check_all_stepped(self) -> None:
        missing = [m for m in self.members if id(m) not in self.stepped]
        if self.stepped and missing:
            names = ", ".join(f"{type(m.optimizer).__name__} #{self.members.index(m)}" for m in missing)
            raise ValueError(f"the optimizers of one model step together under zerofit, and {names} did not call "
                             "step() in the last window that stepped (its parameters were updated with the "
                             "others'): call step() on every optimizer of the model once per window, or give the "
                             "parameters stepped on another schedule to a model of their own")


class AcceleratedOptimizer(torch.optim.Optimizer):
    """The script's optimizer, stepped through its model's ZeRO engine (see the module notes)."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: ZeroEngine, gradient_state: GradientState,
                 siblings: SiblingSteps | None = None):
        # No Optimizer.__init__: see [Note: a torch Optimizer that owns nothing].
        self.optimizer = optimizer
        self.engine = engine
        self.gradient_state = gradient_state
        self.siblings = siblings or SiblingSteps()
        """Shared by the optimizers of one model (see [Note: several optimizers step together])."""
        self.siblings.members.append(self)
        self.step_was_skipped = False
        self.window_open = False
        """True once a backward has run in an accumulation window that has not been stepped yet."""
        self.steps_taken = 0
        """Optimizer steps taken (accumulation windows closed, skipped fp16 steps included); checkpointed."""
        self.after_step: Callable[[], None] | None = None
        """Called once, after the next step that is not skipped (the planner's probe,
        `zerofit.frontend.planning.first_step_check`)."""
        self.progress: Progress | None = None
        """Prints every `logging.steps_per_print` steps (`zerofit.frontend.progress`); None: quiet."""

    # --- the calls a training loop makes --------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise ValueError("optimizer.step(closure) is not supported under zerofit: the engine steps on "
                             "accumulated, sharded gradients; call accelerator.backward(loss) then step()")
        if not self.gradient_state.sync_gradients:
            return
        sib = self.siblings
        if not self.engine.backward_in_window:
            if sib.stepped and id(self) not in sib.stepped:  # a sibling's step() applied this window already
                sib.stepped.add(id(self))
                self.step_was_skipped = sib.last_skipped
                self.window_open = False
                self.steps_taken += 1
                return
            self.step_was_skipped = not self.engine.step()  # nothing to apply: a no-op, as in torch (it warns)
            return
        if len(sib.members) > 1:
            sib.check_all_stepped()
        self.step_was_skipped = not self.engine.step()
        sib.stepped, sib.last_skipped = {id(self)}, self.step_was_skipped
        self.window_open = False
        self.steps_taken += 1
        if self.progress is not None:
            self.progress.after_step(self)
        if self.after_step is not None and not self.step_was_skipped:  # a skipped step allocated no state
            hook, self.after_step = self.after_step, None  # once: later steps only test this attribute
            hook()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self.gradient_state.sync_gradients or self.window_open:
            return
        self.engine.zero_grad()

    # --- torch.optim.Optimizer surface: the wrapped optimizer's own objects ----------------------
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """Runs before each real step of the wrapped optimizer (accumulating micro-steps step nothing)."""
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        """Runs after each real step of the wrapped optimizer."""
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (under ZeRO each rank holds a different part)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, group: dict[str, Any]) -> None:
        raise ValueError("add_param_group after prepare() is not supported under zerofit: the engine lays out "
                         "every parameter at prepare(); build the optimizer with all its param groups first")

    def __getattr__(self, name: str) -> Any:
        if name in ("optimizer", "engine"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


def build_optimizer(config: OptimizerConfig, params: Any) -> torch.optim.Optimizer:
    """The torch optimizer a resolved config's `optimizer` section names, over `params` (tensors or groups)."""
    cls = catalog.optimizer_class(config.type)
    if cls is None:
        raise ConfigError(f"optimizer.type {config.type!r} is not a torch.optim optimizer: use AdamW, Adam, SGD "
                          f"or another torch.optim class name")
    kwargs = dict(config.params)
    # DeepSpeed's Adam switches: adam_w_mode (default true) means AdamW; torch_adam only picks a kernel.
    adam_w_mode = kwargs.pop("adam_w_mode", True)
    kwargs.pop("torch_adam", None)
    if cls is torch.optim.Adam and adam_w_mode in (True, "true", "True"):
        cls = torch.optim.AdamW
    if isinstance(kwargs.get("betas"), list):
        kwargs["betas"] = tuple(kwargs["betas"])
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as bad:
        raise ConfigError(f"optimizer {config.type} with params {config.params}: {bad}: fix optimizer.params") \
            from None

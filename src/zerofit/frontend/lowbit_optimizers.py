"""8-bit optimizers of bitsandbytes and torchao, and Trainer's `--optim` names for them, run as torch's own.

[Note: low-bit optimizers of other libraries]
bitsandbytes' and torchao's 8-bit Adam keep their state in blocks of 256 elements counted from the start of
the tensor they are handed; on zerofit's flat shards those blocks would be cut elsewhere (see [Note: narrow
optimizer state] in zerofit.engine.state_codec), so their objects are never stepped. What they compute is
Adam with its moments stored in 8 bits, which is torch's Adam or AdamW with `precision.optimizer_state: 8bit`:
zerofit builds that torch optimizer over the same param groups and runs it.

* bitsandbytes' Adam classes (`Adam`, `AdamW`, `Adam8bit`, `AdamW8bit`, `PagedAdam*`, `*32bit`) all run its
  "adam" update, whose weight decay is decoupled (`p *= 1 - lr * wd`, bitsandbytes/backends/default/ops.py),
  so every one of them is torch's AdamW; `optim_bits` (8 or 32) picks the state, `Paged` only where the state
  lives (zerofit's offload replaces it). Its 32-bit Adam is plain AdamW with fp32 state.
* torchao's `AdamW8bit` decays decoupled (torch's AdamW), `Adam8bit` adds the decay to the gradient (torch's
  Adam); `amsgrad` carries over. Its `lr` is a tensor per group; it becomes a float (torch's schedulers set
  either).
* The torch optimizer is built over the script optimizer's own param-group dicts (not copies): an LR
  scheduler built on the script's object before `prepare()` sets `group["lr"]` where the engine reads it.
* Not carried: bitsandbytes keeps tensors under `min_8bit_size` (4096) elements and embeddings the Trainer
  overrides in fp32 state; zerofit stores every elementwise state tensor as the key says.

Anything else low-bit (4-bit, FP8, Lion, RMSprop, AdEMAMix, LAMB, ...) has no torch class with the same
update, so it is refused with the fix: torch's AdamW (or Adam) with `precision.optimizer_state: 8bit`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from zerofit.config.naming import key_name
from zerofit.config.schema import RunConfig
from zerofit.errors import ConfigError

_FIX = ("use torch.optim.AdamW with precision.optimizer_state: 8bit (zero_optimization.optimizer_state in a "
        "DeepSpeed JSON, --optimizer_state 8bit on `zerofit launch`), which stores Adam's moments in 8 bits")


@dataclass(frozen=True)
class Mapped:
    """What zerofit runs instead: a torch optimizer class and the state dtype."""

    torch_class: type[torch.optim.Optimizer]
    state: str
    """precision.optimizer_state: "8bit" or "fp32"."""

    def said(self, what: str) -> str:
        """One line for the log."""
        return (f"zerofit: {what} runs as torch.optim.{self.torch_class.__name__} with precision.optimizer_state "
                f"{self.state} (same lr, betas, eps and weight decay; bitsandbytes and torchao are not used)")


TRAINER_OPTIM: dict[str, Mapped] = {
    **dict.fromkeys(("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "adamw_torch_8bit"),
                    Mapped(torch.optim.AdamW, "8bit")),
    "paged_adamw_32bit": Mapped(torch.optim.AdamW, "fp32"),  # bitsandbytes' 32-bit AdamW is plain AdamW
}
"""Trainer `--optim` names zerofit runs as a torch optimizer with a state dtype."""

_TRAINER_REFUSED = {
    "adamw_torch_4bit": "4-bit state",
    "lion_8bit": "Lion", "lion_32bit": "Lion", "paged_lion_8bit": "Lion", "paged_lion_32bit": "Lion",
    "rmsprop_bnb": "bitsandbytes' RMSprop", "rmsprop_bnb_8bit": "bitsandbytes' RMSprop",
    "rmsprop_bnb_32bit": "bitsandbytes' RMSprop",
    "ademamix": "AdEMAMix", "ademamix_8bit": "AdEMAMix", "paged_ademamix_32bit": "AdEMAMix",
    "paged_ademamix_8bit": "AdEMAMix",
}


def trainer_optim(name: str) -> Mapped | None:
    """What zerofit runs for Trainer's `--optim name`: a Mapped, None (Trainer builds it as usual), or a
    ConfigError naming the value and the fix."""
    if name in TRAINER_OPTIM:
        return TRAINER_OPTIM[name]
    if name in _TRAINER_REFUSED:
        other = "--optim rmsprop" if "rmsprop" in name else "--optim adamw_torch"
        raise ConfigError([f"--optim {name} ({_TRAINER_REFUSED[name]}) has no torch optimizer with the same update "
                           "that zerofit could run on its sharded state: pass --optim adamw_8bit (torch's AdamW "
                           f"with zerofit's 8-bit state), or {other} with precision.optimizer_state: 8bit in the "
                           "launch config"])
    return None


_BNB_ADAM = {"Adam", "AdamW", "PagedAdam", "PagedAdamW"}
"""bitsandbytes' Adam classes without a bit count in the name (`optim_bits` says it)."""


def _mapped(opt: torch.optim.Optimizer) -> Mapped | None:
    """Mapped for a bitsandbytes or torchao optimizer object; None for another library's; ConfigError when
    refused."""
    cls = type(opt)
    library = cls.__module__.split(".")[0]
    if library not in ("bitsandbytes", "torchao"):
        return None
    name = f"{cls.__module__}.{cls.__qualname__}"
    base = cls.__name__
    if library == "bitsandbytes":
        stem = base.removesuffix("8bit").removesuffix("32bit")
        if stem in _BNB_ADAM:
            args = getattr(opt, "args", None)
            if getattr(args, "max_unorm", 0.0) or getattr(args, "skip_zeros", False):
                raise ConfigError([f"optimizer {name} with max_unorm or skip_zeros changes Adam's update, which "
                                   f"zerofit does not reproduce: drop them, or {_FIX}"])
            bits = 8 if base.endswith("8bit") else 32 if base.endswith("32bit") else getattr(args, "optim_bits", 32)
            return Mapped(torch.optim.AdamW, "8bit" if bits == 8 else "fp32")
    elif base in ("AdamW8bit", "Adam8bit"):
        return Mapped(torch.optim.AdamW if base == "AdamW8bit" else torch.optim.Adam, "8bit")
    raise ConfigError([f"optimizer {name} keeps its state in its own low-bit format, which zerofit cannot run on "
                       f"sharded state and has no torch optimizer with the same update for: {_FIX}"])


def replacement(opt: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, Mapped] | None:
    """The torch optimizer zerofit runs for a bitsandbytes / torchao object (see the note), over the same
    param-group dicts; None for any other optimizer."""
    mapped = _mapped(opt)
    if mapped is None:
        return None
    d = opt.defaults
    for group in opt.param_groups:  # torchao keeps lr as a tensor per group
        for key in ("lr", "initial_lr"):
            if isinstance(group.get(key), torch.Tensor):
                group[key] = float(group[key])
        if len(group.get("betas", ())) > 2:
            raise ConfigError([f"optimizer {type(opt).__qualname__} with three betas is not Adam: {_FIX}"])
    lr = float(d.get("lr", 1e-3))
    built = mapped.torch_class(opt.param_groups, lr=lr, betas=tuple(d.get("betas", (0.9, 0.999))),
                               eps=d.get("eps", 1e-8), weight_decay=d.get("weight_decay", 0.0),
                               amsgrad=bool(d.get("amsgrad", False)))
    return built, mapped


def with_optimizer_state(config: RunConfig, state: str, what: str) -> RunConfig:
    """`config` with `precision.optimizer_state` set to `state`, which `what` (an optimizer, an `--optim` name)
    asks for; a ConfigError naming both when the config wrote another value."""
    current = config.precision.optimizer_state
    if current == state:
        return config
    written = ("precision.optimizer_state" in config.written if config.written or config.source is not None
               else current != "fp32")
    if written:
        name = key_name(config.source_format, "precision.optimizer_state")
        raise ConfigError([f"{what} asks for {state} optimizer state but the config's {name} is {current!r}: "
                           f"remove {name} (or set it to {state!r}), or pick an optimizer of {current} state"],
                          config.source)
    return config.replace(precision=dataclasses.replace(config.precision, optimizer_state=state))

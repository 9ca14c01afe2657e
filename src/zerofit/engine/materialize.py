"""Turn a model built on the meta device into real tensors one unit at a time.

A model constructed under `with torch.device("meta"):` has shapes but no storage. The engine asks
this module for one unit's parameters at a time; they are allocated on the device, initialised, copied
into the unit's flat buffers (of which stage 3 keeps only this rank's shard) and dropped, so no rank
ever holds more than one whole unit. Every rank runs the same initialisation in the same order from
the same seed, so the shards agree.

Initialisation per module: Hugging Face models' own `_init_weights(module)` (which also recomputes
buffers such as rotary frequencies), else the module's `reset_parameters()`. A module with meta
tensors and neither is an error naming it.

A model marked by `zerofit.utils.load_at_prepare` has a `WeightSource` (zerofit.engine.weight_source):
the tensors its checkpoint holds are copied from there instead, and a module whose every meta tensor
the checkpoint fills is not initialised at all. The others (a new head, non-persistent buffers) are
initialised as above, in the same order on every rank.

[Note: new parameter objects]
A meta parameter cannot take real storage in place, so materialising creates a new `nn.Parameter`
and sets it on every module that held the old one (tied weights stay tied). Callers that keyed
anything by the old parameter (the optimizer's param groups) must map through the returned dict.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zerofit.engine.weight_source import WeightSource
from zerofit.errors import EngineError


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def default_init_fn(model: nn.Module) -> Callable[[nn.Module], None]:
    hf_init = getattr(model, "_init_weights", None)

    def init(module: nn.Module) -> None:
        if hf_init is not None:
            hf_init(module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()
        elif any(t.numel() for t in module.parameters(recurse=False)):
            raise EngineError(f"cannot initialise {type(module).__name__} built on the meta device: it has "
                              "no reset_parameters(); build the model on a real device or give it one")

    return init


class Materializer:
    """Allocates and initialises meta parameters module by module, on request, tracking what is done."""

    def __init__(self, model: nn.Module, device: torch.device,
                 init_fn: Callable[[nn.Module], None] | None = None, weights: WeightSource | None = None):
        self.model = model
        self.device = device
        self.init_fn = init_fn or default_init_fn(model)
        self.weights = weights
        """Where pretrained values come from (None: everything is initialised)."""
        self.replaced: dict[int, nn.Parameter] = {}
        """id(old meta parameter) -> its real replacement."""
        self._places: dict[int, list[tuple[nn.Module, str]]] = {}
        self._modules_of: dict[int, list[nn.Module]] = {}
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                self._places.setdefault(id(p), []).append((module, name))
                self._modules_of.setdefault(id(p), []).append(module)
        self._done: set[int] = set()

    def real(self, param: nn.Parameter) -> nn.Parameter:
        """The real parameter for `param` (itself when it was never meta)."""
        return self.replaced.get(id(param), param)

    def materialize(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """Make `params` real and initialised (initialising every module that holds them); return them."""
        with torch.no_grad():
            for p in params:
                if p.is_meta:
                    for module in self._modules_of.get(id(p), []):
                        self._init_module(module)
        return [self.real(p) for p in params]

    def finish(self, *, announce: bool = True) -> None:
        """Initialise modules that hold only buffers (rotary embeddings, running statistics); with a checkpoint,
        close it and (with `announce`: one rank) warn of what it lacked or held besides."""
        with torch.no_grad():
            for module in self.model.modules():
                if any(b.is_meta for b in module.buffers(recurse=False)):
                    self._init_module(module)
        left = [n for n, b in self.model.named_buffers() if b.is_meta]
        if left:
            raise EngineError(f"buffers {left[:3]} are still on the meta device after initialisation: "
                              "create them on a real device or initialise them in reset_parameters()")
        if self.weights is not None:
            self.weights.finish(announce=announce)

    def _init_module(self, module: nn.Module) -> None:
        if id(module) in self._done:
            return
        self._done.add(id(module))
        # A tied parameter already made real by an earlier module keeps that module's initialisation,
        # as it does when the model is built normally (the tie replaces the later module's weight).
        earlier = {name: p.detach().clone() for name, p in module.named_parameters(recurse=False)
                   if not p.is_meta}
        loaded: list[tuple[torch.Tensor, torch.Tensor]] = []  # (meta original, real replacement)
        for p in list(module.parameters(recurse=False)):
            if p.is_meta:
                new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device),
                                   requires_grad=p.requires_grad)
                for owner, attr in self._places[id(p)]:
                    setattr(owner, attr, new)
                self.replaced[id(p)] = new
                loaded.append((p, new))
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_meta:
                new_buffer = torch.empty(b.shape, dtype=b.dtype, device=self.device)
                setattr(module, name, new_buffer)
                loaded.append((b, new_buffer))
        if self.weights is not None:
            pretrained = [(old, new) for old, new in loaded if self.weights.has(old)]
            if len(pretrained) < len(loaded):  # something the checkpoint lacks: the module's own init
                self.init_fn(module)
            for old, new in pretrained:
                self.weights.fill(old, new)
        else:
            self.init_fn(module)
        for name, value in earlier.items():
            getattr(module, name).copy_(value)

"""One flat buffer of a unit and the state that goes with it: parameters, master, gradients.

A unit has up to two flat groups: its trainable parameters (with fp32 master shard and gradient
buffers) and its frozen parameters (compute-dtype parameters only: frozen weights never cost gradient
or optimizer memory). The model's parameters become views into `param_flat`.

[Note: aliasing]
Buffers alias each other whenever the math allows, so one rank and stage 0 cost nothing extra:
- `param_shard` is a view of `param_flat` unless parameters are sharded (stage 3);
- `master` (fp32) is `param_shard` itself when compute runs in fp32;
- `grad_flat` (where backward accumulates full gradients) is `grad_shard` when the optimizer is not
  sharded (stage 0, or one rank), so reduction is in place or nothing at all;
- on one rank with no accumulation, that buffer is in the compute dtype ("compact", see
  [Note: compact gradients] in zerofit.engine.step_mode).

[Note: released parameters]
Under stage 3 a released group keeps its `param_flat` tensor and the parameter views into it, but its
storage is resized to zero bytes. Gathering resizes it back and all-gathers into it, so every view -
including tensors autograd saved during forward - sees the gathered values again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zerofit.engine.buffers import group_buffers
from zerofit.engine.layout import FlatLayout, plan_layout
from zerofit.engine.pinned import pinned_copy, pinned_empty
from zerofit.engine.policy import GroupPlacement


class FlatGroup:
    """Parameters of one unit with one requires_grad value, flattened into padded equal shards."""

    def __init__(self, unit_name: str, names: list[str], params: list[nn.Parameter], groups: list[int],
                 *, trainable: bool, placement: GroupPlacement, compute_dtype: torch.dtype,
                 device: torch.device, align: int, compact_grads: bool = False, whole: bool = False,
                 packed_master: bool = False):
        """`compact_grads`: keep the gradient in the compute dtype (the engine decides when that is exact:
        `zerofit.engine.policy.keeps_compact_grads`); `packed_master`: a GPU-stepped group whose host master is
        kept packed between steps, packed here already (see [Note: packed master at rest] in
        zerofit.engine.offload.packed_master)."""
        self.unit_name = unit_name
        self.names = names
        self.params = params
        self.shapes = [p.shape for p in params]
        self.arrived = [p.dtype for p in params]
        """Each parameter's dtype as the model held it when the engine took it over: what saved weights are
        written in (see [Note: saved dtype] in zerofit.checkpoint.consolidate)."""
        self.trainable = trainable
        self.placement = placement
        self.compute_dtype = compute_dtype
        self.layout: FlatLayout = plan_layout([p.numel() for p in params], placement.shard_world,
                                              groups=groups, align=align)
        lo, hi = self.layout.shard_range(placement.rank)
        self.buffers = b = group_buffers(self.layout, placement, trainable=trainable, compute_dtype=compute_dtype,
                                         compact=compact_grads)
        host = torch.device("cpu")
        self.device = device
        pin = device.type == "cuda"  # page-locked host memory makes host<->GPU copies asynchronous
        flat = torch.zeros(b.param_flat.numel, dtype=compute_dtype, device=device)
        master_src = None
        with torch.no_grad():
            for p, off in zip(params, self.layout.offsets):
                flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
            if b.master is not None:
                master_src = self._gather_fp32_shard(params, lo, hi, host if b.master.host else device)
        self.param_flat = flat
        self._full_bytes = flat.untyped_storage().nbytes()
        self.param_shard = flat[lo:hi]
        if b.param_shard is not None:
            self.param_shard = _on(flat[lo:hi], host, pin) if b.param_shard.host else flat[lo:hi].clone()
        self.master: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.grad_flat: torch.Tensor | None = None
        self._grad_staging: torch.Tensor | None = None
        self._grad_event = None
        self._download = placement.host_stepped and pin
        self.device_sumsq: torch.Tensor | None = None
        """Squared norm of this window's gradient shard, taken on the device on its way to the host
        (only while the window has had one micro-step): saves the norm a pass over host memory."""
        self._grad_fresh = True
        """No gradient has reached `grad_shard` in this accumulation window (its contents are stale)."""
        self.step_in_flight = False
        """A GPU-stepped update of this group is queued on side streams; it zeroes the gradient shard
        itself once it has read it, so `zero_grads` must not touch it (see zerofit.engine.offload.gpu)."""
        self.unused: frozenset[int] = frozenset()
        self.whole = whole
        """Its optimizer reads each parameter whole (see [Note: whole-parameter steps] in zerofit.engine.whole_step)."""
        """Parameters (layout positions) no rank gave a gradient in this window: the step leaves their
        master pieces out (set by the engine before a step; see [Note: parameters without a gradient])."""
        self.piece_masters: list[tuple[int, torch.Tensor]] = []
        """(layout position, master piece) of every piece the optimizer steps (set by `rebind_optimizer`)."""
        self.before_read: Callable[[], None] | None = None
        """Set by the engine when `master` and optimizer state are not in memory between steps (NVMe):
        call it before reading them outside a step (see [Note: NVMe residency] in zerofit.engine.offload.nvme)."""
        self.packed_master: torch.Tensor | None = None
        """The packed form of a host master kept packed between steps, its `master` then without pages."""
        if trainable:
            if master_src is None:
                self.master = self.param_shard
            elif packed_master and b.master.host:  # one group's fp32 master at a time, never all of them
                from zerofit.engine.offload.packed_master import pack, release_pages
                self.master = master_src
                self.packed_master = pack(master_src, self.param_shard, pin=pin)
                release_pages(self.master)
            else:
                self.master = _on(master_src, host, pin) if b.master.host else master_src
            grad = b.grad_shard
            if pin and grad.host:
                self.grad_shard = pinned_empty(grad.numel, grad.dtype).zero_()
            else:
                self.grad_shard = torch.zeros(grad.numel, device=host if grad.host else device, dtype=grad.dtype)
            if b.grad_flat_is_shard:
                self.grad_flat = self.grad_shard
            elif b.grad_flat is not None:
                self.grad_flat = torch.zeros(b.grad_flat.numel, dtype=b.grad_flat.dtype, device=device)
        for p, off, shape in zip(params, self.layout.offsets, self.shapes):
            p.data = flat[off:off + p.numel()].view(shape)
        self.gathered = True
        if placement.shard_params:
            self.release()

    def _gather_fp32_shard(self, params, lo: int, hi: int, device: torch.device) -> torch.Tensor:
        """The fp32 values of this rank's shard, read from the original (full precision) parameters."""
        out = torch.zeros(hi - lo, dtype=torch.float32, device=device)
        for o in self.layout.overlaps(self.placement.rank):
            src = params[o.index].detach().reshape(-1)[o.param_start:o.param_start + o.length]
            out[o.shard_offset:o.shard_offset + o.length].copy_(src)
        return out

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def compact(self) -> bool:
        """The gradient is kept in the compute dtype (see [Note: aliasing])."""
        return self.grad_shard is not None and self.grad_shard.dtype != torch.float32

    def widen(self) -> None:
        """Keep this group's gradient in fp32 from now on (its current contents carried over exactly)."""
        if self.compact:
            wide = self.grad_shard.float()
            if self.grad_flat is self.grad_shard:
                self.grad_flat = wide
            self.grad_shard = wide

    # --- parameters -------------------------------------------------------------------------
    def alloc_full(self) -> None:
        """Give `param_flat` its storage back (contents undefined until gathered)."""
        storage = self.param_flat.untyped_storage()
        if storage.nbytes() != self._full_bytes:
            storage.resize_(self._full_bytes)

    def release(self) -> None:
        """Free the gathered parameters (stage 3); their views stay valid for the next gather."""
        if self.placement.shard_params and self.gathered:
            self.param_flat.untyped_storage().resize_(0)
            self.gathered = False

    def publish_master(self) -> None:
        """Copy the updated fp32 master into this rank's compute-dtype shard (uploading it if offloaded)."""
        if self.master is None or self.master is self.param_shard:
            return
        if self.master.device != self.param_shard.device and self.param_shard.device.type == "cuda":
            # Upload fp32 and cast on the GPU: one pass over host memory instead of a cast plus a copy.
            self.param_shard.copy_(self.master.to(self.param_shard.device, non_blocking=True))
        else:
            self.param_shard.copy_(self.master)

    def take_reduced_grad(self, grad: torch.Tensor) -> None:
        """Put one micro-step's reduced gradient shard into `grad_shard` (through host memory if offloaded).

        The first gradient of a window overwrites the stale shard (no zeroing pass, no addition);
        later ones are added. On CUDA with offload this only starts the download: `settle_host_grad`
        finishes it.
        """
        fresh, self._grad_fresh = self._grad_fresh, False
        if not self._download:
            if fresh:
                self.grad_shard.copy_(grad)
            else:
                self.grad_shard.add_(grad)
            return
        self.device_sumsq = torch.linalg.vector_norm(grad).square() if fresh else None
        if not fresh and self._grad_staging is None:  # only accumulation needs a second host buffer
            self._grad_staging = pinned_empty(self.layout.shard_numel, torch.float32)
        target = self.grad_shard if fresh else self._grad_staging
        target.copy_(grad, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(grad.device))  # the stream the download was queued on
        self._grad_event = (event, not fresh)

    def settle_host_grad(self) -> None:
        """Wait for a started gradient download (and add it in when it went to the staging buffer)."""
        if self._grad_event is not None:
            event, add = self._grad_event
            self._grad_event = None
            event.synchronize()
            if add:
                self.grad_shard.add_(self._grad_staging)

    def grads_for_step(self) -> None:
        """Before a step: a shard that received no gradient this window holds stale values; zero it."""
        if self._grad_fresh and self.grad_shard is not None:
            self.grad_shard.zero_()
            self._grad_fresh = False
            self.device_sumsq = None

    def grad_consumed(self) -> None:
        """After a step: the next window's first gradient may overwrite the shard (no zeroing pass)."""
        self._grad_fresh = True
        self.device_sumsq = None

    # --- gradients --------------------------------------------------------------------------
    def accumulate(self, index: int, grad: torch.Tensor, *, factor: float = 1.0) -> None:
        """Add one parameter's gradient, times `factor`, into the full gradient buffer (allocated on first
        use); the product is taken in the buffer's dtype (fp32 unless compact)."""
        off = self.layout.offsets[index]
        target = self.grad_flat_or_zeros()[off:off + grad.numel()].view_as(grad)
        if factor == 1.0:
            target.add_(grad)
        else:
            target.add_(grad.to(target.dtype), alpha=factor)

    def grad_flat_or_zeros(self) -> torch.Tensor:
        """The full gradient buffer, allocated (zeroed) if this micro-step has not needed it yet."""
        if self.grad_flat is None:
            full = self.buffers.grad_transient
            self.grad_flat = torch.zeros(full.numel, dtype=full.dtype, device=self.param_flat.device)
        return self.grad_flat

    def drop_grad_flat(self) -> None:
        """Forget the transient full gradient buffer (after it was handed to its reduction)."""
        if self.grad_flat is not self.grad_shard and not self.placement.keep_full_grads:
            self.grad_flat = None

    def zero_grads(self) -> None:
        self._grad_fresh = True
        self.device_sumsq = None
        if self.grad_shard is not None and not self.placement.host_stepped and not self.step_in_flight:
            self.grad_shard.zero_()  # host-stepped shards are overwritten by the window's first gradient
        if self.grad_flat is not None and self.grad_flat is not self.grad_shard:
            self.grad_flat.zero_()


def _on(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """`t` copied to `device` (pinned when it goes to the host of a GPU run)."""
    if device.type == "cpu" and pin:
        return pinned_copy(t)
    return t.to(device, copy=True) if t.device != device else t.clone()

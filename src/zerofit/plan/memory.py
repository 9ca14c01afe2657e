"""Bytes per rank of one zerofit setting, from the engine's own layout: the memory model.

The engine's pure functions decide everything here - `plan_units` (which parameters form a unit),
`StagePolicy.placement` (what each unit's flat group shards and where it lives), `plan_layout`
(padding to `world` equal shards of a multiple of 16 elements) and `group_buffers` (which buffers a
group holds, in which dtype, where: what `FlatGroup` allocates) - so the model follows the engine
when any of them changes. For each flat group with padded size N and shard size S = N / shard_world,
c bytes per compute element (4 fp32, 2 bf16/fp16) and k optimizer state tensors (2 for Adam):

Each term's bytes, and where they live:
- parameters: N*c, or S*c for a group sharded between uses (stage 3). Where: GPU; host (pinned) with param
  offload.
- gathered parameters: N*c of the root unit (if sharded) + each sharded unit's N*c while gathered: on the
  activation timeline (see `zerofit.plan.activations`), else the 2 largest (current + prefetched). Where:
  GPU, stage 3 only.
- fp32 master: S*4, none when compute is fp32 and the state and parameters are on the GPU (it is the
  parameter itself);
  S*2.125 when GPU-stepped with the master split (bf16 parameters on the GPU, host memory): kept packed
  between steps, + S*4 of the largest such group while it is packed or read ([Note: packed master at rest]
  in zerofit.engine.offload.packed_master). Where: with the optimizer state.
- gradients: S*4 shard (S*c on one rank without accumulation or offload: "compact"); + N*4 full buffer when
  it persists (stage 1 on several ranks). Where: with the optimizer state.
- optimizer states: k*S*b, b the stored bytes per element of `precision.optimizer_state` (4 fp32, 2 bf16,
  1.25 8bit: `Codec.bytes_per_element`); groups a per-parameter optimizer steps whole keep b = 4. Where: GPU;
  host with optimizer offload; files with NVMe, host- or GPU-stepped (one group's worth in host slots).
- transient gradients: N*4 (+ S*4 reduce output) per unit while reduced, at most 2 reductions in flight.
  Where: GPU, on the activation timeline.
- step upcast: S*4 of the largest compact group, while it steps (after backward). Where: GPU, against the
  activation peak.
- offload staging: S*4 pinned per group, when accumulating over several micro-steps (host-stepped). Where:
  host.
- narrow-state scratch: k*S*4 of the largest host-stepped group, when the state is narrowed: the CPU optimizer
  steps one group at a time from fp32 copies of its state ([Note: narrow state on the host] in
  zerofit.engine.offload.host_narrow). Where: host.
- streaming pool: GPU-stepped offload (`step_on: device`): 3 slots of min(64 M, largest offloaded S) elements x
  4 bytes x (1 master + k states + 1 upcast if compact) (+ c per element with param offload; + 2.125 bytes per
  element for the split master in bf16 without param offload, + 1 for its carries' scratch without Triton; + k
  state chunks in their stored form, b bytes per element, when the state is narrowed); the gradient shard stays
  on the GPU. Narrowed state kept on the device streams through a slot of its own: min(64 M, largest such S)
  x 4 bytes x (1 master + k states + 1 upcast if compact), widened from its home in place. Without Triton, 8-bit
  state adds the codec's int32 scratch of one chunk. Where: GPU.
- NVMe slots: `offload_optimizer.buffer_count` (at most one per offloaded unit) x the largest group's master
  and state. Where: host.
- activations: measured by `zerofit.plan.activations` at the planned batch. Where: GPU.
- kept gathered parameters (`Estimate.kept_gathered`, stage 3): the N*c of every sharded unit that a
  forward without autograd (generation, evaluation) keeps gathered between steps, the root first, then
  the units in order while they fit `Workload.max_live_parameters` elements (see [Note: kept units] in
  zerofit.engine.kept). Where: GPU, between a step and the next training forward only, so not part of
  `gpu_total` (the training forward releases them): a run that generates needs `gpu_while_generating`
  (the persistent terms, the kept parameters, and generation's own activations and KV cache, which this
  model does not trace).

GPU-stepped offload from NVMe (`step_on: device`, `offload_optimizer.device: nvme`) counts the master and
state in files and the swapper's host slots as host-stepped NVMe does, and on the GPU the gradient shard
and the streaming pool as GPU-stepped offload from host memory does.

With GPU-stepped offload and `offload_optimizer.host_share` above 0, the offloaded units
`host_stepped_units` picks are counted as host-stepped, the others as GPU-stepped (`state_homes`).

With `offload_optimizer.ratio` below 1 only the units the engine's `offloaded_units` picks (whole
units, the last ones first) have their "with the optimizer state" terms, transient gradients and
staging as offloaded; the other units are counted as without offload, on the GPU.

The parameters a per-parameter optimizer (Adafactor, Muon) steps whole (`ModelCounts.whole`) form groups
of their own, counted as the engine lays them out: their master and optimizer state on the GPU whatever the
offload setting (`optimizer_states` state tensors each, 1/world per rank as the owners share them out), and,
sharded, the step's transient full fp32 gradient, master and summed result (3*N*4 of the largest such
group, after backward, as the step upcast is).

The GPU total is the persistent terms plus the activation peak with the transient gradients and
gathered parameters on top; `fits` adds a fixed reserve for the CUDA context and allocator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from zerofit.engine import fused_kernels
from zerofit.engine.buffers import group_buffers
from zerofit.engine.engine import SHARD_ALIGN
from zerofit.engine.find_units import UnitSpec, plan_units
from zerofit.engine.layout import plan_layout
from zerofit.engine.offload.gpu import STREAM_CHUNK, STREAM_SLOTS, home_slot_bytes, stream_pool_bytes
from zerofit.engine.offload.master_split import packed_bytes
from zerofit.engine.policy import (
    COMPUTE_DTYPES,
    StagePolicy,
    StateHome,
    keeps_compact_grads,
    packs_master,
    state_homes,
)
from zerofit.engine.state_codec import Codec
from zerofit.plan.activations import ActivationTrace

GIB = 1 << 30
DTYPE_BYTES = {"no": 4, "fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One way to run: ZeRO stage, where the optimizer state and parameters live, checkpointing."""

    stage: int
    offload_optimizer: str = "none"
    """none, cpu or nvme."""
    offload_param: str = "none"
    """none or cpu (stage 3 only)."""
    checkpointing: bool = False
    offload_ratio: float = 1.0
    """Share of the parameters whose optimizer state is offloaded (`offload_optimizer.ratio`), whole
    units from the last one backwards, as the engine picks them (`zerofit.engine.policy.offloaded_units`)."""

    step_on: str = "host"
    """Where offloaded state is stepped: host, or device (GPU-stepped: the gradient shard stays on the GPU
    and a pool of chunks streams the state; see `zerofit.engine.policy.step_on_for`)."""

    host_share: float = 0.0
    """GPU-stepped offload only: the share of the offloaded state stepped on the host instead, whole units
    (the last ones), while the rest streams (`zerofit.engine.policy.host_stepped_units`)."""

    def __post_init__(self) -> None:
        if not 0 <= self.host_share <= 1 or (self.host_share and self.step_on != "device"):
            raise ValueError(f"host_share must be in [0, 1], and 0 unless step_on is device (got {self.host_share})")
        if self.step_on not in ("host", "device"):
            raise ValueError(f"step_on must be host or device (got {self.step_on!r})")
        if self.step_on == "device" and self.offload_optimizer not in ("cpu", "nvme"):
            raise ValueError("step_on device needs offload_optimizer cpu or nvme")
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3 (got {self.stage})")
        if self.offload_optimizer not in ("none", "cpu", "nvme"):
            raise ValueError(f"offload_optimizer must be none, cpu or nvme (got {self.offload_optimizer!r})")
        if self.offload_param not in ("none", "cpu"):
            raise ValueError(f"offload_param must be none or cpu (got {self.offload_param!r})")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError("offload_optimizer needs stage 1 or higher")
        if (self.offload_param != "none" or self.offload_optimizer == "nvme") and self.stage != 3:
            raise ValueError("offload_param and NVMe optimizer offload need stage 3")
        if not 0 < self.offload_ratio <= 1:
            raise ValueError(f"offload_ratio must be in (0, 1] (got {self.offload_ratio})")
        if self.offload_ratio < 1 and self.offload_optimizer == "none":
            raise ValueError(f"offload_ratio {self.offload_ratio} needs offload_optimizer cpu or nvme")

    @property
    def label(self) -> str:
        name = "DDP (stage 0)" if self.stage == 0 else f"ZeRO-{self.stage}"
        if self.offload_optimizer != "none":
            name += f" + opt {self.offload_optimizer}"
            if self.offload_ratio < 1:
                name += f" {self.offload_ratio:.0%}"
            if self.step_on == "device":
                name += f" (GPU-stepped, {self.host_share:.0%} on the CPU)" if self.host_share else " (GPU-stepped)"
        if self.offload_param != "none":
            name += f" + param {self.offload_param}"
        return name + (" + ckpt" if self.checkpointing else "")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one rank trains: world size, precision, optimizer state count, micro-batch and accumulation."""

    world: int = 1
    mixed_precision: str = "bf16"
    optimizer_states: int = 2
    """Shard-sized state tensors per parameter (Adam/AdamW: 2; SGD with momentum: 1)."""
    optimizer_state: str = "fp32"
    """`precision.optimizer_state`: how those tensors are stored (fp32, bf16 or 8bit)."""
    micro_batch: int = 1
    seq: int = 512
    gradient_accumulation_steps: int = 1
    persistence_threshold: int = 100_000
    unit_size_threshold: int = 10_000_000
    nvme_buffer_count: int = 4
    """`offload_optimizer.buffer_count`: host slots of the NVMe swapper, each the largest group's state."""
    max_live_parameters: int | None = None
    """`zero.max_live_parameters`: elements generation and evaluation keep gathered at stage 3 (None: all)."""


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """Bytes per rank of one setting, by term; `gpu_total` and `host_total` are what must fit."""

    setting: Setting
    params: int
    grads: int
    optimizer: int
    activations: int
    """Activation peak, including the transient per-unit gradient buffers of reductions in flight."""
    buffers: int
    """Model buffers, persistent full-gradient buffers (stage 1), gathered parameters (stage 3)."""
    host_params: int
    host_grads: int
    host_optimizer: int
    host_buffers: int
    nvme: int = 0
    traced: bool = False
    """`activations` holds a traced activation peak (else only the step's transient buffers)."""
    kept_gathered: int = 0
    """Stage 3: bytes of gathered parameters forwards without autograd keep between steps (not in `gpu_total`:
    the training forward releases them; see the module doc)."""

    @property
    def gpu_total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def gpu_while_generating(self) -> int:
        """GPU bytes between steps with the kept gathered parameters (before generation's own activations)."""
        return self.params + self.grads + self.optimizer + self.kept_gathered

    @property
    def host_total(self) -> int:
        return self.host_params + self.host_grads + self.host_optimizer + self.host_buffers


@dataclass(frozen=True)
class ModelCounts:
    """What the memory model needs to know about a model: its units' trainable and frozen sizes."""

    units: tuple[tuple[str, int, int], ...]
    """(unit name, trainable elements, frozen elements), root first, as `plan_units` orders them."""
    buffer_bytes: int
    laid_out: tuple[tuple[int, int], ...] | None = None
    """Per unit, (trainable, frozen) elements as the flat buffers lay them out - each parameter from a
    multiple of `SHARD_ALIGN` (see [Note: flat layout]); None: as `units` says (no gaps)."""
    whole: tuple[int, ...] | None = None
    """Per unit, the laid-out trainable elements a per-parameter optimizer steps whole (part of the
    trainable ones; see [Note: whole-parameter steps] in zerofit.engine.whole_step); None: none."""

    @property
    def numel(self) -> int:
        return sum(t + f for _, t, f in self.units)

    @classmethod
    def of(cls, model: nn.Module, *, unit_size_threshold: int = 10_000_000,
           whole: frozenset[int] = frozenset()) -> ModelCounts:
        """`whole`: id() of the parameters a per-parameter optimizer steps whole (`optim.whole_param_ids`)."""
        specs: list[UnitSpec] = plan_units(model, size_threshold=unit_size_threshold)
        units = tuple((s.name, sum(p.numel() for _, p in s.params if p.requires_grad),
                       sum(p.numel() for _, p in s.params if not p.requires_grad)) for s in specs)
        laid_out = tuple((_laid_out([p.numel() for _, p in s.params if p.requires_grad]),
                          _laid_out([p.numel() for _, p in s.params if not p.requires_grad])) for s in specs)
        held_whole = tuple(_laid_out([p.numel() for _, p in s.params if p.requires_grad and id(p) in whole])
                           for s in specs) if whole else None
        return cls(units=units, buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
                   laid_out=laid_out, whole=held_whole)


def _laid_out(numels: list[int]) -> int:
    """Elements a flat buffer of these parameters spans, gaps included (at most: the engine orders them by
    optimizer param group, which moves which one is last and needs no gap after it)."""
    return sum(-(-n // SHARD_ALIGN) * SHARD_ALIGN for n in numels)


def estimate(counts: ModelCounts, setting: Setting, work: Workload, trace: ActivationTrace | None) -> Estimate:
    """The per-rank bytes of `setting` (see the module doc for every term's formula)."""
    c = DTYPE_BYTES[work.mixed_precision]
    dtype = COMPUTE_DTYPES.get(work.mixed_precision, torch.float32)
    k = work.optimizer_states
    policy = StagePolicy(stage=setting.stage, world=work.world, rank=0,
                         persistence_threshold=work.persistence_threshold,
                         offload_param=setting.offload_param != "none")
    homes = unit_state_homes(counts, setting)
    gpu = dict(params=0, grads=0, optimizer=0, buffers=counts.buffer_bytes)
    host = dict(params=0, grads=0, optimizer=0, buffers=0)
    nvme = 0
    transient: list[int] = []
    gathered = [0] * len(counts.units)
    root_gathered = 0
    largest_state = 0
    step_transient = 0
    largest_staged, largest_resident, streamed_compact = 0, 0, False
    largest_host_stepped = 0
    largest_packed = 0
    split = master_travels_split(setting, work)
    narrow = work.optimizer_state != "fp32"
    for u, (_, true_trainable, true_frozen) in enumerate(counts.units):
        unit_numel = true_trainable + true_frozen
        trainable, frozen = counts.laid_out[u] if counts.laid_out is not None else (true_trainable, true_frozen)
        transient.append(0)
        whole = counts.whole[u] if counts.whole is not None else 0
        for numel, is_trainable, is_whole in ((trainable - whole, True, False), (whole, True, True),
                                              (frozen, False, False)):
            if numel == 0:
                continue
            # a per-parameter optimizer's groups keep their state on the device, stepped whole by owners
            pl = policy.placement(trainable=is_trainable, unit_numel=unit_numel,
                                  state_home=StateHome.DEVICE if is_whole else homes[u])
            lay = plan_layout([numel], pl.shard_world, align=SHARD_ALIGN)
            compact = is_trainable and not is_whole and keeps_compact_grads(
                pl, world=work.world, low_precision=c != 4,
                gradient_accumulation_steps=work.gradient_accumulation_steps)
            if is_whole and pl.shard_world > 1:  # the step's full fp32 gradient, master and summed result
                step_transient = max(step_transient, 3 * 4 * lay.padded_numel)
            b = group_buffers(lay, pl, trainable=is_trainable, compute_dtype=dtype, compact=compact,
                              optimizer_states=k, accumulates=work.gradient_accumulation_steps > 1)
            if b.params_released:
                (host if b.param_shard.host else gpu)["params"] += b.param_shard.nbytes
                if u == 0:
                    root_gathered += b.param_flat.nbytes
                else:
                    gathered[u] += b.param_flat.nbytes
            else:
                gpu["params"] += b.param_flat.nbytes
            if not is_trainable:
                continue
            state = host if b.grad_shard.host else gpu
            state["grads"] += b.grad_shard.nbytes
            if b.step_upcast is not None:  # compact: stepped from a transient fp32 copy, one group at a time
                step_transient = max(step_transient, b.step_upcast.nbytes)
            # narrow state kept on the device is stepped in the stream too, in a slot of its own, widened from its
            # home in place ([Note: resident chunks] in zerofit.engine.offload.gpu)
            resident = narrow and not is_whole and not pl.offloaded
            if pl.gpu_stepped or resident:
                streamed_compact = streamed_compact or compact
            if pl.gpu_stepped:
                largest_staged = max(largest_staged, lay.shard_numel)
            elif resident:
                largest_resident = max(largest_resident, lay.shard_numel)
            if pl.host_stepped and not is_whole:
                largest_host_stepped = max(largest_host_stepped, lay.shard_numel)
            master = b.master.nbytes if b.master is not None else 0
            if b.master is not None and packs_master(pl, bf16=work.mixed_precision == "bf16",
                                                     nvme=setting.offload_optimizer == "nvme"):
                master = packed_bytes(lay.shard_numel)  # kept packed between steps
                largest_packed = max(largest_packed, lay.shard_numel)
            states = state_nbytes(k * lay.shard_numel, "fp32" if is_whole else work.optimizer_state)
            if setting.offload_optimizer == "nvme" and pl.offloaded:  # in files
                nvme += master + states
                largest_state = max(largest_state, master + states)
            else:  # with the gradient shard, except GPU-stepped: state on the host, gradient on the GPU
                (host if b.optimizer_state.host else gpu)["optimizer"] += master + states
            for extra in (b.grad_staging, b.grad_flat):  # host staging; stage 1's persistent full gradient
                if extra is not None:
                    (host if extra.host else gpu)["buffers"] += extra.nbytes
            for moving in (b.grad_transient, b.reduce_output):
                if moving is not None:
                    transient[u] += moving.nbytes
    fused = fused_kernels.available()  # on a CUDA device: the codec and the split master need no scratch
    if largest_staged:  # the device buffers GPU-stepped offload streams the state through
        gpu["buffers"] += stream_pool_bytes(largest_staged, state_tensors=k, compact=streamed_compact,
                                            offload_params=setting.offload_param != "none", compute_bytes=c,
                                            split=split, fused=fused)
        if narrow:  # each slot also stages a host home's state chunks in their stored form
            gpu["buffers"] += STREAM_SLOTS * state_nbytes(k * min(STREAM_CHUNK, largest_staged),
                                                          work.optimizer_state)
    if largest_resident:  # narrow state on the device is widened chunk by chunk in a slot of its own
        gpu["buffers"] += home_slot_bytes(largest_resident, state_tensors=k, compact=streamed_compact)
    if work.optimizer_state == "8bit" and not fused:  # the codec's int32 scratch, one chunk's ([Note: codec scratch])
        gpu["buffers"] += min(STREAM_CHUNK, max(largest_staged, largest_resident)) * 4
    host["buffers"] += largest_packed * 4  # one packed group's fp32 master while it is built, read or written
    if narrow:  # the host stepper widens one group's narrow state at a time into fp32 scratch
        host["buffers"] += k * largest_host_stepped * 4
    if setting.offload_optimizer == "nvme":  # the swapper's pool: one slot per buffer, at most one per group
        offloaded = sum(h is not StateHome.DEVICE for h in homes)
        host["optimizer"] += max(1, min(work.nvme_buffer_count, offloaded)) * largest_state
    activations, in_use = 0, sum(sorted(gathered)[-2:])
    if trace is not None:
        peak, in_use = trace.peak_parts(transient, gathered)
        activations = peak - in_use
    activations = max(activations, step_transient)  # the step runs after backward freed its activations
    gpu["buffers"] += root_gathered + in_use
    kept = kept_bytes([root_gathered, *gathered[1:]], None if work.max_live_parameters is None
                      else work.max_live_parameters * c)
    return Estimate(setting=setting, params=gpu["params"], grads=gpu["grads"], optimizer=gpu["optimizer"],
                    activations=activations, buffers=gpu["buffers"], host_params=host["params"],
                    host_grads=host["grads"], host_optimizer=host["optimizer"], host_buffers=host["buffers"],
                    nvme=nvme, traced=trace is not None, kept_gathered=kept)


def kept_bytes(gathered: list[int], budget: int | None) -> int:
    """Bytes no-grad forwards keep of units gathering these bytes, root first, admitted in order while they
    fit `budget` (None: all), as `zerofit.engine.kept.KeptUnits` admits them."""
    kept = 0
    for size in gathered:
        if budget is None or kept + size <= budget:
            kept += size
    return kept


def state_nbytes(numel: int, kind: str) -> int:
    """Bytes of `numel` optimizer state elements stored as `kind` (precision.optimizer_state): 8bit counts
    its per-block fp32 scales (a state tensor's elements are a multiple of the block, as shards are)."""
    return math.ceil(numel * Codec(kind).bytes_per_element())


def master_travels_split(setting: Setting, work: Workload) -> bool:
    """GPU-stepped state's master crosses the link split (bf16 parameters, on the GPU or offloaded; state not
    in NVMe files): what the engine's `GpuStep` decides per group (zerofit.engine.offload.master_split)."""
    return (work.mixed_precision == "bf16" and setting.offload_optimizer == "cpu" and setting.step_on == "device")


def unit_state_homes(counts: ModelCounts, setting: Setting) -> list[StateHome]:
    """Where each unit's optimizer state lives under `setting`, by the engine's own rule (`state_homes`)."""
    return state_homes([t + f for _, t, f in counts.units],
                       ratio=setting.offload_ratio if setting.offload_optimizer != "none" else 0.0,
                       step_on=setting.step_on, host_share=setting.host_share)


def offloaded_split(counts: ModelCounts, setting: Setting) -> tuple[int, int]:
    """(GPU-stepped, host-stepped) trainable elements of `setting`'s offloaded units, as the engine picks
    them (`unit_state_homes`)."""
    homes = unit_state_homes(counts, setting)
    trainable = [t for _, t, _ in counts.units]
    return (sum(t for t, h in zip(trainable, homes) if h is StateHome.GPU_STEPPED),
            sum(t for t, h in zip(trainable, homes) if h is StateHome.HOST_STEPPED))


def all_settings(world: int, *, checkpointing: tuple[bool, ...] = (False, True),
                 nvme: bool = False, offload_ratio: float = 1.0, step_on: str = "host",
                 host_share: float = 0.0) -> list[Setting]:
    """Every setting worth listing, fastest first (see `zerofit.plan.choose` for the order); those that
    offload the optimizer state offload `offload_ratio` of it, stepped `step_on` (CPU offload only)."""
    base = [Setting(stage=0), Setting(stage=1), Setting(stage=2), Setting(stage=3),
            Setting(stage=2, offload_optimizer="cpu"), Setting(stage=3, offload_optimizer="cpu"),
            Setting(stage=3, offload_optimizer="cpu", offload_param="cpu")]
    if nvme:
        base.append(Setting(stage=3, offload_optimizer="nvme", offload_param="cpu"))
    if world == 1:  # one rank: stages 1-3 shard nothing, so they cost what stage 0 costs
        base = [s for s in base if s.stage == 0 or (s.offload_optimizer != "none" and (s.stage == 2) == (
            s.offload_param == "none"))]
    return [Setting(stage=s.stage, offload_optimizer=s.offload_optimizer, offload_param=s.offload_param,
                    checkpointing=ck, offload_ratio=offload_ratio if s.offload_optimizer != "none" else 1.0,
                    step_on=step_on if s.offload_optimizer == "cpu" else "host",
                    host_share=host_share if s.offload_optimizer == "cpu" and step_on == "device" else 0.0)
            for ck in checkpointing for s in base]

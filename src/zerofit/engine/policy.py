"""ZeRO stages as policies: what is sharded, and when gradients are reduced.

The engine never asks "which stage is this?"; it asks the policy. Stage 0 is the DDP baseline: full
replicas, gradients all-reduced once per optimizer step. Each higher stage shards one more thing:

| stage | optimizer state + master | gradients                          | parameters           |
|-------|--------------------------|------------------------------------|----------------------|
| 0     | replicated               | all-reduced at the step            | replicated           |
| 1     | sharded                  | reduce-scattered at the step       | replicated           |
| 2     | sharded                  | reduce-scattered every micro-step  | replicated           |
| 3     | sharded                  | reduce-scattered every micro-step  | sharded between uses |

With optimizer offload, `state_homes` says where each unit's optimizer state lives and who steps it
(a `StateHome`: on the device, host-stepped or GPU-stepped); the planner's memory model calls it too.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from zerofit.errors import EngineError

if TYPE_CHECKING:
    from zerofit.config.schema import PrecisionConfig

COMPUTE_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16})
"""The compute dtype of each `precision.mixed_precision` value (the engine's and the planner's)."""

COMMUNICATION_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16})
"""The dtype gradients are reduced in for each `precision.communication_data_type` value (see
[Note: gradients on the wire] in zerofit.engine.unit)."""


def communication_dtype(precision: PrecisionConfig) -> torch.dtype:
    """The dtype gradients are reduced in under `precision` (a `PrecisionConfig`)."""
    name = precision.communication_data_type
    if name not in COMMUNICATION_DTYPES:
        raise EngineError(f"precision.communication_data_type must be fp32, bf16 or fp16 (got {name!r}): fp32 "
                         "reduces gradients exactly; bf16 halves the bytes sent")
    return COMMUNICATION_DTYPES[name]


class StateHome(enum.Enum):
    """Where a trainable group's fp32 master and optimizer state live, and who steps them. With
    `offload_optimizer.device: nvme` an offloaded group's home is its file instead of host memory
    (`NvmeSwapper`): the same two ways of stepping, so no members of their own."""

    DEVICE = "device"
    """On the device, stepped there (no offload, or a unit `offload_optimizer.ratio` leaves there)."""
    HOST_STEPPED = "host-stepped"
    """Master, gradient shard and state in host memory; the CPU optimizer steps them (zerofit.engine.offload.host)."""
    GPU_STEPPED = "GPU-stepped"
    """Master and state in host memory, streamed through the device and stepped there chunk by chunk; the
    gradient shard stays on the device (see [Note: GPU-stepped offload] in zerofit.engine.offload.gpu)."""


@dataclass(frozen=True)
class GroupPlacement:
    """How one flat group is held, decided by the stage policy."""

    shard_world: int
    """Ranks the optimizer state and gradient shards are split over (1: not split)."""
    rank: int
    shard_params: bool
    """Parameters exist only as shards between uses (stage 3, above the persistence threshold)."""
    keep_full_grads: bool
    """Full gradients persist across micro-steps (stages 0-1); else reduced every micro-step."""
    state_home: StateHome = StateHome.DEVICE
    """Where the fp32 master and optimizer state live, and who steps them (frozen groups: DEVICE)."""
    offload_params: bool = False
    """The parameter shard lives in host memory and is uploaded for each gather (stage 3)."""

    @property
    def host_stepped(self) -> bool:
        """Master, gradient shard and optimizer state in host memory, stepped there (`StateHome.HOST_STEPPED`)."""
        return self.state_home is StateHome.HOST_STEPPED

    @property
    def gpu_stepped(self) -> bool:
        """Master and optimizer state in host memory, stepped on the device (`StateHome.GPU_STEPPED`)."""
        return self.state_home is StateHome.GPU_STEPPED

    @property
    def offloaded(self) -> bool:
        """The optimizer state lives off the device, host-stepped or GPU-stepped."""
        return self.state_home is not StateHome.DEVICE


@dataclass(frozen=True)
class StagePolicy:
    stage: int
    world: int
    rank: int
    persistence_threshold: int
    offload_param: bool = False
    """Stage 3 parameter shards live in host memory (so stage 3 shards even on one rank)."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3 (got {self.stage})")

    @property
    def shards_optimizer(self) -> bool:
        return self.stage >= 1 and self.world > 1

    @property
    def reduces_every_micro_step(self) -> bool:
        """Only the gradient shard is kept, so each micro-step's gradients are reduced as they appear."""
        return self.stage >= 2 and self.world > 1

    def shards_params_of(self, unit_numel: int) -> bool:
        """Stage 3 shards a unit's parameters unless it is small enough to stay whole."""
        return (self.stage == 3 and (self.world > 1 or self.offload_param)
                and unit_numel >= self.persistence_threshold)

    def placement(self, *, trainable: bool, unit_numel: int,
                  state_home: StateHome = StateHome.DEVICE) -> GroupPlacement:
        """`state_home`: where the unit's optimizer state lives (see `state_homes`); a frozen group has none."""
        shard_params = self.shards_params_of(unit_numel)
        shard_world = self.world if (shard_params or (trainable and self.shards_optimizer)) else 1
        home = state_home if trainable else StateHome.DEVICE
        host_stepped = home is StateHome.HOST_STEPPED
        return GroupPlacement(shard_world=shard_world, rank=self.rank if shard_world > 1 else 0,
                              shard_params=shard_params,
                              # host-stepped gradients go to the host as soon as they are reduced
                              keep_full_grads=trainable and not self.reduces_every_micro_step and not host_stepped,
                              state_home=home, offload_params=shard_params and self.offload_param)


STEP_ON = ("auto", "host", "device")
"""Values of `offload_optimizer.step_on`."""


def step_on_for(step_on: str, *, cuda: bool, nvme: bool) -> str:
    """Where offloaded optimizer state is stepped: "host" (the CPU optimizer on host memory) or "device"
    (streamed through the accelerator). "auto": the device on a CUDA machine - the same fused kernel
    as without offload, no gradient download, no parameter upload, the CPU cores left free - else the
    host; NVMe-homed state is stepped on the host unless "device" is written (then it streams from its
    files through the GPU: see [Note: GPU-stepped offload from NVMe] in zerofit.engine.offload.nvme).
    The engine and the planner both ask this."""
    if step_on == "auto":
        return "device" if cuda and not nvme else "host"
    return step_on


def host_share_for(step_on: str, host_share: float | None, *, cuda: bool, nvme: bool) -> float:
    """The share of the offloaded optimizer state stepped on the host (the rest is GPU-stepped): 1 where
    `step_on_for` says "host"; where it says "device", `host_share` (None: not written, or not resolved
    from measured rates: 0, all GPU-stepped)."""
    where = step_on_for(step_on, cuda=cuda, nvme=nvme)
    if where == "device" and host_share is not None:
        return float(host_share)
    return 1.0 if where == "host" else 0.0


def keeps_compact_grads(placement: GroupPlacement, *, world: int, gradient_accumulation_steps: int,
                        low_precision: bool) -> bool:
    """True when a trainable group's gradient can stay in the compute dtype, exactly: one rank (nothing
    to reduce), one micro-step per step (nothing to add up), bf16/fp16 compute, state on the device
    (see [Note: compact gradients] in zerofit.engine.step_mode). The engine and the planner both ask this."""
    return world == 1 and gradient_accumulation_steps == 1 and low_precision and not placement.host_stepped


def packs_master(placement: GroupPlacement, *, bf16: bool, nvme: bool) -> bool:
    """True when a trainable group's host master is kept packed between steps: GPU-stepped from host memory with
    bf16 parameters, where the master travels split ([Note: packed master at rest] in
    zerofit.engine.offload.packed_master). The engine and the planner both ask this."""
    return bf16 and not nvme and placement.gpu_stepped and placement.offloaded


def offloaded_units(unit_numels: Sequence[int], ratio: float) -> frozenset[int]:
    """Indices of the units whose optimizer state goes to the host under `offload_optimizer.ratio`.

    Whole units are taken from the last one backwards (their gradients arrive first, leaving the host
    step the most time) until they hold at least `ratio` of all elements; the rest stay on the
    device. So ratio 1.0 takes every unit, and any ratio above 0 takes at least one.
    """
    total = sum(unit_numels)
    chosen: set[int] = set()
    taken = 0
    for index in reversed(range(len(unit_numels))):
        if taken >= ratio * total - 1e-9:
            break
        chosen.add(index)
        taken += unit_numels[index]
    return frozenset(chosen)


def offload_ratios(unit_numels: Sequence[int]) -> list[float]:
    """Every `offload_optimizer.ratio` that selects a different set of units, smallest first: the share of
    the last k units for k = 1..n (`offloaded_units` takes exactly those k for that ratio)."""
    total = sum(unit_numels)
    if total == 0:
        return [1.0]
    shares, taken = [], 0
    for numel in reversed(unit_numels):
        taken += numel
        share = min(1.0, taken / total)
        if numel and (not shares or share > shares[-1]):
            shares.append(share)
    shares[-1] = 1.0
    return shares


def host_stepped_units(unit_numels: Sequence[int], offloaded: frozenset[int], host_share: float) -> frozenset[int]:
    """Of the `offloaded` units, those stepped on the host under `host_share`: whole units from the last
    one backwards, as `offloaded_units` takes them (their gradients arrive first, so the host step and
    its copies start earliest), until they hold at least `host_share` of the offloaded elements; none
    for a share of 0, all for 1. The others are GPU-stepped."""
    if host_share <= 0:
        return frozenset()
    order = sorted(offloaded)
    chosen = offloaded_units([unit_numels[i] for i in order], host_share)
    return frozenset(order[i] for i in chosen)


def state_homes(unit_numels: Sequence[int], *, ratio: float, step_on: str, host_share: float) -> list[StateHome]:
    """Where each unit's optimizer state lives: the one rule the engine and the planner both call.

    `ratio`: `offload_optimizer.ratio` (0: no offload); `offloaded_units` picks the offloaded units.
    `step_on` ("host" or "device", as `step_on_for` resolves it): "host" steps them all on the host;
    "device" steps the share `host_share` of them on the host (`host_stepped_units`) and streams the
    rest through the device (GPU-stepped).
    """
    offloaded = offloaded_units(unit_numels, ratio) if ratio > 0 else frozenset()
    hosted = host_stepped_units(unit_numels, offloaded, host_share if step_on == "device" else 1.0)
    return [StateHome.HOST_STEPPED if i in hosted else StateHome.GPU_STEPPED if i in offloaded else StateHome.DEVICE
            for i in range(len(unit_numels))]

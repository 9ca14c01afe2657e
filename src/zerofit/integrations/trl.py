"""TRL's trainers on zerofit: change one import, launch with `zerofit launch --config_file X`.

    from zerofit.integrations.trl import GRPOTrainer      # was: from trl import GRPOTrainer

Exported: every trainer of TRL's top-level package (TRL 1.16): `SFTTrainer`, `DPOTrainer`,
`GRPOTrainer`, `RLOOTrainer`, `RewardTrainer`, `KTOTrainer`, `DistillationTrainer`. Each is TRL's own
class with `ZerofitTrainerMixin` in front (zerofit.integrations.transformers); nothing in TRL is patched.

How the mixin route really behaves (exported classes and `class X(ZerofitTrainerMixin, trl.SomeTrainer)` alike):

* Trainer and TRL take their plain data-parallel paths and zerofit's engine shards behind them. TRL keys
  its DeepSpeed paths off three things, each answering "no DeepSpeed" under zerofit: `args.deepspeed_plugin`
  (None: `--deepspeed` is refused, the config goes to `zerofit launch`), `trainer.is_deepspeed_enabled`
  (False) and `trainer.accelerator.state.deepspeed_plugin` (None under Trainer, so TRL's `DistributedBackend`
  reports no ZeRO-3 and `unwrap_model_for_generation` never imports deepspeed). Generation inside training
  (GRPO's and RLOO's rollouts, distillation's on-policy samples) runs on the prepared model; at ZeRO-3 its
  ranks run transformers' synced loop, so ranks that stop early keep gathering with the others.
* Accelerate's own global state (`PartialState`, `AcceleratorState`) is built from zerofit's run when the
  Trainer builds its Accelerator (zerofit.integrations.accelerate_state): `set_seed(seed, device_specific=True)`,
  which GRPO, RLOO and distillation call, seeds each rank with seed + its process index, as under Accelerate.
* Every extra model a trainer hands to `accelerator.prepare_model(model, evaluation_mode=True)` is prepared
  frozen, without an optimizer, sharded and offloaded as the config says: DPO's and KTO's reference model,
  GRPO's and RLOO's reference model (`beta > 0`, built from the policy's path), their reward models, and
  `DistillationTrainer`'s teacher.
* `DistillationTrainer` is refused at ZeRO-3 (and `stage: auto`, which may choose it): its loss reads both
  models' `lm_head.weight` directly, outside the head's forward, where a ZeRO-3 weight is a released shard.
* vLLM generation (`use_vllm=True`) is refused when the Trainer is built: TRL copies `param.data` to vLLM
  parameter by parameter, which under ZeRO-3 is an empty shard, and the weight sync is untested under zerofit.

`trl.experimental` trainers through `class X(ZerofitTrainerMixin, trl.experimental.<name>.<Trainer>)`:
`OnlineDPOTrainer` (without vLLM; its reference and reward models are prepared frozen), `ORPOTrainer` and
`CPOTrainer` (no extra model) build and train at ZeRO-3 on 2 CPU ranks; they are not exported nor tested
against TRL's own runs. Trainers that keep a second trained model, talk to a generation server or
another process (async GRPO, server distillation) are not supported.
"""

from __future__ import annotations

import trl

from zerofit.config.schema import is_auto
from zerofit.errors import ConfigError
from zerofit.integrations.transformers import ZerofitTrainerMixin

__all__ = ["DPOTrainer", "DistillationTrainer", "GRPOTrainer", "KTOTrainer", "RLOOTrainer", "RewardTrainer",
           "SFTTrainer", "ZerofitTrainerMixin"]


class SFTTrainer(ZerofitTrainerMixin, trl.SFTTrainer):
    """TRL's `SFTTrainer` on zerofit's ZeRO engine."""


class DPOTrainer(ZerofitTrainerMixin, trl.DPOTrainer):
    """TRL's `DPOTrainer` on zerofit's ZeRO engine; the reference model is prepared frozen."""


class GRPOTrainer(ZerofitTrainerMixin, trl.GRPOTrainer):
    """TRL's `GRPOTrainer` on zerofit's ZeRO engine; the reference model (`beta > 0`) and reward models are
    prepared frozen; generation runs on the prepared policy (no vLLM)."""


class RLOOTrainer(ZerofitTrainerMixin, trl.RLOOTrainer):
    """TRL's `RLOOTrainer` on zerofit's ZeRO engine; reference and reward models are prepared frozen."""


class RewardTrainer(ZerofitTrainerMixin, trl.RewardTrainer):
    """TRL's `RewardTrainer` on zerofit's ZeRO engine."""


class KTOTrainer(ZerofitTrainerMixin, trl.KTOTrainer):
    """TRL's `KTOTrainer` on zerofit's ZeRO engine; the reference model is prepared frozen."""


class DistillationTrainer(ZerofitTrainerMixin, trl.DistillationTrainer):
    """TRL's `DistillationTrainer` on zerofit's ZeRO engine at stages 0-2; the teacher is prepared frozen."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        stage = self.accelerator.config.zero.stage
        if is_auto(stage) or stage == 3:
            # Its loss projects hidden states through `lm_head.weight` read directly (TRL's chunked divergence
            # kernel), outside the head's forward: under ZeRO-3 that weight is an empty shard there.
            raise ConfigError(
                f"zero_optimization.stage is {stage!r}, but DistillationTrainer reads the student's and teacher's "
                "lm_head.weight outside their forward, where ZeRO-3 holds only a released shard: set "
                "zero_optimization.stage to 2 or lower (with offload_optimizer where memory is short)")

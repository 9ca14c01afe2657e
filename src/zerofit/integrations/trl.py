"""TRL's trainers on zerofit: change one import, launch with `zerofit launch --config_file X`.

    from zerofit.integrations.trl import SFTTrainer      # was: from trl import SFTTrainer

Each is TRL's own class with `ZerofitTrainerMixin` in front (see zerofit.integrations.transformers):
TRL builds on transformers' `Trainer` and keys its DeepSpeed branches off `args.deepspeed_plugin`, which
stays None, so its plain paths run and zerofit's engine shards behind them. `DPOTrainer`'s reference
model goes through `accelerator.prepare_model`: zerofit prepares it frozen, without an optimizer
(sharded like the trained model at stage 3). Another TRL trainer gets the same with
`class MyTrainer(ZerofitTrainerMixin, trl.SomeTrainer)`.
"""

from __future__ import annotations

import trl

from zerofit.integrations.transformers import ZerofitTrainerMixin

__all__ = ["DPOTrainer", "SFTTrainer", "ZerofitTrainerMixin"]


class SFTTrainer(ZerofitTrainerMixin, trl.SFTTrainer):
    """TRL's `SFTTrainer` on zerofit's ZeRO engine."""


class DPOTrainer(ZerofitTrainerMixin, trl.DPOTrainer):
    """TRL's `DPOTrainer` on zerofit's ZeRO engine; the reference model is prepared frozen."""

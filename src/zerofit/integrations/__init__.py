"""zerofit under other libraries' training loops, each through that library's own extension points.

`zerofit.integrations.transformers`: transformers' `Trainer`, `Seq2SeqTrainer`, `ZerofitTrainerMixin`.
`zerofit.integrations.trl`: every trainer of TRL's top-level package (SFT, DPO, GRPO, RLOO, Reward, KTO,
Distillation).
Importing a submodule imports its library (they are not zerofit dependencies).
"""

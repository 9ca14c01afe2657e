"""zerofit under other libraries' training loops, each through that library's own extension points.

`zerofit.integrations.transformers`: transformers' `Trainer`, `Seq2SeqTrainer`, `ZerofitTrainerMixin`.
`zerofit.integrations.trl`: TRL's `SFTTrainer`, `DPOTrainer`.
Importing a submodule imports its library (they are not zerofit dependencies).
"""

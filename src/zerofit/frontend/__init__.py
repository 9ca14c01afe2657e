"""The layer a training script touches: `Accelerator` and what `prepare()` returns.

`accelerator` (the facade) composes: `prepare` (what each prepared object becomes), `state` (who this
process is, where the loop stands), `data/` (sharded dataloaders and their sample order), `optimizers` /
`schedulers` (when a script's call takes effect), `persistence` (save_state / load_state / save_model over
`zerofit.checkpoint`), `script_config` ("auto" values completed from the script), `tracking/` (experiment
trackers), `ops` (collectives on nested data), `utils` (`zerofit.utils`), `local_sgd` (`zerofit.local_sgd`),
and `planning/`, the run-time control of the planner's choices (`stage: auto` at prepare(), the first
step's check, out-of-memory back-off). Below it sit the engine,
the checkpoint package, the offline planner (`zerofit.plan`) and the process-group plumbing
(`zerofit.distributed`); none of them is handed an Accelerator.
"""

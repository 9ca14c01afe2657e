"""transformers' `Trainer` on zerofit: change one import, launch with `zerofit launch --config_file X`.

    from zerofit.integrations.transformers import Trainer      # was: from transformers import Trainer
    # zerofit launch --config_file ds_zero3.json train.py --per_device_train_batch_size 8 ...

`Trainer` and `Seq2SeqTrainer` are transformers' own classes with `ZerofitTrainerMixin` in front; any
other Trainer subclass gets the same by putting the mixin first: `class MyTrainer(ZerofitTrainerMixin,
SomeTrainer)`. The mixin replaces only what must change for a sharded engine, through methods
transformers documents for overriding where it has them:

* `create_accelerator_and_postprocess` builds a `zerofit.Accelerator` from the launch config completed
  from TrainingArguments (`zerofit.integrations.trainer_config`), and tells Trainer to take its plain
  data-parallel paths (`is_deepspeed_enabled` / `is_fsdp_enabled` False): zerofit's engine does the
  sharding behind the same calls. TrainingArguments that count another world than zerofit's are refused
  there (`_refuse_other_world`): Trainer decides its main process, logged batch and loss scale from them.
  TRL's `ds3_gather_for_generation` (False: stream the units in generation) sets the Accelerator's
  `keep_gathered_in_generation` ([Note: kept units] in zerofit.engine.kept).
* `create_optimizer` / `create_scheduler` build the config's `optimizer` / `scheduler` sections when it
  has them (DeepSpeed's rule: the file's optimizer replaces Trainer's), else Trainer's own.
* `save_model` gathers on every rank (the weights of a ZeRO-3 model live on all of them) and lets
  rank 0 write what `save_pretrained` writes: sharded safetensors, or with PEFT the adapter alone (and
  then gathers the adapter alone: [Note: an adapter's save gathers the adapter]).
* `_save_optimizer_and_scheduler` / `_load_optimizer_and_scheduler` (private: no public hook exists)
  write and read zerofit's sharded checkpoint in `checkpoint-N/zerofit_state/` (a PEFT model's without
  its frozen base, [Note: a checkpoint without the frozen weights]), so
  `resume_from_checkpoint` works at another world size, stage or offload; `_load_best_model` (private)
  reads the best checkpoint's `zerofit_state/` for `load_best_model_at_end`. tests/test_trainer_surface.py
  pins each private name and signature this module relies on.
* `get_resumed_dataloader` skips with zerofit's own dataloader; `_move_model_to_device` (private) leaves
  placing the model to `prepare()`, which shards it first.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import torch
import transformers
from transformers.trainer import SCHEDULER_NAME

from zerofit.distributed import process_group, runtime
from zerofit.errors import CheckpointError, ConfigError
from zerofit.frontend import ops
from zerofit.frontend.accelerator import Accelerator
from zerofit.frontend.lowbit_optimizers import trainer_optim
from zerofit.frontend.plugins import DataLoaderConfiguration
from zerofit.frontend.schedulers import AcceleratedScheduler
from zerofit.frontend.state import AcceleratorState
from zerofit.frontend.utils import DummyOptim, DummyScheduler
from zerofit.integrations.accelerate_state import share_with_accelerate
from zerofit.integrations.adapter_keys import is_peft_model, saved_adapter_keys
from zerofit.integrations.trainer_config import TrainerFacts, scheduler_filled, trainer_config

ZEROFIT_STATE = "zerofit_state"
"""The folder inside Trainer's `checkpoint-N/` that holds zerofit's sharded optimizer and master weights."""


class ZerofitTrainerMixin:
    """Runs a transformers `Trainer` (or subclass) on zerofit's ZeRO engine; put it first in the bases."""

    accelerator: Accelerator

    def create_accelerator_and_postprocess(self) -> None:
        args = self.args
        _refuse_other_engines(args)
        rank, world = launched_world()
        _refuse_other_world(args, rank, world)
        facts = TrainerFacts.from_args(args, world=world)
        config = trainer_config(runtime.current_config(), facts)
        mapped = trainer_optim(facts.optim) if config.optimizer is None else None
        if mapped is not None and rank == 0:
            print(mapped.said(f"--optim {facts.optim}"), flush=True)
        ac = args.accelerator_config
        loaders = DataLoaderConfiguration(split_batches=bool(ac.split_batches), even_batches=bool(ac.even_batches),
                                          use_seedable_sampler=bool(ac.use_seedable_sampler), data_seed=args.data_seed)
        compiled = ({"backend": args.torch_compile_backend or "inductor", "mode": args.torch_compile_mode}
                    if getattr(args, "torch_compile", False) else None)  # compiled in place at prepare()
        self.accelerator = TrainerAccelerator(config=config, gradient_accumulation_steps=1, dataloader_config=loaders,
                                              cpu=bool(getattr(args, "use_cpu", False)), dynamo_plugin=compiled)
        self.accelerator.trained_model = self.model
        share_with_accelerate(self.accelerator)  # TRL's set_seed(device_specific=True) asks Accelerate's state
        # TRL's switch for DeepSpeed's gather of the whole model around generate(): False streams the units.
        self.accelerator.keep_gathered_in_generation = bool(getattr(args, "ds3_gather_for_generation", True))
        self.accelerator.planning_accumulation = facts.accumulation  # [Note: Trainer owns the loop]
        self.gather_function = functools.partial(self.accelerator.gather_for_metrics,
                                                 use_gather_object=args.eval_use_gather_object)
        # zerofit's engine shards behind the plain data-parallel calls: Trainer's DeepSpeed and FSDP
        # branches (their engines' own checkpoint formats, deepspeed_init) must not run.
        self.is_deepspeed_enabled = False
        self.is_fsdp_enabled = False

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        """Nothing: `prepare()` places the model, after sharding it (a ZeRO-3 model never lands on one
        GPU whole, as it would if Trainer moved it at construction)."""

    # --- optimizer and schedule ---------------------------------------------------------------
    def create_optimizer(self, model: torch.nn.Module | None = None) -> Any:
        """The config's optimizer section when it has one (its "auto" values are TrainingArguments'),
        over Trainer's parameter groups (weight decay off for biases and norms); else Trainer's own."""
        if self.accelerator.config.optimizer is None or self.optimizer is not None:
            return super().create_optimizer(model)
        model = model if model is not None else self.model
        decay = set(self.get_decay_parameter_names(model))
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in trainable if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0}]
        self.optimizer = DummyOptim([g for g in groups if g["params"]], lr=self.args.learning_rate,
                                    weight_decay=self.args.weight_decay)
        return self.optimizer

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: Any, model: Any = None) -> tuple[Any, Any]:
        """Trainer's own, except for the 8-bit `--optim` names (bitsandbytes', torchao's): torch's optimizer
        with Trainer's lr, betas and eps (weight decay comes with the param groups), run with
        `precision.optimizer_state` 8bit ([Note: low-bit optimizers of other libraries])."""
        mapped = trainer_optim(str(getattr(args.optim, "value", args.optim)))
        if mapped is None:
            return transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
        return mapped.torch_class, {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2),
                                    "eps": args.adam_epsilon}

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The config's scheduler section when it has one (total and warmup steps from Trainer's
        schedule), prepared by zerofit; else Trainer's own schedule on the prepared optimizer."""
        acc = self.accelerator
        if acc.config.scheduler is None:
            return super().create_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is None:
            acc.config = scheduler_filled(acc.config, total_steps=num_training_steps,
                                          warmup_steps=self.args.get_warmup_steps(num_training_steps),
                                          lr=self.args.learning_rate)
            self.lr_scheduler = acc.prepare(DummyScheduler(optimizer if optimizer is not None else self.optimizer))
            self._created_lr_scheduler = True
        return self.lr_scheduler

    # --- saving and resuming ------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """What `save_pretrained` writes (sharded safetensors, or a PEFT model's adapter), gathered on
        every rank and written by the main process. Every process must call it, as Trainer does."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.accelerator.is_prepared(self.model):  # not trained yet (save before train): Trainer's own
            return super().save_model(output_dir, _internal_call)
        # a PEFT adapter's entries, the main process's choice on all (which files exist may differ per machine)
        keys = ops.broadcast_object_list([saved_adapter_keys(self.model) if self.accelerator.is_main_process
                                          else None])[0]
        state_dict = self.accelerator.get_state_dict(self.model, keys=keys)
        if self.args.should_save:  # `_save` writes wherever it is called in transformers < 5.20: the main process only
            # before `save_pretrained`, which empties the dict as it writes; an adapter's dtype is not the model's
            written = _main_dtype(state_dict) if keys is None else None
            self._save(output_dir, state_dict=state_dict)
            _record_saved_dtype(output_dir, written)
        elif _runs_forward_to_save(self.model):
            # [Note: saving runs a forward] the main process runs the same inside `_save`
            self.model.save_pretrained(output_dir, state_dict=state_dict, is_main_process=False)
        self.accelerator.wait_for_everyone()  # the files exist on return, on every rank
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # no `latest` pointer beside it: Trainer finds its checkpoints by their checkpoint-N names
        # a PEFT model's frozen base is not written (as Trainer does under DeepSpeed): the resumed run loads it
        # guard=False: checkpoint-N is Trainer's folder, which transformers names, replaces and rotates itself
        self.accelerator._save(os.path.join(output_dir, ZEROFIT_STATE), update_latest=False, guard=False,
                               exclude_frozen=is_peft_model(self.model))
        if self.args.should_save and not isinstance(self.lr_scheduler, AcceleratedScheduler):
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        state = os.path.join(checkpoint, ZEROFIT_STATE)
        if not os.path.isdir(state):
            raise CheckpointError(
                f"resume_from_checkpoint={checkpoint}: it has no {ZEROFIT_STATE}/ folder, so it was not written by "
                "a zerofit Trainer and holds no optimizer state zerofit can read. Resume it with the launcher "
                "that wrote it, or start a new run from its weights (--model_name_or_path "
                f"{checkpoint}) without resume_from_checkpoint")
        self.accelerator.load_state(state)
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if not isinstance(self.lr_scheduler, AcceleratedScheduler) and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))

    def _load_best_model(self) -> None:
        """The best checkpoint's weights, through zerofit's own checkpoint of it. Trainer's loads them with
        `model.load_state_dict`, which at ZeRO-3 writes into released parameter storage (a segfault) and
        in bf16 reaches only the compute copies, not the fp32 masters that `save_model` writes."""
        best = self.state.best_model_checkpoint
        state = os.path.join(best, ZEROFIT_STATE)
        if not os.path.isdir(state):
            raise CheckpointError(
                f"load_best_model_at_end: the best checkpoint {best} has no {ZEROFIT_STATE}/ folder, and zerofit loads "
                "the best weights from it: resume from or point to a checkpoint zerofit's Trainer wrote, or drop "
                "--load_best_model_at_end")
        self.accelerator.load_state(state)

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        return self.accelerator.skip_first_batches(dataloader, num_batches)


class TrainerAccelerator(Accelerator):
    """The Accelerator a zerofit Trainer holds: `prepare_model(model, evaluation_mode=True)` of the trained
    model before training (Trainer's `evaluate()` before `train()`) only places it on the device, so
    that `train()` can still prepare it with its optimizer; it evaluates unsharded then. Any other
    model asked for evaluation (DPO's reference model) is prepared frozen, sharded as the config says."""

    trained_model: torch.nn.Module | None = None
    _checkpoint_dataloaders = False  # Trainer saves and restores its data position itself (trainer_state.json)

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.state = PlainPathState(self)

    def prepare_model(self, model: torch.nn.Module, device_placement: Any = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        if evaluation_mode and model is self.trained_model and not self.is_prepared(model):
            return model.to(self.device)
        return super().prepare_model(model, device_placement, evaluation_mode)


class PlainPathState(AcceleratorState):
    """`accelerator.state` under Trainer: `deepspeed_plugin` is None, as `trainer.is_deepspeed_enabled` is False.

    Trainer and TRL take their plain data-parallel paths and zerofit's engine shards behind them; libraries
    key their DeepSpeed paths off `accelerator.state.deepspeed_plugin` (TRL's `DistributedBackend`: a plugin
    with `zero_stage == 3` makes `unwrap_model_for_generation` import deepspeed to gather the weights).
    The run's ZeRO settings stay readable in `accelerator.config`; a script on `zerofit.Accelerator` keeps
    the DeepSpeed-shaped `deepspeed_plugin` (zerofit.frontend.state.ZeroPlugin)."""

    @property
    def deepspeed_plugin(self) -> None:
        return None


def _main_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The floating dtype that holds most of `state_dict`'s elements (None: no floating tensor)."""
    counts: dict[torch.dtype, int] = {}
    for t in state_dict.values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return max(counts, key=counts.get) if counts else None


def _record_saved_dtype(output_dir: str, written: torch.dtype | None) -> None:
    """Make `config.json` name `written`, the dtype of the weights written. `save_pretrained` records the
    dtype the prepared parameters have now (the compute dtype), but weights are saved in the dtype the
    model arrived in ([Note: saved dtype] in zerofit.checkpoint.consolidate): a model built in fp32 and
    trained with --bf16 writes fp32 (as Trainer under DDP does, autocast over fp32 weights), and
    `from_pretrained` must load fp32."""
    path = os.path.join(output_dir, "config.json")
    if written is None or not os.path.isfile(path):
        return
    name = str(written).removeprefix("torch.")
    with open(path) as f:
        config = json.load(f)
    keys = [k for k in ("dtype", "torch_dtype") if k in config and config[k] != name]
    if not keys:
        return
    for key in keys:
        config[key] = name
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def _runs_forward_to_save(model: torch.nn.Module) -> bool:
    """[Note: saving runs a forward] PEFT saves a prompt-learning adapter (prompt, prefix, p-tuning) as the
    output of its prompt encoder, computed in `save_pretrained` by a forward pass. At ZeRO-3 that forward
    gathers the encoder's parameters from every rank, so every rank must run `save_pretrained` (PEFT
    computes its state dict on each process and writes only where `is_main_process`); run on rank 0
    alone, as Trainer's `_save` does, it waits forever."""
    configs = getattr(model, "peft_config", None)
    return isinstance(configs, dict) and any(getattr(c, "is_prompt_learning", False) for c in configs.values())


def _refuse_other_engines(args: Any) -> None:
    """TrainingArguments that hand the run to DeepSpeed or FSDP, or that zerofit cannot serve: one error."""
    problems = []
    if getattr(args, "deepspeed", None):
        problems.append(
            f"TrainingArguments(deepspeed={args.deepspeed!r}) hands the run to DeepSpeed: drop --deepspeed and pass "
            f"the same file to the launcher instead: zerofit launch --config_file {args.deepspeed} your_script.py ...")
    if getattr(args, "fsdp", None):
        problems.append(f"TrainingArguments(fsdp={args.fsdp!r}) hands the run to FSDP: drop --fsdp; zerofit's ZeRO "
                        "stage 3 (zero_optimization.stage: 3 in the launch config) shards parameters as FSDP does")
    if getattr(args, "save_only_model", False) and getattr(args, "load_best_model_at_end", False):
        # Found only after training otherwise: the best weights are read back from the best checkpoint's
        # zerofit_state/, which save_only_model leaves out, so the script's final save would never run.
        problems.append("TrainingArguments(save_only_model=True) with load_best_model_at_end=True: zerofit loads the "
                        f"best model from the best checkpoint's {ZEROFIT_STATE}/ folder, which save_only_model does "
                        "not write (Trainer refuses the pair under DeepSpeed and FSDP too): drop --save_only_model, "
                        "or drop --load_best_model_at_end")
    if getattr(args, "auto_find_batch_size", False):
        problems.append("TrainingArguments(auto_find_batch_size=True) retries training with a new Accelerator, "
                        "which zerofit's Trainer does not support yet: set --per_device_train_batch_size, or let "
                        "zerofit choose the stage and offload that fit (zero_optimization.stage: auto)")
    if getattr(args, "use_vllm", False):
        # TRL copies each `param.data` into vLLM: under ZeRO-3 an empty shard; the sync is untested under zerofit
        problems.append(f"{type(args).__name__}(use_vllm=True): zerofit does not send its sharded weights to vLLM "
                        "(TRL would copy each rank's shard, empty at ZeRO-3): drop --use_vllm; generation then "
                        "runs on the prepared model")
    if problems:
        raise ConfigError(problems)


def launched_world() -> tuple[int, int]:
    """(this process's rank, the number of processes) of the run zerofit trains on: the process group's when
    one exists (TrainingArguments usually creates it), else what the launcher announced, else one process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    if process_group.launched():
        return int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    return 0, 1


def _refuse_other_world(args: Any, rank: int, world: int) -> None:
    """TrainingArguments that count another world than zerofit's. Trainer takes its world from them (who is
    the main process, the total batch it logs, how its loss is scaled across processes), zerofit's engine
    from the launch: on a CPU run that transformers was not told of, every rank is Trainer's main process,
    all write `all_results.json` and the checkpoints at once, and the loss and gradients come out `world`
    times too large."""
    if (int(args.world_size), int(args.process_index)) == (world, rank):
        return
    raise ConfigError(
        f"TrainingArguments counts {args.world_size} process(es) (this one is process {args.process_index}), "
        f"but zerofit runs on {world} (this one is rank {rank}): Trainer would treat each process as the whole "
        "run. On CPUs, transformers (through Accelerate) counts the processes only when told the run is on CPU: "
        "launch with `zerofit launch --cpu` (it sets ACCELERATE_USE_CPU=true for the workers, as `accelerate "
        "launch --cpu` does), or pass --use_cpu true to the script (TrainingArguments(use_cpu=True)), or set "
        "ACCELERATE_USE_CPU=true where you start the processes yourself")


class Trainer(ZerofitTrainerMixin, transformers.Trainer):
    """transformers' `Trainer` on zerofit's ZeRO engine (see the module doc)."""


class Seq2SeqTrainer(ZerofitTrainerMixin, transformers.Seq2SeqTrainer):
    """transformers' `Seq2SeqTrainer` on zerofit's ZeRO engine (see the module doc)."""

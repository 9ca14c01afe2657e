"""What zerofit's Trainer integration relies on in transformers, and how it completes the launch config.

The mixin overrides two private Trainer methods (no public hook saves or loads the optimizer) and
calls a third (`_save`): a transformers release that renames or reshapes one of them must fail here,
by name, not in a user's run. The config rules of `zerofit.integrations.trainer_config` are checked
on their own: "auto" takes TrainingArguments' value, a written disagreement is one error naming every
key, and the engine under Trainer neither divides the loss again nor clips again.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from zerofit.config import load_config  # noqa: E402
from zerofit.config.schema import RunConfig  # noqa: E402
from zerofit.errors import ConfigError  # noqa: E402
from zerofit.integrations import trainer_config as tcfg  # noqa: E402
from zerofit.integrations import transformers as ours  # noqa: E402

# Every Trainer method the mixin overrides or calls, with the parameters it passes or accepts.
RELIED_ON = {
    "create_accelerator_and_postprocess": ["self"],
    "create_optimizer": ["self", "model"],
    "create_scheduler": ["self", "num_training_steps", "optimizer"],
    "save_model": ["self", "output_dir", "_internal_call"],
    "_save": ["self", "output_dir", "state_dict"],
    "_save_optimizer_and_scheduler": ["self", "output_dir"],
    "_load_optimizer_and_scheduler": ["self", "checkpoint"],
    "_load_best_model": ["self"],
    "get_resumed_dataloader": ["self", "dataloader", "num_batches"],
    "get_decay_parameter_names": ["self", "model"],
    "_move_model_to_device": ["self", "model", "device"],
}


# Newer than the oldest transformers the `trainer` extra admits: before it (5.17), Trainer skips a resumed epoch's
# batches with accelerate's skip_first_batches, which rebuilds a plain DataLoader over the prepared loader's own
# per-rank batch sampler: the same batches (tests/test_trainer.py resumes bit-identically on 5.17 too).
ADDED_LATER = {"get_resumed_dataloader"}


@pytest.mark.parametrize("name", sorted(RELIED_ON))
def test_trainer_still_has_each_method_the_mixin_relies_on(name):
    method = getattr(transformers.Trainer, name, None)
    if method is None and name in ADDED_LATER:
        pytest.skip(f"transformers {transformers.__version__} has no Trainer.{name} yet")
    assert method is not None, (f"transformers.Trainer.{name} is gone: "
                                "zerofit.integrations.transformers needs a new hook")
    assert list(inspect.signature(method).parameters) == RELIED_ON[name]


def test_trainer_still_calls_the_private_save_and_load_hooks():
    from transformers import trainer

    assert trainer.SCHEDULER_NAME == "scheduler.pt"
    assert "self._save_optimizer_and_scheduler(output_dir)" in inspect.getsource(transformers.Trainer._save_checkpoint)
    prepared = inspect.getsource(transformers.Trainer._prepare_for_training)
    assert "self._load_optimizer_and_scheduler(resume_from_checkpoint)" in prepared
    assert "self.create_scheduler(" in prepared


def test_the_drop_ins_are_the_libraries_classes_with_the_mixin_first():
    for mine, theirs in ((ours.Trainer, transformers.Trainer), (ours.Seq2SeqTrainer, transformers.Seq2SeqTrainer)):
        assert issubclass(mine, theirs) and mine.__mro__[1] is ours.ZerofitTrainerMixin


FACTS = tcfg.TrainerFacts(micro_batch=4, accumulation=8, world=2, max_grad_norm=1.0, mixed_precision="bf16", lr=2e-5,
                          betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _deepspeed(tmp_path, text: str) -> RunConfig:
    path = tmp_path / "ds.json"
    path.write_text(text)
    return load_config(str(path))


def test_auto_keys_take_the_training_arguments_and_the_engine_leaves_accumulation_and_clipping_to_trainer(tmp_path):
    config = _deepspeed(tmp_path, """{"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW",
                      "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                      "warmup_num_steps": "auto", "total_num_steps": "auto"}}}""")
    out = tcfg.trainer_config(config, FACTS)
    assert out.batch.train_micro_batch_size_per_gpu == 4
    assert out.batch.gradient_accumulation_steps == 1 and out.batch.train_batch_size == 8  # Trainer accumulates
    assert out.gradient_clipping == 0.0  # Trainer clips, through accelerator.clip_grad_norm_(max_grad_norm)
    assert out.precision.mixed_precision == "bf16"
    assert out.optimizer.params == {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    sched = tcfg.scheduler_filled(out, total_steps=100, warmup_steps=10, lr=2e-5).scheduler.params
    assert sched == {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-5, "warmup_num_steps": 10, "total_num_steps": 100}


def test_written_values_that_disagree_are_one_error_naming_each_key_in_the_files_spelling(tmp_path):
    config = _deepspeed(tmp_path, """{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true},
        "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 8, "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}}""")
    with pytest.raises(ConfigError) as err:
        tcfg.trainer_config(config, FACTS)
    text = str(err.value)
    assert len(err.value.problems) == 4, text
    for key, value, argument in (("train_micro_batch_size_per_gpu", "16", "per_device_train_batch_size=4"),
                                 ("gradient_clipping", "0.5", "max_grad_norm=1.0"),
                                 ("optimizer.params.lr", "0.0001", "learning_rate=2e-05")):
        assert key in text and value in text and argument in text
    assert "fp16" in text and "--fp16 true" in text  # the precision asked for against Trainer's bf16


def test_a_file_that_never_mentions_precision_trains_in_the_trainers_precision(tmp_path):
    config = _deepspeed(tmp_path, '{"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 8}')
    assert tcfg.trainer_config(config, FACTS).precision.mixed_precision == "bf16"


def test_deepspeed_fsdp_and_auto_find_batch_size_arguments_are_refused_with_the_fix():
    args = SimpleNamespace(deepspeed="ds.json", fsdp="full_shard", auto_find_batch_size=True, torch_compile=False)
    with pytest.raises(ConfigError) as err:
        ours._refuse_other_engines(args)
    text = str(err.value)
    assert "zerofit launch --config_file ds.json" in text and "--fsdp" in text and "per_device_train_batch_size" in text


def test_torch_compile_arguments_reach_the_accelerator_which_compiles_at_prepare(tmp_path):
    """The compiling itself is tests/test_compile.py's (Accelerator(dynamo_plugin=...) at every stage)."""
    import transformers
    from trainer_cases import tiny_gpt2

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                          torch_compile_backend="aot_eager", torch_compile_mode="reduce-overhead")
    trainer = ours.Trainer(model=tiny_gpt2(), args=args)
    assert trainer.accelerator._compile.options == {"backend": "aot_eager", "mode": "reduce-overhead"}
    plain = ours.Trainer(model=tiny_gpt2(), args=transformers.TrainingArguments(output_dir=str(tmp_path),
                                                                                  report_to=[], use_cpu=True))
    assert plain.accelerator._compile is None


def test_a_config_that_compiles_and_torch_compile_give_one_compile_the_arguments(tmp_path, monkeypatch):
    """An Accelerate YAML's dynamo_config (the config's compile section) compiles a Trainer's model when
    --torch_compile is not given; with both, Trainer's dynamo_plugin replaces the section: one compile."""
    from trainer_cases import tiny_gpt2

    from zerofit.distributed.runtime import CONFIG_FILE_ENV

    (tmp_path / "zerofit.yaml").write_text("compile:\n  backend: eager\n  mode: max-autotune\n")
    monkeypatch.setenv(CONFIG_FILE_ENV, str(tmp_path / "zerofit.yaml"))
    plain = ours.Trainer(model=tiny_gpt2(), args=transformers.TrainingArguments(output_dir=str(tmp_path),
                                                                                  report_to=[], use_cpu=True))
    assert plain.accelerator._compile.options == {"backend": "eager", "mode": "max-autotune"}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                          torch_compile_backend="aot_eager")
    assert ours.Trainer(model=tiny_gpt2(), args=args).accelerator._compile.options == {"backend": "aot_eager"}


def test_config_json_names_the_dtype_of_the_weights_written(tmp_path):
    """A bf16 run saves its trained parameters from the fp32 masters: config.json must say float32, or
    `from_pretrained` loads the file in bf16 where the same script under DDP gives fp32."""
    import json

    import torch

    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16", "model_type": "gpt2"}))
    written = ours._main_dtype({"w": torch.zeros(10), "b": torch.zeros(3, dtype=torch.bfloat16),
                                "ids": torch.zeros(99, dtype=torch.long)})
    assert written == torch.float32
    ours._record_saved_dtype(str(tmp_path), written)
    assert json.loads((tmp_path / "config.json").read_text()) == {"dtype": "float32", "model_type": "gpt2"}
    ours._record_saved_dtype(str(tmp_path / "absent"), written)  # an adapter folder has no config.json: nothing

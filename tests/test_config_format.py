"""#37 item 6: a file is read in the format it is written in, decided by keys only one format has (never by
which reader finds fewer problems), or refused saying which format was assumed and why; under transformers'
Trainer every written key that disagrees with TrainingArguments is an error, a written 0 included."""

from __future__ import annotations

import pytest

from zerofit.config import load_config, save_config
from zerofit.errors import ConfigError
from zerofit.integrations import trainer_config as tcfg

FACTS = tcfg.TrainerFacts(micro_batch=4, accumulation=8, world=2, max_grad_norm=1.0, mixed_precision="bf16", lr=2e-5,
                          betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
ASSUMED_ZEROFIT = (r"read as a zerofit config since its keys \(compile\) are ones DeepSpeed and zerofit share, and it "
                   r"is a \.yaml file \(zerofit's format is YAML\)")


def _file(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(("text", "problem"), [
    ("compile:\n  mode: fastest\n", r"compile\.mode must be one of 'default', 'reduce-overhead', 'max-autotune', "
                                    r"'max-autotune-no-cudagraphs' \(got 'fastest'\)"),
    ("compile:\n  backnd: inductor\n", r"compile\.backnd is not a known key: did you mean compile\.backend\?"),
    ("compile:\n  enabled: true\n", r"compile\.enabled is not a known key"),  # DeepSpeed's spelling, in YAML
], ids=["bad-mode", "misspelt-key", "deepspeed-key"])
def test_a_yaml_file_with_only_shared_keys_is_zerofits_and_its_mistakes_say_so(tmp_path, text, problem):
    with pytest.raises(ConfigError, match=rf"(?s){ASSUMED_ZEROFIT}.*{problem}"):
        load_config(_file(tmp_path, "zf.yaml", text))


@pytest.mark.parametrize(("text", "shown"), [
    ("distributed_type: DEEPSPEED\nzero_optimization:\n  stage: 2\n",
     r"distributed_type only in an Accelerate config; zero_optimization only in a DeepSpeed config\): keep the keys "
     r"of the format the file is written in .* deepspeed_config\.deepspeed_config_file"),
    ("zero:\n  stage: 2\ntrain_batch_size: 8\n",
     r"zero only in a zerofit config; train_batch_size only in a DeepSpeed config\)"),
    ("checkpoint:\n  resume: auto\n  tag_validation: Warn\n",
     r"checkpoint\.resume only in a zerofit config; checkpoint\.tag_validation only in a DeepSpeed config\)"),
], ids=["accelerate+deepspeed", "zerofit+deepspeed", "inside-a-shared-section"])
def test_a_file_that_mixes_formats_is_refused_naming_the_keys_of_each(tmp_path, text, shown):
    with pytest.raises(ConfigError, match=rf"mixed\.yaml:\n  - cannot tell the config format: the file mixes two "
                                          rf"\({shown}"):
        load_config(_file(tmp_path, "mixed.yaml", text))


def test_each_format_is_read_as_itself(tmp_path):
    cases = {
        "accelerate.yaml": ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n", "accelerate"),
        "ds.json": ('{"zero_optimization": {"stage": 3}, "gradient_clipping": 0.5}', "deepspeed"),
        "ds.yaml": ("zero_optimization:\n  stage: 3\n", "deepspeed"),
        "zf.yaml": ("zero:\n  stage: 3\n", "zerofit"),
        "compile.yaml": ("compile:\n  backend: inductor\n  mode: max-autotune\n", "zerofit"),
        "shared.json": ('{"gradient_clipping": 0.5, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}',
                        "deepspeed"),
        "tag.yaml": ("checkpoint:\n  tag_validation: Warn\n", "deepspeed"),  # a key only DeepSpeed has decides
    }
    for name, (text, fmt) in cases.items():
        config = load_config(_file(tmp_path, name, text))
        assert config.source_format == fmt, name
        save_config(config, tmp_path / "resolved.json")  # what the launcher hands its workers: zerofit JSON
        again = load_config(tmp_path / "resolved.json")
        assert again == config and again.source_format == fmt and again.written == config.written, name
    compiled = load_config(tmp_path / "compile.yaml").compile
    assert (compiled.backend, compiled.mode) == ("inductor", "max-autotune")
    assert load_config(tmp_path / "shared.json").gradient_clipping == 0.5


@pytest.mark.parametrize(("name", "text", "key"), [
    ("ds.json", '{"zero_optimization": {"stage": 2}, "gradient_clipping": 0}', "gradient_clipping"),
    ("zf.yaml", "zero:\n  stage: 2\ngradient_clipping: 0\n", "gradient_clipping"),
    ("acc.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n  gradient_clipping: 0\n",
     "deepspeed_config.gradient_clipping"),
    ("ds0.json", '{"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"weight_decay": 0}}}',
     "optimizer.params.weight_decay"),
], ids=["deepspeed-json", "zerofit-yaml", "accelerate-yaml", "weight-decay-0"])
def test_a_written_zero_that_disagrees_with_training_arguments_is_an_error(tmp_path, name, text, key):
    config = load_config(_file(tmp_path, name, text))
    save_config(config, tmp_path / "resolved.json")
    argument = "max_grad_norm=1.0" if "clipping" in key else "weight_decay=0.01"
    for seen in (config, load_config(tmp_path / "resolved.json")):  # in the launcher and on a worker
        with pytest.raises(ConfigError, match=rf"{key} is 0(\.0)? in the config but TrainingArguments has {argument}: "
                                              rf'Trainer drives this value, so set {key} to "auto" \(or leave it out\)'
                                              r" to take it from TrainingArguments, or make them equal"):
            tcfg.trainer_config(seen, FACTS)


def test_clipping_left_out_auto_equal_or_never_writable_takes_max_grad_norm(tmp_path):
    files = {"absent.json": '{"zero_optimization": {"stage": 2}}',
             "auto.json": '{"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"}',
             "equal.json": '{"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}',
             "ddp.yaml": "distributed_type: MULTI_GPU\nnum_processes: 2\n"}  # Accelerate's DDP has no clipping key
    for name, text in files.items():
        config = load_config(_file(tmp_path, name, text))
        assert ("gradient_clipping" in config.written) == (name in ("auto.json", "equal.json")), name
        assert tcfg.trainer_config(config, FACTS).gradient_clipping == 0.0  # Trainer clips with max_grad_norm
    assert load_config(tmp_path / "ddp.yaml").gradient_clipping == 0.0

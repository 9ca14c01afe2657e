"""`precision.optimizer_state` in every spelling: zerofit YAML, DeepSpeed JSON (DeepSpeed's bf16 key, zerofit's own
key for 8-bit), an Accelerate YAML through its deepspeed_config_file, `zerofit launch --optimizer_state` and
`zerofit config --optimizer_state`; a wrong value names the key, the value and the choices."""

from __future__ import annotations

import json
import warnings

import pytest
import yaml

from zerofit.cli.main import main
from zerofit.config import config_from_dict, load_config
from zerofit.config.reading import ConfigWarning
from zerofit.errors import ConfigError


def _load(data: dict, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = config_from_dict(data, **kw)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


@pytest.mark.parametrize("value", ["fp32", "bf16", "8bit"])
def test_zerofit_yaml_and_the_deepspeed_own_key_set_the_field(value):
    cfg, _ = _load({"precision": {"optimizer_state": value}})
    assert cfg.precision.optimizer_state == value
    ds, said = _load({"zero_optimization": {"stage": 2, "optimizer_state": value}, "train_batch_size": 8})
    assert ds.precision.optimizer_state == value and "precision.optimizer_state" in ds.written
    assert not said


def test_deepspeed_bf16_optimizer_states_is_bf16_state_and_the_master_stays_fp32():
    data = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
            "zero_optimization": {"stage": 3}}
    cfg, said = _load(data)
    assert cfg.precision.optimizer_state == "bf16" and cfg.precision.mixed_precision == "bf16"
    assert said == ["bf16.bf16_master_weights_and_grads = True is ignored: zerofit keeps the master weights and "
                    "gradients in fp32 (bf16.bf16_optimizer_states still stores the optimizer state in bf16)"]
    off, said = _load({"bf16": {"enabled": True, "bf16_optimizer_states": False}})
    assert off.precision.optimizer_state == "fp32" and not said
    same, _ = _load({"bf16": {"enabled": True, "bf16_optimizer_states": True},
                     "zero_optimization": {"optimizer_state": "bf16"}})
    assert same.precision.optimizer_state == "bf16"


@pytest.mark.parametrize(("data", "message"), [
    ({"precision": {"optimizer_state": "4bit"}},
     "precision.optimizer_state must be one of 'fp32', 'bf16', '8bit' (got '4bit')"),
    ({"zero_optimization": {"optimizer_state": "int8"}},
     "zero_optimization.optimizer_state must be one of 'fp32', 'bf16', '8bit' (got 'int8')"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": "sometimes"}}, "bf16.bf16_optimizer_states must be"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}, "zero_optimization": {"optimizer_state": "fp32"}},
     "bf16.bf16_optimizer_states = true asks for bf16 optimizer state but zero_optimization.optimizer_state is "
     "'fp32': keep one of them (remove bf16.bf16_optimizer_states for 'fp32', or set "
     "zero_optimization.optimizer_state to \"bf16\")"),
])
def test_a_wrong_value_names_the_key_the_value_and_the_choices(data, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert message in str(e.value)


def test_accelerate_yaml_reaches_it_through_its_deepspeed_file(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2, "optimizer_state": "8bit"},
                                                  "train_batch_size": "auto"}))
    path = tmp_path / "acc.yaml"
    path.write_text(yaml.safe_dump({"distributed_type": "DEEPSPEED", "num_processes": 2,
                                    "deepspeed_config": {"deepspeed_config_file": "ds.json"}}))
    assert load_config(path).precision.optimizer_state == "8bit"


def test_launch_flag_overrides_the_file(tmp_path, capsys):
    path = tmp_path / "z.yaml"
    path.write_text("precision: {optimizer_state: bf16}\n")
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["launch", "--config_file", str(path), "--optimizer_state", "8bit", "--cpu", "--dry_run",
                 str(script)]) == 0
    assert "optimizer_state: 8bit" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["launch", "--optimizer-state", "int4", "--dry_run", str(script)])
    err = capsys.readouterr().err  # argparse quotes the choices in some Python versions
    assert "--optimizer_state/--optimizer-state: invalid choice: 'int4'" in err and "8bit" in err


@pytest.mark.parametrize("fmt", ["zerofit", "deepspeed"])
@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_zerofit_config_writes_it_and_it_loads_back(tmp_path, fmt, state, capsys):
    out = tmp_path / ("c.json" if fmt == "deepspeed" else "c.yaml")
    assert main(["config", "--stage", "2", "--mixed_precision", "bf16", "--optimizer_state", state,
                 "--format", fmt, "-o", str(out)]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # nothing written that loads with a warning
        assert load_config(out).precision.optimizer_state == state


def test_zerofit_config_says_where_an_accelerate_yaml_keeps_it(tmp_path, capsys):
    assert main(["config", "--stage", "2", "--optimizer_state", "8bit", "--format", "accelerate",
                 "-o", str(tmp_path / "a.yaml")]) != 0
    assert ("--optimizer_state 8bit has no key in an Accelerate YAML's deepspeed_config: use --format zerofit, or "
            "--format deepspeed" in capsys.readouterr().err)

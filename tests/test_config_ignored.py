"""The honest schema: DeepSpeed knobs zerofit ignores are accepted, type-checked and warned about once,
never fields; `offload_param.device: nvme` is refused at load; `gradient_clipping: "auto"` is 1.0."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from engine_cases import SEQ, VOCAB, TinyLM, loss_fn

from zerofit import Accelerator
from zerofit.cli.main import main
from zerofit.config import (
    AUTO,
    ConfigWarning,
    ScriptFacts,
    config_from_dict,
    ignored,
    load_config,
    resolve_auto,
)
from zerofit.config.coerce import BadValue
from zerofit.config.schema import RunConfig
from zerofit.config.tree import leaf_hints
from zerofit.errors import ConfigError

CHECK = Path(__file__).parent / "scripts" / "allreduce_check.py"


def _nest(dotted: str, value) -> dict:
    *parents, leaf = dotted.split(".")
    out = node = {}
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return out


def _asking_value(entry: ignored.Ignored):
    """A value that asks for something zerofit does not do, or None when every value is what it does."""
    for value in (12345, not entry.default, "bf16", {"stages": 2}):
        try:
            converted = entry.convert(value)
        except BadValue:
            continue
        if converted != entry.default and converted not in entry.quiet:
            return value
    return None


def _shown(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _caught(data: dict) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        config_from_dict(data)
    return [str(w.message) for w in seen if issubclass(w.category, ConfigWarning)]


def test_no_ignored_knob_is_a_schema_field():
    leaves = set(leaf_hints())
    assert not {e.zerofit for e in ignored.TABLE} & leaves
    assert len({e.key for e in ignored.TABLE}) == len(ignored.TABLE)


@pytest.mark.parametrize("entry", ignored.TABLE, ids=lambda e: e.key)
def test_an_ignored_knob_at_its_default_is_quiet_and_any_other_value_warns_once(entry):
    for quiet in (entry.default, *entry.quiet, *(["auto"] if entry.allows_auto else [])):
        assert _caught(_nest(entry.key, quiet)) == [], quiet
    value = _asking_value(entry)
    if value is None:
        return
    got = _caught(_nest(entry.key, value))
    assert len(got) == 1, got
    assert got[0].startswith(f"{entry.key} = {_shown(entry.convert(value))} is ignored: {entry.why}")


@pytest.mark.parametrize("entry", [e for e in ignored.TABLE if e.zerofit], ids=lambda e: e.zerofit)
def test_an_older_zerofit_field_still_loads_the_same_way(entry):
    value = _asking_value(entry)
    data = {"zero": {"stage": 1}, **_nest(entry.zerofit, value if value is not None else entry.default)}
    got = _caught(data)
    assert got == ([] if value is None else [got[0]])
    if value is not None:
        assert got[0].startswith(f"{entry.zerofit} = {_shown(entry.convert(value))} is ignored")


def test_the_zero3_templates_auto_gather_flag_loads_quietly():
    """Accelerate's and the blog's ZeRO-3 JSONs write stage3_gather_16bit_weights_on_model_save: "auto"."""
    data = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": "auto",
                                  "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"},
            "train_micro_batch_size_per_gpu": "auto"}
    assert _caught(data) == []
    assert config_from_dict(data).zero.stage == 3


def test_an_ignored_knob_with_a_wrong_type_is_an_error():
    with pytest.raises(ConfigError, match=re.escape("zero_optimization.stage3_max_reuse_distance must be a whole "
                                                    "number (got 'far'): write it like")):
        config_from_dict({"zero_optimization": {"stage3_max_reuse_distance": "far"}})
    with pytest.raises(ConfigError, match=re.escape("deepspeed_config.zero3_save_16bit_model must be true or false "
                                                    "(got 'maybe')")):
        config_from_dict({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero3_save_16bit_model": "maybe"}})


def test_the_deepspeed_keys_once_accepted_silently_are_checked_and_warned_about():
    """#25: activation_checkpointing.partition_activations: true (and 40 other keys) loaded without a word,
    whatever their value, so a run could look as if DeepSpeed's activation partitioning were on."""
    data = {"zero_optimization": {"stage": 3, "allgather_partitions": False, "round_robin_gradients": True},
            "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False},
            "pipeline": {"stages": 2}, "checkpoint": {"tag_validation": "fail"}, "train_batch_size": 8}
    got = _caught(data)
    assert [w.split(" is ignored: ")[0] for w in got] == [
        "activation_checkpointing.partition_activations = True", "pipeline = {'stages': 2}",
        "zero_optimization.allgather_partitions = False"]
    assert got[0].endswith("turn on the model's own checkpointing with zero_optimization.gradient_checkpointing "
                           "(gradient_checkpointing_enable())")
    with pytest.raises(ConfigError, match=re.escape("activation_checkpointing.cpu_checkpointing must be true or "
                                                    "false (got 'maybe')")):
        config_from_dict({"activation_checkpointing": {"cpu_checkpointing": "maybe"}, "train_batch_size": 8})
    with pytest.raises(ConfigError, match=re.escape("checkpoint.tag_validation must be one of 'Ignore', 'Warn', "
                                                    "'Fail' (got 'strict')")):
        config_from_dict({"checkpoint": {"tag_validation": "strict"}, "train_batch_size": 8})


def test_pin_memory_false_warns_for_cpu_offload_and_acts_for_nvme():
    cpu = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}}
    got = _caught(cpu)
    assert len(got) == 1 and got[0].startswith(
        "zero_optimization.offload_optimizer.pin_memory = False is ignored with "
        "zero_optimization.offload_optimizer.device cpu: zerofit always page-locks CPU-offloaded state")
    nvme = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/n",
                                                                    "pin_memory": False}}}
    assert _caught(nvme) == []
    assert config_from_dict(nvme).zero.offload_optimizer.pin_memory is False


def test_warnings_come_from_rank_0_only(monkeypatch):
    data = {"zero_optimization": {"reduce_bucket_size": 1, "sub_group_size": 2}, "wall_clock_breakdown": True}
    monkeypatch.setenv("RANK", "1")
    assert _caught(data) == []
    monkeypatch.setenv("RANK", "0")
    assert len(_caught(data)) == 3


def test_launch_warns_once_and_hands_the_workers_a_config_without_the_knob(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8,
                                                    "overlap_comm": True}, "train_micro_batch_size_per_gpu": 2}))
    assert main(["launch", "--dry-run", "--cpu", "--num_processes", "2", "--config_file", str(ds), str(CHECK)]) == 0
    captured = capsys.readouterr()  # `zerofit` prints config warnings as plain lines on stderr
    assert captured.err.count("zerofit: warning: zero_optimization.reduce_bucket_size = 200000000 is ignored") == 1
    assert "overlap_comm" not in captured.err  # true is what zerofit does anyway
    resolved = tmp_path / "workers.yaml"
    resolved.write_text(captured.out)
    assert "bucket" not in captured.out
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(resolved)


def test_config_written_for_deepspeed_loads_without_warnings(tmp_path, capsys):
    out = tmp_path / "ds.json"
    assert main(["config", "--stage", "3", "--offload_param", "cpu", "--offload_optimizer", "cpu",
                 "--format", "deepspeed", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["zero_optimization"]["overlap_comm"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(out)


@pytest.mark.parametrize("data", [
    {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/n"}}},
    {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3, "offload_param_device": "nvme",
                                                           "offload_param_nvme_path": "/n"}},
    {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/n"}}},
], ids=["deepspeed", "accelerate", "zerofit"])
def test_nvme_parameter_offload_is_refused_at_load(data):
    with pytest.raises(ConfigError, match=r"offload_param(\.device|_device) 'nvme' is not supported: zerofit "
                                          r"offloads parameters to the CPU only; set it to cpu \(NVMe offload is "
                                          r"supported for \S*offload_optimizer\S*\)"):
        config_from_dict(data)


def test_gradient_clipping_auto_is_one_whatever_the_script_says():
    cfg = config_from_dict({"gradient_clipping": "auto", "train_micro_batch_size_per_gpu": 2})
    assert cfg.gradient_clipping is AUTO
    for facts in (ScriptFacts(num_processes=1), ScriptFacts(num_processes=2, hidden_size=8, lr=0.1)):
        assert resolve_auto(cfg, facts).gradient_clipping == 1.0


def _one_sgd_step(clip_call: float | None) -> float:
    """The size of one SGD(lr=1) update under `gradient_clipping: auto` (= the clipped gradient norm)."""
    acc = Accelerator(config=RunConfig(gradient_clipping=AUTO))
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = acc.prepare(model, opt)
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    x = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))
    acc.backward(1000.0 * loss_fn(model(x), x))  # a gradient norm far above 1
    if clip_call is not None:
        acc.clip_grad_norm_(model.parameters(), clip_call)
    opt.step()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return float((after - before).norm())


def test_gradient_clipping_auto_clips_at_one_unless_the_script_clips_itself():
    assert _one_sgd_step(None) == pytest.approx(1.0, rel=1e-3)
    assert _one_sgd_step(0.25) == pytest.approx(0.25, rel=1e-3)

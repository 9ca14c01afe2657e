"""A config file that cannot be read as one - not a small text file, an alias bomb, a key written twice -
is one short ConfigError naming the file, the key and the fix (`zerofit.config.files`,
`zerofit.config.duplicates`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zerofit.config import config_from_dict, load_config
from zerofit.errors import ConfigError


def test_a_config_path_that_is_not_a_small_text_file_is_one_clear_error(tmp_path):
    """#18: /dev/zero or a FIFO as deepspeed_config_file read forever; a directory, "", non-UTF-8, deep
    nesting and a 12 MB file of comments gave tracebacks or took minutes."""
    import os

    cases = [(tmp_path, "is a directory: pass the config file inside it"), (Path(""), "config file path is empty")]
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe")
    cases.append((tmp_path / "bin.yaml", "is not UTF-8 text (byte 0): save it as UTF-8"))
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    cases.append((tmp_path / "deep.json", "is nested too deeply to be a config"))
    (tmp_path / "big.yaml").write_text("a: 1\n" + "# comment\n" * 1_300_000)
    cases.append((tmp_path / "big.yaml", "is larger than 1024 KiB, which no config is"))
    for path, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(path)
    fifo = tmp_path / "ds.json"
    os.mkfifo(fifo)
    for target in ("/dev/zero", str(fifo)):
        (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                           f"  deepspeed_config_file: {target}\n")
        with pytest.raises(ConfigError, match=re.escape(f"deepspeed_config.deepspeed_config_file: {target!r} is not a "
                                                        "regular file (a pipe or device)")):
            load_config(tmp_path / "acc.yaml")


def test_an_nvme_path_that_is_a_file_and_a_5000_digit_number_are_errors(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="nvme_path .* is a file: point it at a directory"):
        config_from_dict({"zero": {"stage": 3,
                                   "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "file")}}})
    (tmp_path / "huge.json").write_text('{"train_batch_size": ' + "9" * 5000 + "}")
    with pytest.raises(ConfigError, match="holds a number with thousands of digits"):
        load_config(tmp_path / "huge.json")


def test_an_alias_bomb_and_a_huge_value_give_short_errors_quickly(tmp_path):
    """#18: a YAML alias bomb took 4 min, 11 GB and printed 2 GB; a 100 KB string gave a 100 KB message."""
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\nzero: {stage: *a8}\n")
    with pytest.raises(ConfigError, match="expands to more than 100000 values \\(YAML aliases") as caught:
        load_config(tmp_path / "bomb.yaml")
    assert len(str(caught.value)) < 1000
    (tmp_path / "long.yaml").write_text(f"zero:\n  stage: {'x' * 100_000}\n")
    with pytest.raises(ConfigError, match="more characters not shown") as caught:
        load_config(tmp_path / "long.yaml")
    assert len(str(caught.value)) < 2000
    with pytest.raises(ConfigError, match="holds a NUL byte"):
        load_config("conf\0ig.yaml")


_TWICE = "keep one {} and delete the other (a JSON or YAML reader silently keeps the last one"


@pytest.mark.parametrize(("name", "text", "key", "lines"), [
    ("ds.json", '{\n  "zero_optimization": {"stage": 3},\n  "train_batch_size": 8,\n'
                '  "zero_optimization": {"stage": 1}\n}',
     "zero_optimization", (2, 4)),
    ("ds.json", '{"zero_optimization": {\n  "stage": 2,\n  "stage": "auto"}}', "zero_optimization.stage", (2, 3)),
    ("ds.json", '{"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.99],\n "lr": 1e-4, "lr": 1}}}',
     "optimizer.params.lr", (2, 2)),
    ("z.yaml", "zero:\n  stage: 3\nlaunch:\n  num_processes: 1\nzero:\n  stage: 1\n", "zero", (1, 5)),
    ("z.yaml", "zero:\n  offload_optimizer:\n    device: cpu\n    'device': nvme\n", "zero.offload_optimizer.device",
     (3, 4)),
    ("a.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n  zero_stage: 1\n",
     "deepspeed_config.zero_stage", (3, 4)),
    ("a.yaml", "distributed_type: DEEPSPEED\nnum_processes: 2\ndistributed_type: NO\n", "distributed_type", (1, 3)),
], ids=["ds-top", "ds-nested-auto", "ds-deep", "zerofit-top", "zerofit-deep", "accelerate-plugin", "accelerate-top"])
def test_a_key_written_twice_is_refused_naming_the_file_key_and_both_lines(tmp_path, name, text, key, lines):
    """#25: the last of two equal keys won silently (stage 3 then 1 ran stage 1; "stage" then "auto" ran the
    planner)."""
    path = tmp_path / name
    path.write_text(text)
    message = f"{str(path)!r}: {key} appears twice (lines {lines[0]} and {lines[1]}): " + _TWICE.format(key)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path)


def test_a_key_written_twice_in_the_deepspeed_file_an_accelerate_yaml_names_is_refused(tmp_path):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu",\n'
                                      '  "device": "none"}}}')
    (tmp_path / "a.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                     "  deepspeed_config_file: ds.json\n")
    message = (f"deepspeed_config.deepspeed_config_file: {str(tmp_path / 'ds.json')!r}: zero_optimization.offload_param"
               ".device appears twice (lines 1 and 2)")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(tmp_path / "a.yaml")


def test_merge_keys_aliases_and_lists_are_not_duplicates(tmp_path):
    """A YAML merge may override what it merges; an alias repeats a value, not a key; objects in a list
    are separate mappings."""
    (tmp_path / "m.yaml").write_text("base: &base {stage: 2, param_persistence_threshold: 0}\n"
                                     "mid: &mid {<<: *base, stage: 3}\n"
                                     "zero: {<<: *mid, stage: 3}\n")
    with pytest.raises(ConfigError, match="base is not a known key"):  # no duplicate complaint first
        load_config(tmp_path / "m.yaml")
    (tmp_path / "ok.yaml").write_text("zero: &z\n  stage: 3\nlaunch: {num_processes: 1}\n")
    assert load_config(tmp_path / "ok.yaml").zero.stage == 3
    (tmp_path / "ok.json").write_text('{"zero_optimization": {"stage": 2}, "a": [{"k": 1}, {"k": 2}]}')
    with pytest.raises(ConfigError, match="a is not a known key"):
        load_config(tmp_path / "ok.json")
    assert config_from_dict({"zero_optimization": {"stage": 2}}).zero.stage == 2  # dicts never come here

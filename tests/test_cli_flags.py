"""The flag set of every subcommand, frozen: one canonical name per option, its dashed twin, its old names.

See [Note: flag spelling] in `zerofit.cli.flags`. Everything here parses arguments only: no process starts.
"""

from __future__ import annotations

import argparse

import pytest

from zerofit.cli import flags
from zerofit.cli.main import build_parser

# command -> canonical long name -> deprecated aliases. A change here is a change of the public CLI:
# update the README with it.
FROZEN = {
    "launch": {
        "--config_file": (), "--num_processes": (), "--num_machines": (), "--machine_rank": (),
        "--main_process_ip": (), "--main_process_port": (), "--mixed_precision": (), "--optimizer_state": (),
        "--cpu": (),
        "--max_restarts": (), "--resume": (), "--process_group_timeout": (), "--oom_backoff": (), "--hostfile": (),
        "--hostfile_print": (), "--overwrite_checkpoints": (), "--dry_run": (), "--module": (),
    },
    "env": {"--config_file": (), "--probe": ()},
    "config": {
        "--stage": (), "--offload_optimizer": (), "--offload_param": (), "--nvme_path": (), "--mixed_precision": (),
        "--optimizer_state": (), "--num_processes": (), "--gradient_accumulation_steps": (), "--gradient_clipping": (),
        "--format": (),
        "--output": (),
    },
    "demo": {
        "--stage": (), "--steps": (), "--micro_batch": ("--batch_size",), "--gradient_accumulation_steps": (),
        "--context": (), "--lr": (), "--mixed_precision": (),
    },
    "merge": {"--max_shard_size": ()},
    "estimate": {
        "--model": (), "--task": (), "--num_processes": ("--num_gpus",), "--gpu_memory_gib": ("--gpu_memory",),
        "--host_memory_gib": ("--host_memory",), "--gpus_per_host": (), "--micro_batch": (), "--seq": (),
        "--gradient_accumulation_steps": (), "--mixed_precision": (), "--state_tensors": ("--optimizer_states",),
        "--optimizer_state": (), "--checkpointing": (), "--offload_ratio": (), "--step_on": (), "--host_share": (),
        "--nvme": (),
        "--headroom": (), "--json": (),
    },
    "bench": {
        "--tables": (), "--methods": (), "--compile_backend": (), "--num_processes": ("--nproc",),
        "--gpu_memory_gib": (), "--steps": (),
        "--eval_steps": (), "--warmup": (), "--max_batch": (), "--equal_batch": (), "--equal_only": (),
        "--mixed_precision": ("--precision",), "--clip": (), "--tiny": (), "--cpu": (), "--timeout": (),
        "--budget": (), "--process_group_timeout": (), "--out": (), "--report": (), "--merge": (),
        "--simulate_oom_above": (),
    },
}
SHORT = {"launch": {"-m"}, "config": {"-o"}}
"""Single-letter options, which have no second spelling."""

# Arguments each parser needs besides the option under test (required options, positionals).
BEFORE = {"config": ["--stage", "2", "-o", "out.yaml"], "estimate": ["--model", "m"], "merge": ["ckpt", "out"]}
AFTER = {"launch": ["train.py"]}


def parser_of(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices[command]


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def canonical(action: argparse.Action) -> str:
    return next(s for s in action.option_strings if s.startswith("--"))


def value_for(action: argparse.Action) -> list[str]:
    """One command-line value that differs from the default (none for a switch)."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(c for c in action.choices if c != action.default))]
    if getattr(action.type, "__name__", "") == "_ratio":  # a number or auto (zerofit estimate --offload_ratio)
        return ["0.5"]
    return [{int: "7", float: "0.5"}.get(action.type, "x7")]


def parse(command: str, *args: str) -> argparse.Namespace:
    return parser_of(command).parse_args([*BEFORE.get(command, []), *args, *AFTER.get(command, [])])


def test_every_subcommand_is_covered():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == set(FROZEN)


@pytest.mark.parametrize("command", FROZEN)
def test_flag_set_is_frozen(command):
    parser = parser_of(command)
    shown = [a for a in options(parser) if not isinstance(a, flags._DeprecatedAlias)]
    hidden = [a for a in options(parser) if isinstance(a, flags._DeprecatedAlias)]
    found = {canonical(a): tuple(canonical(h) for h in hidden if h.canonical is a) for a in shown}
    assert found == FROZEN[command]
    for a in shown:
        assert set(a.option_strings) - set(SHORT.get(command, ())) == set(flags.twins(canonical(a)))
    assert {s for a in shown for s in a.option_strings if not s.startswith("--")} == SHORT.get(command, set())
    for h in hidden:
        assert h.dest == h.canonical.dest and h.help == argparse.SUPPRESS
        assert set(h.option_strings) == set(flags.twins(canonical(h)))


def test_launch_keeps_exactly_the_flags_that_mirror_accelerate_launch():
    """No aliases on launch: each extra name could take an option meant for torchrun or for the script."""
    found = {s for a in parser_of("launch")._actions for s in a.option_strings}
    assert found == {
        "-h", "--help", "--config_file", "--config-file", "--num_processes", "--num-processes",
        "--num_machines", "--num-machines", "--machine_rank", "--machine-rank",
        "--main_process_ip", "--main-process-ip", "--main_process_port", "--main-process-port",
        "--mixed_precision", "--mixed-precision", "--optimizer_state", "--optimizer-state", "--cpu", "--max_restarts",
        "--max-restarts",
        "--resume", "--process_group_timeout", "--process-group-timeout", "--dry-run", "--dry_run", "-m", "--module",
        "--oom_backoff", "--oom-backoff", "--hostfile", "--hostfile_print", "--hostfile-print",
        "--overwrite_checkpoints", "--overwrite-checkpoints",
    }


@pytest.mark.parametrize("command", FROZEN)
def test_every_option_takes_the_underscore_and_the_dash_spelling(command):
    default = parse(command)
    for action in options(parser_of(command)):
        name, value = canonical(action), value_for(action)
        underscore, dash = flags.twins(name) if "_" in name else (name, name)
        given = parse(command, underscore, *value)
        assert given == parse(command, dash, *value), name
        assert getattr(given, action.dest) != getattr(default, action.dest), name


@pytest.mark.parametrize("command", FROZEN)
def test_old_names_still_work_and_name_the_new_flag(command, capsys):
    parser = parser_of(command)
    for alias in (a for a in options(parser) if isinstance(a, flags._DeprecatedAlias)):
        new, value = canonical(alias.canonical), value_for(alias.canonical)
        for old in alias.option_strings:
            assert parse(command, old, *value) == parse(command, new, *value), old
            assert capsys.readouterr().err == f"zerofit: warning: {old} is deprecated: use {new}\n"


def test_an_old_name_warns_on_rank_0_only(monkeypatch, capsys):
    """Every rank of a launched script parses the same argv: the note appears once per run, not per rank."""
    for rank, expected in (("1", ""), ("0", "zerofit: warning: --batch_size is deprecated: use --micro_batch\n")):
        monkeypatch.setenv("RANK", rank)
        assert parse("demo", "--batch_size", "4").micro_batch == 4
        assert capsys.readouterr().err == expected


def test_the_demo_module_parses_what_zerofit_demo_parses():
    """One declaration of the demo's options (zerofit.cli.demo) serves the subcommand and every rank."""
    from zerofit.demo.train import build_parser as demo_module_parser

    ranks = demo_module_parser()
    assert [a.option_strings for a in options(ranks)] == [a.option_strings for a in options(parser_of("demo"))]


def test_a_canonical_name_is_spelt_with_underscores():
    with pytest.raises(ValueError, match=r"canonical long name with underscores"):
        flags.add_flag(argparse.ArgumentParser(), "--micro-batch", type=int)

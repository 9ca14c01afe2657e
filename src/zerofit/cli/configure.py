"""`zerofit config`: write a config file for a ZeRO stage and offload setting, in any of the three formats.

The settings are first validated as a zerofit config (so `--offload_param cpu` with stage 2 is caught
here, not at launch), then written as zerofit YAML, as a DeepSpeed JSON of the kind people already
keep, or as an Accelerate launch YAML with the DeepSpeed keys inline. Each loads back, through
`zerofit.config.load_config`, to the same settings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, get_args

import yaml

from zerofit.cli.flags import add_flag
from zerofit.config import is_auto, load_config
from zerofit.config.schema import OptimizerStateDtype, RunConfig, to_dict
from zerofit.errors import ConfigError

FORMATS = ("zerofit", "deepspeed", "accelerate")
STAGES = (0, 1, 2, 3, "auto")
STDOUT = "-"
"""`-o -`: the file's text goes to stdout (the note on how to use it to stderr)."""
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
"""Where optimizer state may live."""
PARAM_OFFLOAD_DEVICES = ("none", "cpu")
"""Where parameter shards may live: not nvme, which `zerofit.config.validate` refuses, so argparse rejects it
at once (naming the choices) instead of asking for --nvme_path first."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "config", allow_abbrev=False, help="write a config file for a ZeRO stage and offload setting",
        description="Write a config file that `zerofit launch --config_file FILE` (and DeepSpeed or Accelerate, "
                    "for those formats) reads back to the same settings.")
    add_flag(p, "--stage", type=_stage, choices=STAGES, required=True,
             help="0: DDP; 1: shard optimizer state; 2: + gradients; 3: + parameters; auto: the fastest "
                  "setting that fits, offload included, planned at launch (zerofit format)")
    add_flag(p, "--offload_optimizer", choices=OFFLOAD_DEVICES, default=None,
             help="where fp32 master weights and optimizer states live (stages 1-3; default none, planned "
                  "with --stage auto)")
    add_flag(p, "--offload_param", choices=PARAM_OFFLOAD_DEVICES, default=None,
             help="where parameter shards live (stage 3; cpu only, parameters do not go to nvme; default none, "
                  "planned with --stage auto)")
    add_flag(p, "--nvme_path", metavar="DIR", help="directory for the optimizer state's nvme offload files")
    add_flag(p, "--mixed_precision", choices=("no", "fp16", "bf16"), default="no",
             help="compute precision")
    add_flag(p, "--optimizer_state", choices=get_args(OptimizerStateDtype), default=None,
             help="how optimizer state is stored between steps: fp32 (default), bf16 or 8bit (zerofit and "
                  "deepspeed formats; an Accelerate YAML reaches it through a deepspeed_config_file)")
    add_flag(p, "--num_processes", type=int, metavar="N",
             help="processes over all machines (zerofit and accelerate formats)")
    add_flag(p, "--gradient_accumulation_steps", type=int, metavar="K",
             help="micro-steps per optimizer step (default: 1; \"auto\" in deepspeed and accelerate "
                  "files, taken from the script)")
    add_flag(p, "--gradient_clipping", type=float, metavar="C",
             help="clip the global gradient norm to C, 0: no clipping (default: 0; \"auto\" in "
                  "deepspeed and accelerate files, taken from the script)")
    add_flag(p, "--format", choices=FORMATS, default="zerofit", help="file format (default: zerofit)")
    add_flag(p, "-o", "--output", required=True, metavar="FILE", help="file to write (overwritten); - for stdout")
    p.set_defaults(func=run)


def _stage(text: str) -> int | str:
    """A stage number, or "auto" (argparse then checks it against STAGES and names them)."""
    return "auto" if text.strip().lower() == "auto" else int(text) if text.strip().isdigit() else text


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Dotted zerofit keys for the chosen settings."""
    problems = []
    planned = args.stage == "auto"
    if planned and args.format != "zerofit":
        problems.append(f"--stage auto is planned by zerofit at launch; a {args.format} file with it would not load "
                        f"in {'DeepSpeed' if args.format == 'deepspeed' else 'Accelerate'}: use --format zerofit, "
                        "or pick a stage 0-3")
    nvme = args.offload_optimizer == "nvme"
    if nvme and not args.nvme_path:
        problems.append("--offload_optimizer nvme needs a directory: add --nvme_path DIR (a fast local disk)")
    if args.nvme_path and not nvme:
        problems.append(f"--nvme_path {args.nvme_path} is unused: add --offload_optimizer nvme, or drop --nvme_path")
    if args.format == "deepspeed" and args.num_processes is not None:
        problems.append("--num_processes has no place in a DeepSpeed JSON: pass it to `zerofit launch` instead, "
                        "or use --format zerofit or --format accelerate")
    if args.format == "accelerate" and args.optimizer_state not in (None, "fp32"):
        problems.append(f"--optimizer_state {args.optimizer_state} has no key in an Accelerate YAML's "
                        "deepspeed_config: use --format zerofit, or --format deepspeed and point the YAML's "
                        "deepspeed_config.deepspeed_config_file at that file")
    if problems:
        raise ConfigError(problems)
    settings: dict[str, Any] = {"zero.stage": args.stage}
    # Unset under stage auto, the planner chooses where each state lives too ([Note] in zerofit.config.load).
    for key, device in (("zero.offload_optimizer.device", args.offload_optimizer),
                        ("zero.offload_param.device", args.offload_param)):
        if device is not None or not planned:
            settings[key] = device or "none"
    settings["precision.mixed_precision"] = args.mixed_precision
    if args.optimizer_state is not None:
        settings["precision.optimizer_state"] = args.optimizer_state
    # Unset, these stay "auto" in the formats whose users expect the script to supply them.
    unset = None if args.format == "zerofit" else "auto"
    for key, value in (("batch.gradient_accumulation_steps", args.gradient_accumulation_steps),
                       ("gradient_clipping", args.gradient_clipping)):
        if value is not None or unset is not None:
            settings[key] = unset if value is None else value
    if nvme:
        settings["zero.offload_optimizer.nvme_path"] = args.nvme_path
    if args.num_processes is not None:
        settings["launch.num_processes"] = args.num_processes
    return settings


def _offload_block(offload: Any) -> dict[str, Any]:
    block: dict[str, Any] = {"device": offload.device, "pin_memory": offload.pin_memory}
    if offload.device == "nvme":
        block["nvme_path"] = offload.nvme_path
    return block


def deepspeed_dict(cfg: RunConfig) -> dict[str, Any]:
    """The DeepSpeed JSON for these settings; batch sizes stay "auto", filled from the script's dataloader."""
    # what zerofit always does, written out for DeepSpeed (zerofit.config.ignored)
    zero: dict[str, Any] = {"stage": cfg.zero.stage, "overlap_comm": True, "contiguous_gradients": True}
    for name in ("offload_optimizer", "offload_param"):
        offload = getattr(cfg.zero, name)
        if offload.enabled:
            zero[name] = _offload_block(offload)
    if cfg.zero.stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    out: dict[str, Any] = {"zero_optimization": zero}
    precision = cfg.precision.mixed_precision
    if precision == "bf16":
        out["bf16"] = {"enabled": True}
    elif precision == "fp16":
        ls = cfg.precision.loss_scale
        out["fp16"] = {"enabled": True, "loss_scale": ls.loss_scale, "initial_scale_power": ls.initial_scale_power,
                       "loss_scale_window": ls.loss_scale_window, "hysteresis": ls.hysteresis,
                       "min_loss_scale": ls.min_loss_scale}
    state = cfg.precision.optimizer_state
    if state == "bf16":  # DeepSpeed's own key (its bf16_master_weights_and_grads is zerofit's fp32 master, unwritten)
        out.setdefault("bf16", {"enabled": False})["bf16_optimizer_states"] = True
    elif state == "8bit":  # no DeepSpeed key: zerofit's own
        zero["optimizer_state"] = state
    if cfg.precision.communication_data_type != "fp32":  # fp32 is what zerofit does without the key
        out["communication_data_type"] = cfg.precision.communication_data_type
    out.update({"gradient_accumulation_steps": cfg.batch.gradient_accumulation_steps,
                "gradient_clipping": cfg.gradient_clipping,
                "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"})
    return out


def accelerate_dict(cfg: RunConfig) -> dict[str, Any]:
    """An Accelerate launch YAML with the DeepSpeed settings inline (as `accelerate config` writes them)."""
    z = cfg.zero
    ds: dict[str, Any] = {
        "zero_stage": z.stage,
        "offload_optimizer_device": z.offload_optimizer.device,
        "offload_param_device": z.offload_param.device,
        "gradient_accumulation_steps": cfg.batch.gradient_accumulation_steps,
        "gradient_clipping": cfg.gradient_clipping,
        "zero3_init_flag": z.stage == 3,
    }
    if z.offload_optimizer.device == "nvme":
        ds["offload_optimizer_nvme_path"] = z.offload_optimizer.nvme_path
    if z.stage == 3:
        ds["zero3_save_16bit_model"] = True
    la = cfg.launch
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": ds,
        "mixed_precision": cfg.precision.mixed_precision,
        "num_machines": la.num_machines,
        "machine_rank": la.machine_rank,
        "main_training_function": la.main_training_function,
        "rdzv_backend": la.rdzv_backend,
        "same_network": True,
        "use_cpu": la.use_cpu,
    }
    if la.num_processes is not None:
        out["num_processes"] = la.num_processes
    return out


def zerofit_dict(cfg: RunConfig, keys: list[str]) -> dict[str, Any]:
    """Only the chosen settings, nested by section: every other key keeps its default when loaded."""
    full, out = to_dict(cfg), {}
    for key in keys:
        *sections, leaf = key.split(".")
        src, dst = full, out
        for section in sections:
            src, dst = src[section], dst.setdefault(section, {})
        dst[leaf] = src[leaf]
    return out


def write(cfg: RunConfig, fmt: str, path: str, keys: list[str]) -> None:
    if fmt == "deepspeed":
        text = json.dumps(to_dict(deepspeed_dict(cfg)), indent=2) + "\n"  # to_dict: AUTO -> "auto"
    else:
        data = zerofit_dict(cfg, keys) if fmt == "zerofit" else accelerate_dict(cfg)
        text = yaml.safe_dump(to_dict(data), sort_keys=False)
    if path == STDOUT:
        sys.stdout.write(text)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _said(value: Any) -> Any:
    return "auto (planned at launch)" if is_auto(value) else value


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    cfg = load_config(None, overrides=settings)
    write(cfg, args.format, args.output, list(settings))
    where = "stdout" if args.output == STDOUT else args.output
    use = "FILE" if args.output == STDOUT else args.output
    print(f"wrote {args.format} config to {where} (ZeRO stage {_said(cfg.zero.stage)}, offload optimizer "
          f"{_said(cfg.zero.offload_optimizer.device)}, offload param {_said(cfg.zero.offload_param.device)}); "
          f"use it with: "
          f"zerofit launch --config_file {use} train.py", file=sys.stderr if args.output == STDOUT else sys.stdout)
    return 0

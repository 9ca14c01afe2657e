"""A Trainer script under `zerofit launch --cpu`, launched as docs/transformers.md says, sees the launcher's world.

transformers' `TrainingArguments` counts the processes through Accelerate, which counts CPU processes only when
told the run is on CPU (`ACCELERATE_USE_CPU`, which `accelerate launch --cpu` sets, or the script's `--use_cpu`).
Before #37 every rank of a `--cpu` run was a world of one there: all of them acted as Trainer's main process
(both wrote `all_results.json` at once, and `save_metrics` on one could read it half-written), each logged its
own loss and half the total batch, and the loss and gradients came out twice as large. Now the launcher sets
`ACCELERATE_USE_CPU` as Accelerate's does, and a Trainer whose TrainingArguments count another world than
zerofit's is refused at `Trainer(...)`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import trainer_cases as tc  # noqa: E402

from zerofit.errors import ConfigError  # noqa: E402
from zerofit.testing.distributed import run_distributed  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "run_trainer_tiny.py"
CONFIG = Path(__file__).parent / "scripts" / "zerofit_stage2_cpu.yaml"
PER_DEVICE, ACCUMULATION = 4, 2


def _launch(out: Path, *script_args: str) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ZEROFIT_CONFIG_FILE", "OMP_NUM_THREADS", "ACCELERATE_USE_CPU")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    command = [sys.executable, "-m", "zerofit.cli.main", "launch", "--cpu", "--num_processes", "2",
               "--config_file", str(CONFIG), str(SCRIPT), "--output_dir", str(out),
               "--per_device_train_batch_size", str(PER_DEVICE), "--gradient_accumulation_steps", str(ACCUMULATION),
               "--max_steps", "2", "--save_steps", "2", "--logging_steps", "1", "--report_to", "none",
               "--learning_rate", "1e-3", "--seed", "0", "--disable_tqdm", "true", "--log_level", "info",
               *script_args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc.stdout + proc.stderr


def test_a_trainer_under_zerofit_launch_cpu_sees_the_launchers_world(tmp_path):
    logged = {}
    for variant, extra in (("as the docs say", ()), ("with --use_cpu", ("--use_cpu", "true"))):
        out = tmp_path / variant.replace(" ", "_")
        text = _launch(out, *extra)
        # the two processes share one stdout: their lines may run into each other, so find each record
        seen = sorted((json.loads(m) for m in re.findall(r"world: (\{[^}]*\})", text)), key=lambda s: s["rank"])
        assert [(s["world_size"], s["process_index"], s["device"].split(":")[0]) for s in seen] == \
            [(2, 0, "cpu"), (2, 1, "cpu")], variant
        assert [s["should_save"] for s in seen] == [True, False], variant  # rank 0 alone writes files
        # Trainer's main process alone logs: one line of the global batch, one set of losses
        totals = re.findall(r"Total train batch size [^=]*= (\d+)", text)
        assert totals == [str(PER_DEVICE * ACCUMULATION * 2)], totals
        losses = [json.loads(m.replace("'", '"'))["loss"] for m in re.findall(r"\{'loss'[^}]*\}", text)]
        assert len(losses) == 2, (variant, losses)
        logged[variant] = losses
        results = json.loads((out / "all_results.json").read_text())  # whole: written by one process
        assert results.keys() == json.loads((out / "train_results.json").read_text()).keys() >= {"train_loss"}
        assert (out / "checkpoint-2" / "trainer_state.json").is_file() and (out / "model.safetensors").is_file()
    # the loss of 2 processes, each scaled for the world it is in (it was twice this before)
    assert logged["as the docs say"] == logged["with --use_cpu"]


def _trainer_in_a_world_of_one(rank, world, root):
    import transformers

    from zerofit.integrations.transformers import Trainer

    os.environ.pop("ACCELERATE_USE_CPU", None)  # started by hand, not by `zerofit launch`: nobody said "CPU"
    args = transformers.TrainingArguments(output_dir=root, per_device_train_batch_size=2, max_steps=1,
                                          report_to=[], use_cpu=False)
    with pytest.raises(ConfigError, match=r"TrainingArguments counts 1 process\(es\) \(this one is process 0\), "
                                          rf"but zerofit runs on 2 \(this one is rank {rank}\).*ACCELERATE_USE_CPU"):
        Trainer(model=tc.tiny_gpt2(), args=args, train_dataset=tc.token_data())
    return args.world_size


def test_a_trainer_that_counts_another_world_than_zerofit_is_refused(tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("on a GPU machine TrainingArguments counts GPU processes without being told")
    assert run_distributed(_trainer_in_a_world_of_one, 2, str(tmp_path), timeout=180) == [1, 1]

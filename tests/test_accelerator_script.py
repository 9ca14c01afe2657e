"""An official-style `no_trainer` script, changed only in its imports, through `zerofit launch` on 2 CPU ranks.

tests/scripts/run_clm_no_trainer_tiny.py follows transformers' run_clm_no_trainer.py (accumulate,
backward, optimizer/scheduler/zero_grad every micro-step, gather_for_metrics, trackers,
save_pretrained with accelerator.save) with a tiny GPT-2 built from a config.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "run_clm_no_trainer_tiny.py"
CONFIG = ROOT / "tests" / "scripts" / "zerofit_stage2_cpu.yaml"
CORPUS = ROOT / "src" / "zerofit" / "demo" / "corpus.txt"

ACCELERATE_IMPORTS = {
    "from zerofit import Accelerator": "from accelerate import Accelerator",
    "from zerofit.logging import get_logger": "from accelerate.logging import get_logger",
    "from zerofit.utils import set_seed": "from accelerate.utils import set_seed",
}


def test_the_script_differs_from_its_accelerate_version_only_in_the_imports():
    code = [line for line in SCRIPT.read_text().splitlines() if "zerofit" in line]
    body = [line for line in code if not line.startswith(("from zerofit", "It is written", "the characters",
                                                          '"zerofit:"', "    zerofit launch"))]
    assert body == []
    imports = [line.split("  #")[0] for line in code if line.startswith("from zerofit")]
    assert sorted(imports) == sorted(ACCELERATE_IMPORTS)


def test_no_trainer_script_trains_evaluates_and_saves_under_zero2_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROFIT_CONFIG_FILE", "OMP_NUM_THREADS")}
    proc = subprocess.run(
        [sys.executable, "-m", "zerofit.cli.main", "launch", "--cpu", "--num_processes", "2", "--config_file",
         str(CONFIG), str(SCRIPT), "--train_file", str(CORPUS), "--output_dir", str(out), "--with_tracking",
         "--report_to", "jsonl"],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Distributed environment: DEEPSPEED (ZeRO stage 2)" in proc.stderr
    results = json.loads((out / "all_results.json").read_text())
    assert results["distributed_type"] == "DEEPSPEED"
    assert results["eval_count"] == results["eval_dataset"]  # gather_for_metrics dropped the repeated samples
    assert results["completed_steps"] == 8  # 59 blocks / (4 per rank * 2 ranks) = 8 batches, 4 steps, 2 epochs
    assert results["last_lr"] == 0.0  # the linear schedule ended exactly at max_train_steps
    assert math.log(results["perplexity"]) < results["first_train_loss"] - 0.2
    lines = (out / "clm_no_trainer" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [0, 1]
    # what save_pretrained wrote loads with from_pretrained and reproduces the script's last evaluation
    model = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    text = CORPUS.read_text(encoding="utf-8")
    vocab = sorted(set(text))
    ids = [vocab.index(c) for c in text]
    blocks = [ids[i:i + 32] for i in range(0, (len(ids) // 32) * 32, 32)]
    evaluation = torch.tensor(blocks[len(blocks) * 9 // 10:])
    # 7 eval blocks, global batch 8: rank 1's batch is blocks 4-6 plus block 0 repeated; the script
    # repeats each batch's mean loss per row and gather_for_metrics keeps the first 7 rows
    rank_batches = [evaluation[0:4], torch.cat([evaluation[4:7], evaluation[0:1]])]
    with torch.no_grad():
        losses = [model(input_ids=b, labels=b).loss for b in rank_batches]
    weighted = (losses[0] * 4 + losses[1] * 3) / 7
    assert math.exp(weighted.item()) == pytest.approx(results["perplexity"], rel=1e-4)

"""Accelerate's global state inside a zerofit run says what zerofit says (#38).

Libraries under zerofit's Trainer ask Accelerate's singletons, not the Accelerator they were given:
TRL's GRPO / RLOO call `set_seed(seed, device_specific=True)` (reads `AcceleratorState()`), and the
object collectives read `PartialState()`. On 2 gloo ranks, after a zerofit Trainer is built at ZeRO-3,
each of those calls answers with zerofit's rank, world and device, the seed is Accelerate's per-rank
seed, and nothing claims DeepSpeed (which would send TRL down paths that import deepspeed).
"""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import torch  # noqa: E402

from zerofit.errors import ConfigError  # noqa: E402
from zerofit.testing.distributed import run_distributed  # noqa: E402


def _ask_accelerate(rank: int, world: int, config_file: str, out_dir: str) -> dict:
    import os

    os.environ["ZEROFIT_CONFIG_FILE"] = config_file
    import accelerate
    import transformers
    from accelerate.utils import broadcast_object_list, gather, gather_object, set_seed

    from zerofit.integrations.transformers import Trainer

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8,
                                                                 n_layer=1, n_head=1, bos_token_id=0, eos_token_id=0))
    args = transformers.TrainingArguments(output_dir=out_dir, use_cpu=True, report_to=[], max_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": torch.zeros(4, dtype=torch.long)}])
    partial, state = accelerate.PartialState(), accelerate.state.AcceleratorState()
    set_seed(7, device_specific=True)
    drawn = torch.rand(3)
    torch.manual_seed(7 + rank)  # what Accelerate's set_seed promises: seed + process_index
    expected = torch.rand(3)
    return {
        "partial": (partial.process_index, partial.num_processes, partial.local_process_index,
                    partial.device.type, partial.is_main_process, partial.distributed_type.value),
        "state": (state.process_index, state.num_processes, state.local_process_index, state.device.type,
                  state.is_main_process, state.distributed_type.value, state.mixed_precision,
                  state.deepspeed_plugin),
        "seeded": bool(torch.equal(drawn, expected)),
        "gather_object": gather_object([f"rank{rank}"]),
        "broadcast": broadcast_object_list([f"from{rank}", rank * 10]),
        "gather": gather(torch.tensor([rank + 1.0])).tolist(),
        "trainer_plugin": trainer.accelerator.state.deepspeed_plugin,
        "zero_stage": trainer.accelerator.config.zero.stage,
        "deepspeed_imported": "deepspeed" in __import__("sys").modules,
    }


def test_accelerates_state_functions_answer_with_zerofits_run(tmp_path):
    config = tmp_path / "zero3.json"
    config.write_text('{"zero_optimization": {"stage": 3}}')
    results = run_distributed(_ask_accelerate, 2, str(config), str(tmp_path / "out"), timeout=240)
    for rank, got in enumerate(results):
        assert got["partial"] == (rank, 2, rank, "cpu", rank == 0, "MULTI_CPU")
        assert got["state"] == (rank, 2, rank, "cpu", rank == 0, "MULTI_CPU", "no", None)
        assert got["seeded"], "set_seed(device_specific=True) must seed with seed + process_index"
        assert got["gather_object"] == ["rank0", "rank1"]
        assert got["broadcast"] == ["from0", 0]
        assert got["gather"] == [1.0, 2.0]
        # the run shards at ZeRO-3, but Trainer and TRL must take their plain paths (no deepspeed import)
        assert got["zero_stage"] == 3 and got["trainer_plugin"] is None and not got["deepspeed_imported"]


class _Rank:
    def __init__(self, index: int, world: int, device: str):
        self.process_index, self.num_processes, self.device = index, world, torch.device(device)
        self.distributed_type = "MULTI_CPU"
        self.mixed_precision = "no"


def test_a_deepspeed_environment_is_refused_by_name(monkeypatch):
    from zerofit.integrations.accelerate_state import share_with_accelerate

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match="ACCELERATE_USE_DEEPSPEED=true .* unset it"):
        share_with_accelerate(_Rank(0, 1, "cpu"))


def test_accelerates_state_for_another_launch_is_refused_naming_both():
    from accelerate.utils import DistributedType

    from zerofit.integrations.accelerate_state import _check_same_process

    theirs = _Rank(1, 4, "cpu")
    theirs.distributed_type = DistributedType.MULTI_CPU
    with pytest.raises(ConfigError, match="says process 1 of 4 on cpu .* zerofit runs process 0 of 2 on cpu"):
        _check_same_process(theirs, _Rank(0, 2, "cpu"))
    _check_same_process(_Rank(0, 2, "cpu:0"), _Rank(0, 2, "cpu"))  # Accelerate's `cpu:0` is zerofit's `cpu`

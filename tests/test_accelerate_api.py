"""The Accelerate names zerofit answers to: scripts change only their imports, so each name must exist and
behave as Accelerate documents (or say clearly what zerofit does instead)."""

from __future__ import annotations

import warnings
from datetime import timedelta

import pytest
import torch
from torch import nn

import zerofit
import zerofit.utils
from zerofit import Accelerator, DistributedType
from zerofit.config import load_config
from zerofit.config.schema import RunConfig
from zerofit.frontend.processes import ProcessMethods, _share
from zerofit.frontend.state import ProcessState
from zerofit.testing.distributed import run_distributed

# What `from accelerate import X` / `from accelerate.utils import X` scripts use and zerofit provides.
TOP_LEVEL = ["Accelerator", "PartialState", "DistributedType", "DeepSpeedPlugin", "DataLoaderConfiguration",
             "DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs", "AutocastKwargs",
             "GradientAccumulationPlugin", "ProjectConfiguration", "find_executable_batch_size",
             "init_empty_weights", "init_on_device", "ProfileKwargs", "FullyShardedDataParallelPlugin"]
UTILS = ["set_seed", "DummyOptim", "DummyScheduler", "ProjectConfiguration", "DistributedType", "DeepSpeedPlugin",
         "DataLoaderConfiguration", "DistributedDataParallelKwargs", "InitProcessGroupKwargs",
         "GradientAccumulationPlugin", "GradScalerKwargs", "broadcast", "broadcast_object_list", "gather",
         "gather_object", "pad_across_processes", "reduce", "send_to_device", "tqdm", "is_deepspeed_available",
         "write_basic_config", "find_executable_batch_size", "init_empty_weights", "ProfileKwargs",
         "DDPCommunicationHookType", "is_schedulefree_available", "FullyShardedDataParallelPlugin",
         "is_npu_available", "is_xpu_available"]
ACCELERATOR = ["prepare", "prepare_model", "prepare_data_loader", "prepare_optimizer", "prepare_scheduler",
               "backward", "accumulate", "no_sync", "clip_grad_norm_", "autocast", "skip_first_batches", "gather",
               "gather_for_metrics", "reduce", "pad_across_processes", "wait_for_everyone", "main_process_first",
               "local_main_process_first", "print", "free_memory", "clear", "init_trackers", "get_tracker", "log",
               "end_training", "unwrap_model", "save_state", "load_state", "save_model", "save",
               "register_for_checkpointing", "get_state_dict", "on_main_process", "on_local_main_process",
               "on_last_process", "on_process", "split_between_processes", "set_trigger", "check_trigger", "profile"]
ACCELERATOR_PROPERTIES = ["device", "process_index", "local_process_index", "num_processes", "is_main_process",
                          "is_local_main_process", "is_last_process", "mixed_precision", "distributed_type",
                          "gradient_accumulation_steps", "sync_gradients", "use_distributed", "deepspeed_plugin",
                          "deepspeed_config", "optimizer_step_was_skipped", "project_dir", "logging_dir",
                          "scaler", "_models", "parallelism_config"]


def test_the_accelerate_names_exist():
    assert [n for n in TOP_LEVEL if not hasattr(zerofit, n)] == []
    assert [n for n in UTILS if not hasattr(zerofit.utils, n)] == []
    assert [n for n in ACCELERATOR if not callable(getattr(Accelerator, n, None))] == []
    assert [n for n in ACCELERATOR_PROPERTIES if not isinstance(getattr(Accelerator, n, None), property)] == []


def test_every_supported_name_is_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "accelerate.md").read_text(encoding="utf-8")
    missing = [n for n in TOP_LEVEL + UTILS + ACCELERATOR + ACCELERATOR_PROPERTIES if f"`{n}`" not in doc]
    assert missing == []


def test_distributed_type_has_accelerates_members_and_aliases():
    for name in ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_XPU", "DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM"):
        assert getattr(DistributedType, name).value == name
    assert DistributedType.TPU is DistributedType.XLA  # Accelerate's deprecated spelling
    assert DistributedType.ZERO is DistributedType.DEEPSPEED  # zerofit's older name
    assert DistributedType("DEEPSPEED") == "DEEPSPEED"


def test_split_between_processes_gives_contiguous_shares_the_first_ones_larger():
    items = list(range(7))
    assert [_share(items, r, 3, False) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [_share(items, r, 3, True) for r in range(3)] == [[0, 1, 2], [3, 4, 6], [5, 6, 6]]
    assert _share({"a": [1, 2, 3], "b": ("x", "y", "z")}, 1, 2, False) == {"a": [3], "b": ("z",)}
    assert torch.equal(_share(torch.arange(5), 1, 2, True), torch.tensor([3, 4, 4]))
    assert _share(items, 0, 1, False) is items


class _Proc(ProcessMethods):
    def __init__(self, rank, world):
        self.process = ProcessState(rank, world, rank, torch.device("cpu"), None)


def test_on_process_decorators_run_only_where_asked():
    ran = []
    for rank in range(3):
        p = _Proc(rank, 3)
        p.on_main_process(lambda r=rank: ran.append(("main", r)))()
        p.on_last_process(lambda r=rank: ran.append(("last", r)))()
        p.on_process(process_index=1)(lambda r=rank: ran.append(("one", r)))()
        p.on_local_main_process()(lambda r=rank: ran.append(("local", r)))()
        with p.split_between_processes(["a", "b", "c", "d"]) as mine:
            ran.append(("share", rank, tuple(mine)))
    assert ran == [("main", 0), ("local", 0), ("share", 0, ("a", "b")), ("one", 1), ("share", 1, ("c",)),
                   ("last", 2), ("share", 2, ("d",))]
    with pytest.raises(ValueError, match="on_process needs process_index="):
        _Proc(0, 2).on_process(lambda: None)


def _triggers_and_broadcasts(rank, world):
    from zerofit.utils import broadcast, broadcast_object_list

    acc = Accelerator(config=RunConfig(), cpu=True)
    before = acc.check_trigger()
    if rank == 1:
        acc.set_trigger()
    during, after = acc.check_trigger(), acc.check_trigger()
    tensors = broadcast({"t": torch.full((2,), float(rank))}, from_process=1)
    objects = broadcast_object_list([f"rank{rank}", rank], from_process=1)
    with acc.split_between_processes(list(range(5)), apply_padding=True) as mine:
        gathered = acc.gather(torch.tensor(mine))
    return before, during, after, tensors["t"].tolist(), objects, gathered.tolist(), acc.use_distributed


def test_triggers_broadcasts_and_split_padding_on_two_ranks():
    for result in run_distributed(_triggers_and_broadcasts, 2, timeout=120):
        assert result == (False, True, False, [1.0, 1.0], ["rank1", 1], [0, 1, 2, 3, 4, 4], True)


def test_accelerator_reads_accelerates_configuration_objects():
    acc = Accelerator(config=RunConfig(), gradient_accumulation_plugin=zerofit.GradientAccumulationPlugin(num_steps=4),
                      dataloader_config=zerofit.DataLoaderConfiguration(split_batches=True),
                      kwargs_handlers=[zerofit.InitProcessGroupKwargs(timeout=timedelta(seconds=77)),
                                       zerofit.DistributedDataParallelKwargs()])
    assert acc.gradient_accumulation_steps == 4 and acc.split_batches
    assert acc.config.launch.process_group_timeout == 77
    assert not acc.use_distributed and acc.distributed_type == DistributedType.NO
    with pytest.warns(UserWarning, match=r"DistributedDataParallelKwargs\(find_unused_parameters=True\)\]\) is "
                                         r"ignored by zerofit: zerofit's engine reduces gradients itself"):
        Accelerator(config=RunConfig(),
                    kwargs_handlers=[zerofit.DistributedDataParallelKwargs(find_unused_parameters=True)])


def test_a_deepspeed_plugin_in_code_sets_the_zero_settings(tmp_path):
    plugin = zerofit.DeepSpeedPlugin(zero_stage=3, offload_optimizer_device="cpu", offload_param_device="cpu",
                                     gradient_accumulation_steps=2, gradient_clipping=0.5)
    acc = Accelerator(config=RunConfig(), deepspeed_plugin=plugin)
    z = acc.config.zero
    assert (z.stage, z.offload_optimizer.device, z.offload_param.device) == (3, "cpu", "cpu")
    assert acc.gradient_accumulation_steps == 2 and acc.config.gradient_clipping == 0.5
    assert acc.distributed_type == DistributedType.DEEPSPEED
    assert acc.deepspeed_config["zero_optimization"]["stage"] == 3
    assert acc.deepspeed_plugin.zero_stage == 3
    ds = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
          "train_micro_batch_size_per_gpu": "auto"}
    acc = Accelerator(config=RunConfig(), deepspeed_plugin=zerofit.DeepSpeedPlugin(hf_ds_config=ds))
    assert acc.config.zero.stage == 2 and acc.config.optimizer.type == "AdamW"
    assert "optimizer" in acc.deepspeed_plugin.deepspeed_config
    with pytest.raises(TypeError, match="takes a zerofit.DeepSpeedPlugin"):
        Accelerator(config=RunConfig(), deepspeed_plugin={"zero_stage": 2})


def test_find_executable_batch_size_halves_until_it_fits():
    tried = []

    @zerofit.find_executable_batch_size(starting_batch_size=128)
    def train(batch_size, scale):
        tried.append(batch_size)
        if batch_size > 20:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return batch_size * scale

    assert train(2) == 32 and tried == [128, 64, 32, 16]
    with pytest.raises(TypeError, match="without the batch size"):
        train(8, 2)

    @zerofit.find_executable_batch_size(starting_batch_size=2)
    def never(batch_size):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    with pytest.raises(RuntimeError, match="no batch size fits in memory"):
        never()


def test_init_empty_weights_builds_on_meta_and_prepare_materialises():
    with zerofit.init_empty_weights():
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    assert all(p.is_meta for p in model.parameters())
    acc = Accelerator(config=RunConfig())
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss = model(torch.ones(2, 4)).sum()
    acc.backward(loss)
    opt.step()
    assert torch.isfinite(loss) and not any(p.is_meta for p in model.parameters())


def test_small_utils(tmp_path, monkeypatch):
    assert isinstance(zerofit.utils.is_deepspeed_available(), bool)
    path = zerofit.utils.write_basic_config(mixed_precision="bf16", save_location=tmp_path / "basic.yaml")
    assert load_config(path).precision.mixed_precision == "bf16"
    assert zerofit.utils.write_basic_config(save_location=path) is False
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert zerofit.utils.tqdm(range(3)).disable and not zerofit.utils.tqdm(range(3), main_process_only=False).disable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Accelerator(config=RunConfig(), kwargs_handlers=[zerofit.GradScalerKwargs()])  # defaults: silent
        Accelerator(config=RunConfig(), kwargs_handlers=[zerofit.DistributedDataParallelKwargs(
            comm_hook=zerofit.utils.DDPCommunicationHookType.NO)])  # Accelerate's ddp_comm_hook example, hook off


def test_an_fsdp_script_imports_and_its_plugin_is_ignored_with_a_warning_naming_the_stage():
    """accelerate's fsdp_with_peak_mem_tracking.py: its imports, its plugin, its device branches."""
    from zerofit import FullyShardedDataParallelPlugin
    from zerofit.utils import is_npu_available, is_xpu_available

    plugin = FullyShardedDataParallelPlugin(state_dict_config=object(), limit_all_gathers=True)
    assert plugin.settings["limit_all_gathers"] is True and "limit_all_gathers=True" in repr(plugin)
    with pytest.warns(UserWarning, match=r"Accelerator\(fsdp_plugin=\.\.\.\) is accepted for compatibility and ignored "
                                         r"by zerofit: zerofit shards with its own ZeRO engine, as the config's "
                                         r"zero\.stage says .*FULL_SHARD"):
        acc = Accelerator(config=RunConfig(), fsdp_plugin=plugin)
    assert acc.distributed_type == DistributedType.NO
    assert (is_npu_available(), is_xpu_available(), is_xpu_available(check_device=True)) == (False, False, False)
    assert zerofit.utils.FullyShardedDataParallelPlugin is FullyShardedDataParallelPlugin


def test_local_sgd_is_a_plain_loop_on_one_process_and_a_clear_error_on_several():
    from types import SimpleNamespace

    from zerofit.local_sgd import LocalSGD

    with LocalSGD(accelerator=SimpleNamespace(num_processes=1), model=None, local_sgd_steps=8) as local:
        local.step()
    assert local.num_steps == 1
    LocalSGD(accelerator=SimpleNamespace(num_processes=2), model=None, local_sgd_steps=8, enabled=False)
    with pytest.raises(NotImplementedError, match="LocalSGD is not supported by zerofit.*raise gradient_accumulation"):
        LocalSGD(accelerator=SimpleNamespace(num_processes=2), model=None, local_sgd_steps=8)


def test_the_prepared_model_has_ddps_no_sync():
    acc = Accelerator(config=RunConfig())
    model = nn.Linear(4, 1)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with model.no_sync():
        assert acc._no_sync_depth == 1
    assert acc._no_sync_depth == 0


def test_profile_runs_torch_profiler_and_writes_a_trace_per_process(tmp_path):
    acc = Accelerator(config=RunConfig(), kwargs_handlers=[zerofit.ProfileKwargs(
        activities=["cpu"], record_shapes=True, output_trace_dir=str(tmp_path / "traces"))])
    with acc.profile() as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    assert any("mm" in e.key for e in prof.key_averages())
    assert (tmp_path / "traces" / "trace_rank_0.json").is_file()
    with pytest.raises(ValueError, match=r"\['tpu'\] not known: use 'cpu' and/or 'cuda'"):
        with acc.profile(zerofit.ProfileKwargs(activities=["tpu"])):
            pass


def test_gradient_accumulation_steps_can_be_set_before_prepare():
    acc = Accelerator(config=RunConfig())
    acc.gradient_accumulation_steps = 4  # as Accelerate's automatic_gradient_accumulation example does
    assert acc.gradient_accumulation_steps == 4 and acc.config.batch.gradient_accumulation_steps == 4
    with pytest.raises(ValueError, match="must be a whole number >= 1"):
        acc.gradient_accumulation_steps = 0
    model = nn.Linear(4, 1)
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert acc._prepared.trained_engine().gradient_accumulation_steps == 4
    with pytest.raises(ValueError, match="set it before prepare"):
        acc.gradient_accumulation_steps = 2


# --- what transformers' Trainer reads besides the documented API (trainer-integration.md section 3.1) ----
def test_a_loop_that_sets_sync_gradients_itself_steps_only_on_sync_micro_steps():
    # Trainer's loop: no accumulate(); _set_sync_gradients every micro-step, the loss divided by its own
    # accumulation steps, optimizer.step() on sync micro-steps only, then model.zero_grad()
    torch.manual_seed(0)
    model, ref = nn.Linear(4, 1), nn.Linear(4, 1)
    ref.load_state_dict(model.state_dict())
    acc = Accelerator(config=RunConfig())
    state = acc.gradient_state
    assert state.plugin_kwargs == {"num_steps": 1, "adjust_scheduler": True, "sync_with_dataloader": True,
                                   "sync_each_batch": False}
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(12, 4)
    for step in range(6):
        sync = step % 3 == 2
        state._set_sync_gradients(sync)
        assert acc.sync_gradients is sync and state.sync_gradients is sync
        batch = x[2 * step:2 * step + 2]
        acc.backward(model(batch).pow(2).mean() / 3)
        (ref(batch).pow(2).mean() / 3).backward()
        if sync:
            opt.step()
            ref_opt.step()
            ref_opt.zero_grad()
        model.zero_grad()
    assert opt.steps_taken == 2
    for name, value in acc.get_state_dict(model).items():
        torch.testing.assert_close(value, ref.state_dict()[name], atol=1e-6, rtol=0)
    acc.gradient_state.gradient_accumulation_steps = 4
    assert acc.gradient_state.plugin_kwargs["num_steps"] == 4


def test_scaler_models_and_parallelism_config_as_trainer_reads_them():
    acc = Accelerator(config=RunConfig())
    assert acc.scaler is None and acc._models == [] and acc.parallelism_config is None
    model, frozen = nn.Linear(4, 1), nn.Linear(2, 2)
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    frozen = acc.prepare(frozen)
    assert acc._models == [model, frozen]  # in the order they were prepared
    assert acc.scaler is None  # fp32: no loss scaling
    acc.free_memory()
    assert acc._models == []


def test_the_fp16_scaler_is_the_engines_and_its_state_round_trips_as_trainer_saves_it(tmp_path):
    acc = Accelerator(mixed_precision="fp16", config=RunConfig())
    assert acc.scaler is None  # no engine before prepare()
    model = nn.Linear(4, 1)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = acc.scaler
    assert scaler is acc._prepared.trained_engine().scaler and scaler.get_scale() == 2.0 ** 16
    acc.backward(model(torch.randn(2, 4)).float().pow(2).mean())
    opt.step()
    path = tmp_path / "scaler.pt"  # transformers' _save_scaler / _load_scaler
    torch.save(acc.scaler.state_dict(), path)
    saved = acc.scaler.state_dict()
    scaler.scale, scaler.iteration = 8.0, 99
    acc.scaler.load_state_dict(torch.load(path, weights_only=True))
    assert acc.scaler.state_dict() == saved and saved["iteration"] == 1

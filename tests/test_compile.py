"""`torch.compile` with a prepared model, on 2 gloo ranks: every way a script compiles trains as eager does.

The backend is "aot_eager" (dynamo and AOTAutograd, eager kernels): inductor works on CPU too, but its
first compile costs 6-9 s per model here, too slow for the suite; aot_eager runs the same graph
capture and graph breaks, so losses equal the eager run's exactly. See zerofit.frontend.compiling.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from engine_cases import SEQ, VOCAB, TinyLM, loss_fn

from zerofit import Accelerator
from zerofit.cli.main import main
from zerofit.config import load_config
from zerofit.config.schema import CompileConfig, OffloadConfig, RunConfig, ZeroConfig
from zerofit.distributed.runtime import CONFIG_FILE_ENV
from zerofit.errors import ConfigError
from zerofit.frontend.compiling import compile_options, requested, uncompiled
from zerofit.testing.distributed import run_distributed

STEPS = 3


def _train(rank: int, stage: int, offload: bool, precision: str, way: str):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    zero = ZeroConfig(stage=stage, param_persistence_threshold=0,
                      offload_optimizer=OffloadConfig(device="cpu" if offload else "none"))
    section = CompileConfig(backend="AOT_EAGER", regional=way.endswith("regional")) if way.startswith("config") \
        else CompileConfig()  # the section an Accelerate YAML's dynamo_config is read into
    acc = Accelerator(config=RunConfig(zero=zero, compile=section), mixed_precision=precision,
                      dynamo_backend="AOT_EAGER" if way == "dynamo_backend" else None)
    torch.manual_seed(0)
    model = TinyLM()
    if way == "torch.compile before":
        model = torch.compile(model, backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prepared, opt = acc.prepare(model, opt)
    assert prepared is model
    if way == "torch.compile after":
        prepared = torch.compile(prepared, backend="aot_eager")
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randint(0, VOCAB, (4, SEQ), generator=g), torch.randint(0, VOCAB, (4, SEQ), generator=g)
        with acc.accumulate(prepared), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn(prepared(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    compiled = [name for name, m in prepared.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
    return {"losses": losses, "graphs": counters["stats"]["unique_graphs"], "compiled": compiled,
            "keys": sorted(acc.get_state_dict(prepared)), "unwrapped": type(acc.unwrap_model(
                prepared, keep_torch_compile=False)).__name__}


def compile_ways(rank: int, world: int, cases: list[tuple]):
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = {}
        for case in cases:
            if case[:3] not in eager:
                eager[case[:3]] = _train(rank, *case[:3], "eager")
            out[case] = eager[case[:3]], _train(rank, *case)
    return out


# (stage, optimizer offloaded to the host, precision, how the script compiles); "config regional": the config's
# compile section (an Accelerate YAML's dynamo_config) with regional: true (dynamo_use_regional_compilation)
CASES = [(0, False, "no", "dynamo_backend"), (1, True, "no", "torch.compile before"),
         (2, False, "bf16", "torch.compile after"), (3, True, "bf16", "dynamo_backend"),
         (3, True, "bf16", "config regional")]
# the modules compiled in place: the whole model, or regionally each block and the modules around them
COMPILED = {"dynamo_backend": [""], "torch.compile before": [], "torch.compile after": [],
            "config regional": ["emb", "blocks.0", "blocks.1", "blocks.2", "head"]}


def test_every_way_of_compiling_trains_as_eager_at_every_stage():
    results = run_distributed(compile_ways, 2, CASES, timeout=240)
    for case in CASES:
        for eager, compiled in (r[case] for r in results):
            # one graph at stages 0-2 (offload too); at stage 3 the unit hooks split it, and the 3 blocks share
            # one: the engine's hooks are not traced (nor recompiled per unit). Regionally: the blocks' one graph
            # (torch's own Embedding and Linear run eagerly: dynamo does not trace torch.nn's frames by themselves)
            assert compiled["graphs"] == (3 if case[0] == 3 else 1), case
            assert compiled["compiled"] == COMPILED[case[3]], case
            assert eager["graphs"] == 0 and eager["compiled"] == [], case
            assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-6, abs=1e-6), case
            assert compiled["keys"] == eager["keys"], case  # no `_orig_mod.` prefix, whatever the way
            assert compiled["unwrapped"] == "TinyLM", case


@dataclass
class _Plugin:  # the fields of Accelerate's TorchDynamoPlugin that model.compile takes
    backend: str = "INDUCTOR"
    mode: str = "default"
    fullgraph: bool = False
    dynamic: bool | None = None
    options: dict | None = None
    disable: bool = False


def test_compile_options_from_accelerate_arguments():
    assert compile_options() is None
    assert compile_options("no") is None and compile_options("NO") is None
    assert compile_options("INDUCTOR") == {"backend": "inductor"}
    assert compile_options(dynamo_plugin=_Plugin(mode="max-autotune", dynamic=False)) == {
        "backend": "inductor", "mode": "max-autotune", "dynamic": False}
    assert compile_options(dynamo_plugin=_Plugin(disable=True)) is None
    regional = requested(None, {"backend": "eager", "use_regional_compilation": True}, RunConfig())
    assert regional.options == {"backend": "eager"} and regional.regional
    with pytest.raises(ValueError, match=r"dynamo_backend=3\): name a torch.compile backend .* or 'no'"):
        compile_options(3)


def test_uncompiled_looks_through_the_compile_wrapper_only():
    model = torch.nn.Linear(2, 2)
    assert uncompiled(model) is model
    assert uncompiled(torch.compile(model, backend="eager")) is model


def test_fullgraph_with_engine_hooks_in_the_forward_is_an_error_naming_the_fix():
    config = RunConfig(zero=ZeroConfig(stage=2, offload_optimizer=OffloadConfig(device="cpu")))
    acc = Accelerator(config=config, dynamo_plugin={"backend": "eager", "fullgraph": True})
    model = TinyLM()
    with pytest.raises(ValueError, match=r"fullgraph=True cannot hold an offloaded optimizer .* set fullgraph=False"):
        acc.prepare(model, torch.optim.AdamW(model.parameters()))


# --- an Accelerate YAML's dynamo_config, through `zerofit launch` -------------------------------------------------

CHECK = Path(__file__).parent / "scripts" / "allreduce_check.py"


def _yaml(tmp_path: Path, dynamo: str, head: str = "distributed_type: 'NO'\nnum_processes: 1\n") -> Path:
    path = tmp_path / "accelerate.yaml"
    path.write_text(f"compute_environment: LOCAL_MACHINE\n{head}{dynamo}")
    return path


def _compiled_at_prepare(acc: Accelerator, model: torch.nn.Module | None = None) -> bool:
    model = model or TinyLM()
    prepared, _ = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    return prepared._compiled_call_impl is not None


def test_dynamo_config_reaches_the_workers_accelerator_and_an_argument_of_the_script_wins(tmp_path, capsys,
                                                                                         monkeypatch):
    config = _yaml(tmp_path, "dynamo_config:\n  dynamo_backend: AOT_EAGER\n  dynamo_mode: default\n"
                             "  dynamo_use_fullgraph: false\n  dynamo_use_dynamic: false\n"
                             "  dynamo_use_regional_compilation: false\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read without a warning (it used to say the launcher ignores it)
        assert main(["launch", "--dry-run", "--config_file", str(config), str(CHECK)]) == 0
    resolved = tmp_path / "resolved.yaml"  # what the launcher hands every worker (ZEROFIT_CONFIG_FILE)
    resolved.write_text(capsys.readouterr().out)
    monkeypatch.setenv(CONFIG_FILE_ENV, str(resolved))
    acc = Accelerator()
    assert acc._compile.options == {"backend": "aot_eager", "dynamic": False}
    assert _compiled_at_prepare(acc)
    assert not _compiled_at_prepare(Accelerator(dynamo_backend="no"))  # the script's argument replaces the section
    assert Accelerator(dynamo_plugin={"backend": "eager"})._compile.options == {"backend": "eager"}
    mine = TinyLM()
    mine.compile(backend="eager")  # the script compiled it itself: not compiled again
    own = mine._compiled_call_impl
    assert _compiled_at_prepare(Accelerator(), mine) and mine._compiled_call_impl is own


def test_dynamo_backend_no_runs_eagerly_and_the_older_top_level_key_is_read(tmp_path):
    assert Accelerator(config=load_config(_yaml(tmp_path, "dynamo_config:\n  dynamo_backend: 'NO'\n")))._compile \
        is None
    assert load_config(_yaml(tmp_path, "dynamo_backend: INDUCTOR\n")).compile.backend == "INDUCTOR"
    both = load_config(_yaml(tmp_path, "dynamo_backend: INDUCTOR\ndynamo_config:\n  backend: eager\n"))
    assert both.compile.backend == "eager"  # dynamo_config wins; `backend` is accelerate launch's dynamo_backend


def test_an_unknown_backend_stops_the_launch_naming_the_key_the_value_and_the_choices(tmp_path, capsys):
    config = _yaml(tmp_path, "dynamo_config:\n  dynamo_backend: INDUCTR\n")
    assert main(["launch", "--config_file", str(config), str(CHECK)]) == 2  # before any worker starts
    assert re.search(r"dynamo_config.dynamo_backend 'INDUCTR' is not a torch.compile backend of this torch: "
                     r"choose one of aot_eager, .*inductor.* \(torch._dynamo.list_backends\(\)\), or no",
                     capsys.readouterr().err)
    with pytest.raises(ConfigError, match=r"compile.backend 'tensorrt' is not a torch.compile backend"):
        load_config(None, overrides={"compile.backend": "tensorrt"})  # zerofit's own spelling of the key


@pytest.mark.parametrize(("dynamo", "message"), [
    ("dynamo_config: inductor\n", r"dynamo_config must be a mapping of dynamo_\* keys \(got 'inductor'\)"),
    ("dynamo_config:\n  dynamo_use_fulgraph: true\n", r"did you mean dynamo_config.dynamo_use_fullgraph\?"),
    ("dynamo_config:\n  dynamo_mode: fast\n", r"dynamo_config.dynamo_mode must be one of 'default', "),
])
def test_a_malformed_dynamo_config_is_an_error_naming_the_key(tmp_path, dynamo, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_yaml(tmp_path, dynamo))


def test_fullgraph_from_the_yaml_with_engine_hooks_names_the_yaml_key(tmp_path):
    head = ("distributed_type: DEEPSPEED\nnum_processes: 1\ndeepspeed_config:\n  zero_stage: 2\n"
            "  offload_optimizer_device: cpu\n")
    config = load_config(_yaml(tmp_path, "dynamo_config:\n  dynamo_backend: eager\n  dynamo_use_fullgraph: true\n",
                               head))
    with pytest.raises(ValueError, match=r"dynamo_config.dynamo_use_fullgraph true cannot hold an offloaded "
                                         r"optimizer .* set dynamo_config.dynamo_use_fullgraph to false"):
        _compiled_at_prepare(Accelerator(config=config))

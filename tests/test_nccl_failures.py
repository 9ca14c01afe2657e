"""Failures under NCCL are named too (#30 items 3 and 6), without a GPU: the launcher's summary reads the flight
recorder's dumps (written here as torch 2.11-2.13 write them: a pickle of plain dicts), the environment the
launcher gives the workers, an OOM inside a collective, and the process group's end after end_training."""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from zerofit.cli import flight_recorder, launch
from zerofit.cli.failure_report import NcclRun, summary
from zerofit.config.schema import LaunchConfig, RunConfig
from zerofit.distributed import failures, process_group
from zerofit.errors import CollectiveError

TARGET = ("train.py",)
PREFIX = "nccl_trace_rank_"


def _entry(seq, op, state, numel=1024, dtype="BFloat16", out=None, frames=()):
    """One flight-recorder entry with the keys torch's FlightRecorder::getCollectiveTrace writes."""
    return {"frames": list(frames), "record_id": seq, "pg_id": 0, "process_group": ("0", "default_pg"),
            "thread_name": "python", "thread_id": "1", "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": f"nccl:{op}", "time_created_ns": seq, "input_sizes": [[numel]],
            "input_dtypes": [dtype], "output_sizes": [[out or numel]], "output_dtypes": [dtype], "state": state,
            "time_discovered_started_ns": None, "time_discovered_completed_ns": None, "retired": False,
            "timeout_ms": 300_000, "is_p2p": False}


def _dump(folder, rank, entries):
    data = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
            "comm_lib_version": "2.28.3", "pg_status": {"0": {"last_enqueued_collective": len(entries)}},
            "entries": entries}
    (folder / f"{PREFIX}{rank}").write_bytes(pickle.dumps(data, protocol=2))


def _aborted(local_rank=0):
    return SimpleNamespace(exitcode=-6, error_file_data={}, message="Signal 6 (SIGABRT) received",
                           local_rank=local_rank, signal_name=lambda: "SIGABRT")


def _nccl(folder):
    return NcclRun(timeout_s=1800.0, dump_prefix=str(folder / PREFIX))


def test_a_sigabrt_under_nccl_is_named_with_the_rank_that_is_behind(tmp_path):
    frames = [{"name": "all_gather", "filename": "/x/torch/distributed/distributed_c10d.py", "line": 1},
              {"name": "run", "filename": "/x/zerofit/engine/comm.py", "line": 2},
              {"name": "gather", "filename": "/x/zerofit/engine/stage3.py", "line": 99}]
    _dump(tmp_path, 0, [_entry(1, "all_gather", "completed"),
                        _entry(2, "_reduce_scatter_base", "started", 2048, out=1024, frames=frames)])
    _dump(tmp_path, 1, [_entry(1, "all_gather", "completed")])
    lines = summary("train.py", {0: _aborted(), 1: _aborted(1)}, 0, _nccl(tmp_path)).splitlines()
    assert lines[0] == "zerofit launch: train.py failed: rank 0 first (local rank 0, exit code -6): stopped by SIGABRT"
    said = "\n".join(lines)
    # the timeout the stuck collective had (300 s in its dump), not the launcher's 1800
    assert "likely cause: NCCL's watchdog ended a collective that waited longer than the process-group timeout " \
           "(300 s, launch.process_group_timeout, --process_group_timeout SECONDS)" in said
    assert ("    rank 0: last completed #1 all_gather [1024] BFloat16; stuck in #2 _reduce_scatter_base in [2048] "
            "BFloat16 out [1024] BFloat16, called from gather (zerofit/engine/stage3.py:99)") in lines
    assert "    rank 1: last completed #1 all_gather [1024] BFloat16; nothing pending (issued up to #1)" in lines
    assert ("  rank 1 is behind: issued collectives up to #1, rank 0 up to #2; "
            "rank 1 never reached collective #2") in said
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in said


def test_ranks_stuck_in_different_collectives_are_named(tmp_path):
    _dump(tmp_path, 0, [_entry(1, "all_gather", "completed"), _entry(2, "all_gather", "started")])
    _dump(tmp_path, 1, [_entry(1, "all_gather", "completed"), _entry(2, "all_reduce", "started", 1)])
    said = summary("t.py", {0: _aborted(), 1: _aborted(1)}, 1, _nccl(tmp_path))
    assert ("the ranks are stuck in different collectives (they issued them in a different order): "
            "rank 0 #2 all_gather [1024] BFloat16; rank 1 #2 all_reduce [1] BFloat16") in said


def test_without_dumps_the_cause_is_still_said_and_a_bad_dump_is_one_line(tmp_path):
    said = summary("t.py", {0: _aborted()}, 0, _nccl(tmp_path))
    assert "(1800 s, launch.process_group_timeout" in said and "no NCCL flight-recorder dump was found" in said
    (tmp_path / f"{PREFIX}0").write_bytes(b"not a pickle")
    (tmp_path / f"{PREFIX}1").write_bytes(pickle.dumps({"entries": [], "x": dataclasses.field}))  # a class: refused
    lines = summary("t.py", {0: _aborted(), 1: _aborted()}, 0, _nccl(tmp_path)).splitlines()
    bad = [line for line in lines if "could not read the flight-recorder dump" in line]
    assert len(bad) == 2 and "UnpicklingError" in bad[1], lines
    old = tmp_path / "old"
    old.mkdir()
    _dump(old, 0, [_entry(1, "all_gather", "started")])  # an earlier run's dump under the same prefix
    assert "rank 0:" not in summary("t.py", {0: _aborted()}, 0,
                                    NcclRun(1800.0, str(old / PREFIX), since=os.path.getmtime(old / f"{PREFIX}0") + 1))


def test_the_watchdog_text_names_the_cause_and_a_plain_sigabrt_under_gloo_does_not():
    failure = SimpleNamespace(exitcode=1, local_rank=0, message="", error_file_data={"message": {"message": (
        "DistBackendError: [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
        "OpType=ALLGATHER) ran for 300001 milliseconds before timing out.")}})
    assert "likely cause: NCCL's watchdog" in summary("t.py", {1: failure}, 1)
    assert "watchdog" not in summary("t.py", {0: _aborted()}, 0)  # gloo: SIGABRT is not the watchdog's


def test_a_dump_torch_writes_reads_back():
    """The format check against the installed torch: its own flight recorder (gloo keeps one too in 2.13)."""
    dump_fr = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump_fr is None or dist.is_initialized():
        pytest.skip("this torch has no flight-recorder dump for gloo")
    with _one_rank_group():
        dist.all_reduce(torch.ones(3))
        data = pickle.loads(dump_fr())
    calls = flight_recorder._collectives(data)
    assert calls and calls[-1].op == "all_reduce" and calls[-1].sizes == "[3] Float", calls
    assert calls[-1].caller and "test_nccl_failures.py" in calls[-1].caller


def test_the_launcher_switches_the_flight_recorder_on_only_for_nccl_and_keeps_only_dumps(monkeypatch):
    for var in (*flight_recorder.TEMP_FILE_VARS, *flight_recorder.BUFFER_VARS, "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    gpu = launch.plan_launch(_config(num_processes=2), TARGET, gpu_count=2)
    with launch.nccl_tracing(gpu) as (env, nccl):
        folder = os.path.dirname(env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"])
        assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                       "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(folder, PREFIX)}
        assert nccl.dump_prefix == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] and nccl.timeout_s == 1800
    assert not os.path.exists(folder)  # nothing dumped: nothing left
    with launch.nccl_tracing(gpu) as (env, _):
        open(env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] + "0", "wb").close()
    kept = os.path.dirname(env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"])
    assert os.path.isfile(os.path.join(kept, f"{PREFIX}0"))  # the evidence stays
    os.remove(os.path.join(kept, f"{PREFIX}0"))
    os.rmdir(kept)
    with launch.nccl_tracing(launch.plan_launch(_config(num_processes=2), TARGET, gpu_count=0)) as (env, nccl):
        assert (env, nccl) == ({}, None)
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/mine/trace_")
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "50")
    assert flight_recorder.env("/f") == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}  # the user's choices win
    assert flight_recorder.dump_prefix(os.environ) == "/mine/trace_"


def _config(**la) -> RunConfig:
    return RunConfig(launch=dataclasses.replace(LaunchConfig(), **la))


def test_nccl_sockets_stay_on_loopback_and_one_named_interface_serves_both(monkeypatch):
    monkeypatch.setattr(launch, "loopback_interface", lambda: "lo")
    one = launch.plan_launch(_config(num_processes=2), TARGET, gpu_count=2)
    assert launch.network_env(one, {}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "=lo"}
    assert launch.network_env(one, {"NCCL_SOCKET_IFNAME": "eth0"}) == {"GLOO_SOCKET_IFNAME": "lo"}
    assert launch.network_env(one, {"GLOO_SOCKET_IFNAME": "lo"}) == {"NCCL_SOCKET_IFNAME": "=lo"}
    two = launch.plan_launch(_config(num_processes=4, num_machines=2, main_process_ip="10.0.0.1"), TARGET,
                             gpu_count=2)
    assert launch.network_env(two, {}) == {}
    assert launch.network_env(two, {"GLOO_SOCKET_IFNAME": "ib0,eth0"}) == {"NCCL_SOCKET_IFNAME": "=ib0,eth0"}
    assert launch.network_env(two, {"NCCL_SOCKET_IFNAME": "eth0"}) == {"GLOO_SOCKET_IFNAME": "eth0"}
    assert launch.network_env(two, {"NCCL_SOCKET_IFNAME": "^docker,lo"}) == {}  # not a list gloo reads
    assert launch.network_env(two, {"NCCL_SOCKET_IFNAME": "a", "GLOO_SOCKET_IFNAME": "b"}) == {}


def test_an_out_of_memory_error_inside_a_collective_passes_through_unchanged():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(torch.OutOfMemoryError) as raised, failures.named("all_gather:unit3", 0):
        raise oom
    assert raised.value is oom  # the back-off sees the OOM itself
    with pytest.raises(CollectiveError, match="collective all_gather:unit3 failed because another rank left"), \
            failures.named("all_gather:unit3", 0):
        raise RuntimeError("Connection closed by peer")


class _one_rank_group:
    def __enter__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    def __exit__(self, *exc):
        if dist.is_initialized():
            dist.destroy_process_group()


def test_end_training_leaves_the_group_usable_and_it_is_destroyed_at_a_normal_exit(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group is already open in this process")
    handlers = []
    monkeypatch.setattr(process_group.atexit, "register", lambda fn, *a: handlers.append((fn, a)))
    monkeypatch.setattr(process_group, "_end_registered", False)
    with _one_rank_group():
        process_group.destroy_at_exit()
        process_group.destroy_at_exit()  # end_training twice registers once
        assert len(handlers) == 1 and dist.is_initialized()
        dist.barrier()  # a save after end_training still has its group
        fn, args = handlers[0]
        monkeypatch.setattr("sys.last_exc", None, raising=False)  # pytest records a failed test's error there
        monkeypatch.setattr("sys.last_value", RuntimeError("failed"), raising=False)
        fn(*args)
        assert dist.is_initialized()  # a failed exit destroys nothing
        monkeypatch.setattr("sys.last_value", None)
        fn(*args)
        assert not dist.is_initialized()

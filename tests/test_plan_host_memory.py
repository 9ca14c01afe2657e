"""The host memory the planner budgets ([Note: host memory that grows], #30 item 6), read from fake /proc
and /sys trees: `MemTotal` on an ordinary machine, a smaller cgroup limit where one binds, and memory
that grows as it is used said (never counted) with the setting that gives the real figure."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_plan_step_time import COUNTS, WORK

from zerofit.plan import choose
from zerofit.plan.choose import machine_budget, plan
from zerofit.plan.host_memory import HostMemory, read_host_memory
from zerofit.plan.memory import Setting

GIB = 2**30
KB_31_GIB = 31 * 2**20


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _machine(root: Path, *, mem_kb: int = KB_31_GIB, balloon_kb: int = 0, cgroup: str = "0::/\n",
             blocks: tuple[str, ...] = ("online",) * 4, extra: dict[str, str] | None = None) -> Path:
    files = {"proc/meminfo": f"MemTotal:       {mem_kb} kB\nMemFree:        1000 kB\nBalloon:        {balloon_kb} kB\n",
             "proc/self/cgroup": cgroup, "sys/devices/system/memory/block_size_bytes": "8000000\n",
             "sys/bus/virtio/devices/virtio0/device": "0x0005\n"}  # a balloon device, as on every lent VM
    files |= {f"sys/devices/system/memory/memory{i}/state": f"{state}\n" for i, state in enumerate(blocks)}
    return _tree(root, files | (extra or {}))


def test_an_ordinary_machine_budgets_mem_total(tmp_path):
    got = read_host_memory(_machine(tmp_path))
    assert got == HostMemory(total_bytes=31 * GIB, source="MemTotal")
    assert got.note() == ""


def test_nothing_readable_is_unknown(tmp_path):
    assert read_host_memory(tmp_path).total_bytes is None


@pytest.mark.parametrize("cgroup, files, expected, source", [
    ("0::/job/step\n", {"sys/fs/cgroup/job/step/memory.max": "max\n", "sys/fs/cgroup/job/memory.max": "8589934592\n"},
     8 * GIB, "/sys/fs/cgroup/job/memory.max"),  # an ancestor's limit binds too
    ("0::/\n", {"sys/fs/cgroup/memory.max": "4294967296\n"}, 4 * GIB, "/sys/fs/cgroup/memory.max"),  # a namespace
    ("4:memory:/docker/abc\n2:cpu:/\n", {"sys/fs/cgroup/memory/memory.limit_in_bytes": "2147483648\n"},
     2 * GIB, "/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # v1, the container's own cgroup at the mount
    ("4:memory:/a\n", {"sys/fs/cgroup/memory/a/memory.limit_in_bytes": "9223372036854771712\n"},
     31 * GIB, "MemTotal"),  # v1's "no limit"
    ("0::/job\n", {"sys/fs/cgroup/job/memory.max": "549755813888\n"}, 31 * GIB, "MemTotal"),  # above MemTotal
    ("0::/job\n", {"sys/fs/cgroup/job/memory.max": "garbage\n"}, 31 * GIB, "MemTotal"),
])
def test_a_cgroup_limit_below_mem_total_is_the_budget(tmp_path, cgroup, files, expected, source):
    got = read_host_memory(_machine(tmp_path, cgroup=cgroup, extra=files))
    assert (got.total_bytes, got.source, got.note()) == (expected, source, "")


def test_offline_memory_blocks_are_said_not_counted(tmp_path):
    root = _machine(tmp_path, blocks=("online", "offline", "offline", "online", "offline"))
    got = read_host_memory(root)
    assert got.total_bytes == 31 * GIB  # the doubt goes to the smaller figure
    assert got.note() == ("host memory read as 31.0 GiB (MemTotal) may grow as it is used on this machine (3 memory "
                          "blocks offline, 0.4 GiB): set ZEROFIT_HOST_MEMORY_GIB to the GiB this machine may use to "
                          "plan for it")


def test_virtio_mem_a_balloon_and_a_cgroup_ceiling_are_said(tmp_path):
    root = _machine(tmp_path, balloon_kb=2 * 2**20, cgroup="0::/vm\n",
                    extra={"sys/bus/virtio/devices/virtio7/device": "0x0018\n",
                           "sys/fs/cgroup/vm/memory.max": str(256 * GIB)})
    got = read_host_memory(root)
    assert got.total_bytes == 31 * GIB and got.ceiling_bytes == 256 * GIB
    assert "(a virtio-mem device; a balloon holding 2.0 GiB, up to 256.0 GiB by the cgroup limit)" in got.note()
    assert got.note("--host_memory_gib").count("set --host_memory_gib to") == 1


def test_a_cgroup_limit_that_binds_leaves_nothing_to_say(tmp_path):
    root = _machine(tmp_path, blocks=("offline",) * 3, cgroup="0::/\n",
                    extra={"sys/fs/cgroup/memory.max": str(16 * GIB)})
    assert read_host_memory(root) == HostMemory(total_bytes=16 * GIB, source="/sys/fs/cgroup/memory.max")


def test_the_plan_names_the_override_where_memory_may_grow(tmp_path, monkeypatch):
    root = _machine(tmp_path, blocks=("offline",) * 2)
    monkeypatch.setattr(choose, "read_host_memory", lambda: read_host_memory(root))
    budget = machine_budget(gpu_memory_gib=80, ranks_per_host=8)
    assert budget.host_bytes == 31 * GIB and "ZEROFIT_HOST_MEMORY_GIB" in budget.host_note
    reason = plan(COUNTS, WORK, budget, {False: None}, settings=[Setting(stage=0)]).reason
    assert reason.endswith(f"; {budget.host_note}")
    tiny = machine_budget(gpu_memory_gib=0.001)  # nothing fits: the note is there too
    assert plan(COUNTS, WORK, tiny, {False: None}, settings=[Setting(stage=0)]).reason.endswith(tiny.host_note)
    written = machine_budget(gpu_memory_gib=80, host_memory_gib=512)  # the override set: nothing to say
    assert written.host_note == "" and written.host_bytes == 512 * GIB
